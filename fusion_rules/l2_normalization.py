"""L2Normalization at a fixed width → the generated row-norm kernel (rstd = rsqrt(sum(x^2) + eps),
no gamma; the backward reads the saved rstd). TE runs it as torch.compile'd PyTorch. At a width
no op fixes (a size-generic pipeline) the norm kernels, built per width, cannot take it: the
opaque rule runs its reference math there."""

from fusegen.ir import Sym
from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import NORM


def _at_a_fixed_width(ops) -> int:
    op = ops[0]
    return int(op.kind == "l2_normalization" and not isinstance(op.in_features, Sym))


FORWARD_L2_NORMALIZATION = Rule(
    name="l2_normalization", pass_=FORWARD, stage=NORM,
    doc="row-norm kernel (sum of squares, no gamma); saves fp32 rstd",
    match=_at_a_fixed_width, covers=frozenset({"l2_normalization"}),
)
BACKWARD_L2_NORMALIZATION = Rule(
    name="l2_normalization_backward", pass_=BACKWARD, stage=NORM,
    doc="norm dx kernel from the saved rstd", match=_at_a_fixed_width, covers=frozenset({"l2_normalization"}),
)
