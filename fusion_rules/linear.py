"""BasicLinear → cuBLAS GEMMs through torch: forward y = x W^T; backward dgrad dy W, wgrad dy^T x."""

from fusegen.plan import BACKWARD, FORWARD, Rule, pattern

FORWARD_LINEAR = Rule(name="linear", pass_=FORWARD, stage="gemm", doc="GEMM", match=pattern("linear"))
BACKWARD_LINEAR = Rule(
    name="linear_backward", pass_=BACKWARD, stage="gemm", doc="dgrad and wgrad GEMMs", match=pattern("linear"),
)
