"""Module stages: a module of the user's code (ops/module.py), run as it is between fused stages.

Forward: the module runs on the running tensor with its leading dims (``{hint}_lead``, handed in
by the generated module) under autograd, on a detached copy of its input that requires grad, so
its own graph (and its parameters') hangs off the stage; the output must keep the input's shape.
Backward: that graph's backward from the stage's output grad (``torch.autograd.backward`` with
``inputs=``: the input's grad, and the module's parameter grads accumulated into their ``.grad``
as autograd would), then the input's grad handed on. The module object and its lead come in as
arguments of the generated Function (``{hint}_module``, ``{hint}_lead``).
"""

from __future__ import annotations

from .base import StageImpl, value_name


def module_name(op) -> str:
    return f"{op.hint}_module"


def lead_name(op) -> str:
    return f"{op.hint}_lead"


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
                f'ref.check_module_output("{em.pipeline.class_name}", "{op.args["call"]} (op {op.number} at {op.location})", {h}_in, {h}_out)',
                f"{out} = {h}_out.reshape({x_in}.shape)",
            ]
            return out
        block.lines += [
            "with torch.enable_grad():  # the module's own graph, for this stage's backward",
            f"    {h}_graph_in = {x_in}.detach().reshape(*{lead_name(op)}, {x_in}.shape[1]).requires_grad_()",
            f"    {h}_graph_out = {module_name(op)}({h}_graph_in)",
            f'ref.check_module_output("{em.pipeline.class_name}", "{op.args["call"]} (op {op.number} at {op.location})", {h}_graph_in, {h}_graph_out)',
            f"ctx.{h}, ctx.{h}_module = ({h}_graph_in, {h}_graph_out), {module_name(op)}",
            f"{out} = {h}_graph_out.detach().reshape({x_in}.shape)",
        ]
        return out

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        h = op.hint
        block.lines += [
            f"{h}_graph_in, {h}_graph_out = ctx.{h}",
            f"{h}_params = [p for p in ctx.{h}_module.parameters() if p.requires_grad]",
            "with torch.enable_grad():",
            f"    torch.autograd.backward({h}_graph_out, {dy}.reshape({h}_graph_out.shape), inputs=[{h}_graph_in, *{h}_params])",
            f"{d_in} = {h}_graph_in.grad.reshape({dy}.shape)",
        ]
        em.shares_memory(d_in, dy)  # autograd may hand dy itself on (a module that returns its input)
        return d_in


MODULE = ModuleStage()
