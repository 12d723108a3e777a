"""A collective op over the tensor-parallel group (ops/collectives.py) → its own stage, run through
PyTorch's collectives under autograd between the fused stages (stages/collective.py)."""

from fusegen.ops.collectives import KINDS
from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import COLLECTIVE


def _one_collective(ops):
    return 1 if ops[0].kind in KINDS else 0


FORWARD_COLLECTIVE = Rule(
    name="collective", pass_=FORWARD, stage=COLLECTIVE, doc="a collective over the tensor-parallel group",
    match=_one_collective, covers=KINDS,
)
BACKWARD_COLLECTIVE = Rule(
    name="collective_backward", pass_=BACKWARD, stage=COLLECTIVE,
    doc="the collective's pair, through autograd (an all-gather's reduce-scatter, and the reverse)",
    match=_one_collective, covers=KINDS,
)
