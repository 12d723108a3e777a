"""Backward: MakeExtraOutput, BasicLinear → the dgrad GEMM accumulates into the extra output's
gradient (beta=1), so the two gradients are never added by a separate kernel (TE: BackwardLinearAdd)."""

from fusegen.plan import BACKWARD, Rule
from fusegen.stages import GEMM

BACKWARD_EXTRA_OUTPUT_LINEAR = Rule(
    name="extra_output_linear_backward", pass_=BACKWARD, stage=GEMM,
    doc="dgrad GEMM accumulates into the extra output's grad (beta=1)",
    pattern=("make_extra_output", "linear"),
)
