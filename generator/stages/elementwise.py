"""Elementwise stages: a run of bias, activation, GLU, scale and extra input/output ops as ONE
generated kernel per pass (a run holds at most one GLU: it halves the width).

Forward: one pass over memory; a MakeExtraOutput whose value equals the run's input or output is
handed out as that tensor instead of written. Backward: one kernel producing the run's input grad
with every Bias gradient (column sum) fused as deterministic per-block partials; forward values
the backward needs are recomputed in registers from the nearest value the forward materialised
(``Recompute``), never saved. A run that changes nothing (MakeExtraOutput alone forward,
AddExtraInput alone backward) is a passthrough: no kernel, names alias.
"""

from __future__ import annotations

from .. import kernels as kn
from ..ops import ELEMENTWISE_KINDS
from .base import Recompute, Saves, StageImpl, extra_input_name, extra_output_name, param_name, value_name


def _operand_op(em, stage, name: str, prefix: str):
    """The op a launcher operand names, e.g. 'bias2' (prefix 'bias') is the stage's op 2."""
    return em.pipeline.ops[stage.start + int(name[len(prefix):])]


class ElementwiseStage(StageImpl):
    name = "elementwise"

    def check(self, pass_, chain):
        other = [kind for kind in chain if kind not in ELEMENTWISE_KINDS]
        if other:
            return f"an elementwise stage runs only elementwise ops ({', '.join(sorted(ELEMENTWISE_KINDS))}), not {other[0]}"
        if list(chain).count("glu") > 1:
            return "an elementwise stage holds at most one GLU (it halves the width)"
        return None

    def kind(self, pass_, ops):
        if pass_ == "forward":
            active = any(op.opdef.changes_value for op in ops)
        else:
            active = any(op.opdef.changes_grad or op.kind == "bias" for op in ops)
        return self.name if active else "passthrough"

    def saves(self, pipeline, stage, have):
        if stage.kind == "passthrough":
            return Saves()
        needing = [op.index for op in stage.ops if op.opdef.needs_input_in_backward]
        if not needing:
            return Saves()
        start = max(p for p in have if stage.start <= p <= needing[0])
        extra = {op.extra_input for op in pipeline.ops[start:needing[-1]] if op.extra_input is not None}
        return Saves(values=frozenset({start}), extra_inputs=frozenset(extra), recompute=Recompute(start, needing[-1]))

    def kernels(self, plan, stage, pass_):
        if stage.kind == "passthrough":
            return []
        if pass_ == "forward":
            return [kn.elementwise_forward(plan.pipeline, stage)]
        spec = kn.elementwise_backward(plan, stage)
        return [spec, *([kn.column_sum(spec.ctx["bias_columns"])] if spec.ctx["bias_columns"] else [])]

    def forward(self, em, stage, block):
        p = em.pipeline
        x_in, out = em.values[stage.start], value_name(p, stage.end)
        if stage.kind == "passthrough":  # MakeExtraOutput hands out its input as is
            for op in stage.ops:
                if op.kind == "make_extra_output":
                    block.lines.append(f"{extra_output_name(op)} = {x_in}")
            return x_in
        spec = em.kernel("forward", stage)
        io = kn.launcher_io(spec)
        operands = [param_name(_operand_op(em, stage, o, "bias"), "bias") if o.startswith("bias")
                    else extra_input_name(_operand_op(em, stage, o, "extra_in")) for o in io["operands"]]
        results = [out] + [extra_output_name(_operand_op(em, stage, w, "extra_out")) for w in io["written"]]
        block.lines.append(f"{', '.join(results)} = kernels.{spec.name}({', '.join([x_in] + operands)})")
        for index, alias in kn.forward_aliases(stage).items():
            if alias != "write":
                block.lines.append(f"{extra_output_name(p.ops[index])} = {x_in if alias == 'input' else out}")
        return out

    def backward(self, em, stage, block, dy, d_in):
        p = em.pipeline
        if stage.kind == "passthrough":  # AddExtraInput hands its grad to both inputs
            for op in stage.ops:
                if op.kind == "add_extra_input":
                    block.lines.append(f"d_{extra_input_name(op)} = {dy}")
            return dy
        spec = em.kernel("backward", stage)
        io = kn.launcher_io(spec)
        operands = []
        for o in io["operands"]:
            if o == "x":
                operands.append(em.values[em.plan.recompute[stage.start].saved_position])
            elif o.startswith("bias"):
                operands.append(param_name(_operand_op(em, stage, o, "bias"), "bias"))
            elif o.startswith("extra_in"):
                operands.append(extra_input_name(_operand_op(em, stage, o, "extra_in")))
            else:
                operands.append("d_" + extra_output_name(_operand_op(em, stage, o, "d_extra_out")))
        if not spec.ctx["writes_dx"]:
            d_in = dy
        names = {"dx": d_in}
        names.update({f"d_extra_in{op.index - stage.start}": "d_" + extra_input_name(op)
                      for op in stage.ops if op.kind == "add_extra_input"})
        names.update({f"dbias{op.index - stage.start}": "d_" + param_name(op, "bias")
                      for op in stage.ops if op.kind == "bias"})
        block.lines.append(f"{', '.join(names[r] for r in io['returned'])} = kernels.{spec.name}({', '.join([dy] + operands)})")
        for index, alias in kn.backward_aliases(stage).items():
            if alias != "write":
                block.lines.append(f"d_{extra_input_name(p.ops[index])} = {dy if alias == 'dy' else d_in}")
        return d_in


ELEMENTWISE = ElementwiseStage()
