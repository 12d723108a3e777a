"""LayerNorm | RMSNorm → a generated row-norm kernel (forward keeps fp32 statistics for the backward:
LayerNorm's mean and rstd, RMSNorm's rstd; backward computes dx with deterministic dgamma/dbeta
partials, which the kernel itself adds at a few rows, else one column-sum kernel)."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import NORM

FORWARD_NORM = Rule(
    name="norm", pass_=FORWARD, stage=NORM,
    doc="row-norm kernel; with autograd on, keeps its fp32 statistics for the backward (LayerNorm: mean "
        "and rstd; RMSNorm: rstd)",
    pattern=("norm",),
)
BACKWARD_NORM = Rule(
    name="norm_backward", pass_=BACKWARD, stage=NORM,
    doc="norm dx kernel with deterministic dgamma/dbeta", pattern=("norm",),
)
