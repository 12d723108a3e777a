"""LayerNorm | RMSNorm → a generated row-norm kernel (forward saves fp32 mean/rstd; backward
computes dx with deterministic dgamma/dbeta partials, then one column-sum kernel)."""

from fusegen.plan import BACKWARD, FORWARD, Rule, pattern

FORWARD_NORM = Rule(
    name="norm", pass_=FORWARD, stage="norm",
    doc="row-norm kernel; saves fp32 mean/rstd", match=pattern("norm"),
)
BACKWARD_NORM = Rule(
    name="norm_backward", pass_=BACKWARD, stage="norm",
    doc="norm dx kernel with deterministic dgamma/dbeta", match=pattern("norm"),
)
