"""Module stages: a module of the user's code (ops/module.py), run as it is between fused stages.

Forward: the module runs on the running tensor with its leading dims (``{hint}_lead``, handed in
by the generated module; ``ref.run_module`` checks that it keeps the shape). Under autograd the
fused ops on either side of it are autograd Functions of their own and the module runs between
them in the generated ``grad_forward`` (emit/segments.py), so autograd records it as eager
PyTorch does: its parameters' grads, an in-place module, ``retain_graph``, gradcheck and
torch.compile work as they do for the module alone. Backward: nothing to emit; autograd runs the
module's own backward between the Functions' backwards.
"""

from __future__ import annotations

from ..source_text import py_string
from ..values import lead_name, module_name
from ..calls import ModuleCall
from .base import StageImpl

__all__ = ["MODULE", "lead_name", "module_name"]


def _where(em, op) -> str:
    """The generated module's class and the module's call as the spec writes it, for messages."""
    call = op.args["call"]
    return f'"{em.pipeline.class_name}", {py_string(f"{call} (op {op.number} at {op.location})")}'


class ModuleStage(StageImpl):
    name = "module"
    replayable = False
    between_functions = True

    def check(self, pass_, chain):
        return None if list(chain) == ["module"] else "a module stage runs one module of the user's code"

    def runs_as(self, pass_, stage, kernels):
        return f"`{stage.ops[0].args['target']}` as it is, under autograd ({pass_})"

    def forward(self, em, stage, block):
        op = stage.ops[0]
        block.add(ModuleCall(_where(em, op), op.module_object, stage.input, op.lead, stage.output))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        return d_in  # autograd runs it; d_in (its input's grad value) is the grad output of the Function before it


MODULE = ModuleStage()
