"""Forward: BasicLinear, Bias → one cuBLAS GEMM with the bias in its epilogue (torch.addmm)."""

from fusegen.plan import FORWARD, Rule
from fusegen.stages import GEMM

FORWARD_LINEAR_BIAS = Rule(
    name="linear_bias", pass_=FORWARD, stage=GEMM,
    doc="GEMM with bias epilogue", pattern=("linear", "bias"),
)
