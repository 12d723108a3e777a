"""Backward: MakeExtraOutput, BasicLinear → the dgrad GEMM accumulates into the extra output's
gradient (beta=1), so the two gradients are never added by a separate kernel (TE: BackwardLinearAdd)."""

from fusegen.plan import BACKWARD, Rule, pattern

BACKWARD_EXTRA_OUTPUT_LINEAR = Rule(
    name="extra_output_linear_backward", pass_=BACKWARD, stage="gemm",
    doc="dgrad GEMM accumulates into the extra output's grad (beta=1)",
    match=pattern("make_extra_output", "linear"),
)
