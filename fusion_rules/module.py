"""A module of the user's code (ops/module.py) → its own stage, run as it is under autograd
(stages/module.py): the fused groups around it are planned on either side."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import MODULE

FORWARD_MODULE = Rule(
    name="module", pass_=FORWARD, stage=MODULE, doc="the module as it is, unfused", pattern=("module",),
)
BACKWARD_MODULE = Rule(
    name="module_backward", pass_=BACKWARD, stage=MODULE, doc="the module's own backward, through autograd",
    pattern=("module",),
)
