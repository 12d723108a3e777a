"""BasicLinear → cuBLAS GEMMs through torch: forward y = x W^T; backward dgrad dy W, wgrad dy^T x."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import GEMM

FORWARD_LINEAR = Rule(name="linear", pass_=FORWARD, stage=GEMM, doc="GEMM", pattern=("linear",))
BACKWARD_LINEAR = Rule(
    name="linear_backward", pass_=BACKWARD, stage=GEMM, doc="dgrad and wgrad GEMMs", pattern=("linear",),
)
