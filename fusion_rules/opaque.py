"""An op registered ``opaque`` (no kernel: a plugin's module fusegen cannot fuse) → its own stage,
running the op's reference math in PyTorch (stages/opaque.py). Last in each pass: any rule that
can fuse an op comes first."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import OPAQUE


def _one_opaque(ops):
    return 1 if ops[0].opdef.opaque else 0


FORWARD_OPAQUE = Rule(
    name="opaque", pass_=FORWARD, stage=OPAQUE, doc="the op's reference forward in PyTorch, unfused",
    match=_one_opaque,
)
BACKWARD_OPAQUE = Rule(
    name="opaque_backward", pass_=BACKWARD, stage=OPAQUE, doc="the op's reference backward in PyTorch, unfused",
    match=_one_opaque,
)
