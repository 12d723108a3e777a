"""LayerNorm | RMSNorm → a generated row-norm kernel (forward saves fp32 mean/rstd; backward
computes dx with deterministic dgamma/dbeta partials, then one column-sum kernel)."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import NORM

FORWARD_NORM = Rule(
    name="norm", pass_=FORWARD, stage=NORM,
    doc="row-norm kernel; saves fp32 mean/rstd", pattern=("norm",),
)
BACKWARD_NORM = Rule(
    name="norm_backward", pass_=BACKWARD, stage=NORM,
    doc="norm dx kernel with deterministic dgamma/dbeta", pattern=("norm",),
)
