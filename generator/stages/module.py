"""Module stages: a module of the user's code (ops/module.py), run as it is between fused stages.

Forward: the module runs on the running tensor with its leading dims (``{hint}_lead``, handed in
by the generated module) under autograd, on a copy of a detached input that requires grad (a copy,
so that an in-place module, ``nn.LeakyReLU(inplace=True)``, may write it as it may any tensor of
eager autograd, and leaves the value the fused stages keep as it is); its own graph, from that input
and its parameters to its output, is saved with the stage's tensors. Its parameters are inputs of
the generated Function (``*module_params``, each module's in turn, after every other input), so autograd hands their grads
on as it does any other parameter's: into ``.grad``, to ``torch.autograd.grad``, or not at all
when frozen. Backward: the grads of that graph (``ref.module_grads``), which keeps it, as the
Function's other saved tensors are kept, for a backward with ``retain_graph=True`` (gradcheck's).
"""

from __future__ import annotations

from ..source_text import py_string
from .base import StageImpl, value_name


def module_name(op) -> str:
    return f"{op.hint}_module"


def lead_name(op) -> str:
    return f"{op.hint}_lead"


def params_name(op) -> str:
    return f"{op.hint}_params"


def _where(em, op) -> str:
    """The generated module's class and the module's call as the spec writes it, for messages."""
    call = op.args["call"]
    return f'"{em.pipeline.class_name}", {py_string(f"{call} ({op.location})")}'


class ModuleStage(StageImpl):
    name = "module"
    replayable = False

    def check(self, pass_, chain):
        return None if list(chain) == ["module"] else "a module stage runs one module of the user's code"

    def runs_as(self, pass_, stage, kernels):
        return f"`{stage.ops[0].args['target']}` as it is, under autograd ({pass_})"

    def forward(self, em, stage, block):
        op = stage.ops[0]
        x_in, out = em.values[stage.start], value_name(em.pipeline, stage.end)
        h = op.hint
        if not em.saving:  # no grad: the module runs as it is
            block.lines += [
                f"{h}_in = {x_in}.reshape(*{lead_name(op)}, {x_in}.shape[1])",
                f"{h}_out = {module_name(op)}({h}_in)",
                f"ref.check_module_output({_where(em, op)}, {h}_in, {h}_out)",
                f"{out} = {h}_out.reshape({x_in}.shape)",
            ]
            return out
        block.lines += [
            "with torch.enable_grad():  # the module's own graph, for this stage's backward",
            f"    {h}_graph_in = {x_in}.detach().reshape(*{lead_name(op)}, {x_in}.shape[1]).requires_grad_()",
            "    # on a copy, which an in-place module may write (the fused stages keep the value)",
            f"    {h}_graph_out = {module_name(op)}({h}_graph_in.clone())",
            f"ref.check_module_output({_where(em, op)}, {h}_graph_in, {h}_graph_out)",
            "# its parameters: the Function takes them as inputs too, and returns their grads",
            f"ctx.{h}_params = tuple({module_name(op)}.parameters())",
            f"{out} = {h}_graph_out.detach().reshape({x_in}.shape)",
        ]
        return out

    def saved_names(self, em, stage):
        h = stage.ops[0].hint
        return [f"{h}_graph_in", f"{h}_graph_out"]

    def saved_shapes(self, em, stage):
        op = stage.ops[0]
        target = op.args["target"]
        return {f"{op.hint}_graph_in": (f"[*lead, {op.in_features}]", "x's dtype"),
                f"{op.hint}_graph_out": (f"[*lead, {op.out_features}], and with it `{target}`'s own autograd graph: "
                                         "whatever the module keeps for its backward (its size is the module's)",
                                         "what the module returns")}

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        h = op.hint
        block.lines += [
            f"{d_in}, d_{params_name(op)} = ref.module_grads({h}_graph_in, {h}_graph_out, ctx.{h}_params, {dy})",
        ]
        return d_in


MODULE = ModuleStage()
