"""Reshape → its own stage: a view of the running tensor (stages/reshape.py). As in TE, it breaks
fusion windows: the ops on either side fuse among themselves."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import RESHAPE

FORWARD_RESHAPE = Rule(
    name="reshape", pass_=FORWARD, stage=RESHAPE, doc="a view of the running tensor, no kernel",
    pattern=("reshape",),
)
BACKWARD_RESHAPE = Rule(
    name="reshape_backward", pass_=BACKWARD, stage=RESHAPE, doc="the grad viewed back, no kernel",
    pattern=("reshape",),
)
