"""A collective op over the tensor-parallel group (ops/collectives.py) → its own stage, run through
PyTorch's collectives under autograd between the fused stages (stages/collective.py)."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import COLLECTIVE

FORWARD_COLLECTIVE = Rule(
    name="collective", pass_=FORWARD, stage=COLLECTIVE, doc="a collective over the tensor-parallel group",
    pattern=("collective",),
)
BACKWARD_COLLECTIVE = Rule(
    name="collective_backward", pass_=BACKWARD, stage=COLLECTIVE,
    doc="the collective's pair, through autograd (an all-gather's reduce-scatter, and the reverse)",
    pattern=("collective",),
)
