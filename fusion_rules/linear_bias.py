"""Forward: BasicLinear, Bias → one cuBLAS GEMM with the bias in its epilogue (torch.addmm)."""

from fusegen.plan import FORWARD, Rule, pattern

FORWARD_LINEAR_BIAS = Rule(
    name="linear_bias", pass_=FORWARD, stage="gemm",
    doc="GEMM with bias epilogue", match=pattern("linear", "bias"),
)
