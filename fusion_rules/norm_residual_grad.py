"""Backward: [AddExtraInput], [MakeExtraOutput], Norm → the norm backward kernel also adds the
extra output's gradient (the residual stream's grad) into dx; AddExtraInput's residual gets that
same dx, so neither needs a kernel of its own (TE: BackwardAddRMSNorm, here for LayerNorm too)."""

from fusegen.plan import BACKWARD, Rule
from fusegen.stages import NORM

BACKWARD_NORM_RESIDUAL_GRAD = Rule(
    name="norm_residual_grad", pass_=BACKWARD, stage=NORM,
    doc="residual-grad add fused into the norm's dx",
    pattern=("add_extra_input?", "make_extra_output?", "norm"),
    min_ops=2,  # a bare norm is the plain norm rule's
)
