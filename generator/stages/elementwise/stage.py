"""Elementwise stages: a run of ops that have a ``functor_form`` (bias, activations, GLUs, scales,
extra inputs and outputs, and plugins' ops) as ONE generated kernel per pass. A run holds at most
one GLU (it halves the width).

Forward: one pass over memory; a MakeExtraOutput whose value equals the run's input or output is
handed out as that tensor instead of written. Backward: one kernel producing the run's input grad,
with every reduced operand grad (a Bias's column sum, a learnable scalar's total) fused as
deterministic per-block partials (at a few rows a fixed-width kernel with only column sums runs
column-tiled instead and adds them itself, in the same launch); forward values the backward needs
are recomputed in registers from the nearest value the forward materialised (``Recompute``), never
saved. A run that changes nothing (MakeExtraOutput alone forward, AddExtraInput alone backward) is
a passthrough: no kernel, names alias.

Every op reaches the kernel as data (``_step``): its functor and constants, its operand and how
that operand's grad is reduced; the templates compose them with no per-op code.
"""

from __future__ import annotations

from ...ops import elementwise_kinds
from ..base import (NO_TRAFFIC, Recompute, RowTraffic, Saves, StageImpl, extra_input_name, extra_output_name,
                    fixed, value_name)
from ..column_sum import column_sum
from .kernels import backward_kernel, forward_kernel
from .steps import backward_aliases, forward_aliases, io_names, operand_width, random_ops, seed_name
# the stage's methods keep the names these had when they were private to this module
from .steps import grad_is_reduced as _reduced, reads_operand as _reads_operand
from .steps import width_halving_kinds as _width_halving_kinds


class ElementwiseStage(StageImpl):
    name = "elementwise"

    def check(self, pass_, chain):
        kinds = elementwise_kinds()
        other = [kind for kind in chain if kind not in kinds]
        if other:
            return f"an elementwise stage runs only elementwise ops ({', '.join(sorted(kinds))}), not {other[0]}"
        if sum(kind in _width_halving_kinds() for kind in chain) > 1:
            return "an elementwise stage holds at most one GLU (it halves the width)"
        return None

    def kind(self, pass_, ops):
        if pass_ == "forward":
            active = any(op.opdef.changes_value for op in ops)
        else:
            active = any(op.opdef.changes_grad or _reduced(op) for op in ops)
        return self.name if active else "passthrough"

    def saves(self, pipeline, stage, have):
        if stage.kind == "passthrough":
            return Saves()
        # extra inputs the backward functors read (a product's operand), and the forward values
        # they need, recomputed from the nearest one the forward materialised
        extra = {op.extra_input for op in stage.ops if _reads_operand(op) and op.extra_input is not None}
        needing = [op.index for op in stage.ops if op.opdef.needs_input_in_backward]
        if not needing:
            return Saves(extra_inputs=frozenset(extra))
        if not any(stage.start <= p <= needing[0] for p in have):
            # nothing before the op is materialised (a GEMM epilogue ran it): its output serves
            # when its backward reads that as well as its input (OpDef.backward_from_output)
            op = pipeline.ops[needing[0]]
            assert op.opdef.backward_from_output and op.index + 1 in have, \
                f"{op.describe()}: its backward needs a value no stage materialised (a rule bug)"
            extra |= {o.extra_input for o in pipeline.ops[op.index + 1:needing[-1]] if o.extra_input is not None}
            return Saves(values=frozenset({op.index + 1}), extra_inputs=frozenset(extra),
                         recompute=Recompute(op.index + 1, needing[-1], output_for=op.index))
        start = max(p for p in have if stage.start <= p <= needing[0])
        extra |= {op.extra_input for op in pipeline.ops[start:needing[-1]] if op.extra_input is not None}
        return Saves(values=frozenset({start}), extra_inputs=frozenset(extra), recompute=Recompute(start, needing[-1]))

    def saved_names(self, em, stage):
        """The keys of the random ops this backward stage replays (their masks are regenerated)."""
        return [seed_name(op) for op in random_ops(stage.ops)]

    def saved_shapes(self, em, stage):
        return {seed_name(op): ("[1]", "int64") for op in random_ops(stage.ops)}  # one key per call

    def kernels(self, plan, stage, pass_):
        """The run's kernel (size-generic in a size-generic pipeline), its column sum, and the
        fixed-size kernels the pipeline is specialised for (its launcher dispatches to them)."""
        if stage.kind == "passthrough":
            return []
        specialise = plan.pipeline.specialise
        if pass_ == "forward":
            return [forward_kernel(plan.pipeline, stage), *(forward_kernel(plan.pipeline, stage, n) for n in specialise)]
        spec = backward_kernel(plan, stage)
        column_grads = any(step["grad"] == "column" for step in spec.ctx["steps"])
        return [spec, *([column_sum(spec.ctx["grad_columns"])] if column_grads else []),
                *(backward_kernel(plan, stage, n) for n in specialise)]

    def row_traffic(self, plan, pass_, stage):
        if stage.kind == "passthrough":  # aliases: nothing moves
            return NO_TRAFFIC
        p = plan.pipeline
        if pass_ == "backward":
            spec, recompute = backward_kernel(plan, stage), plan.recompute.get(stage.start)
            widths = {"dy": p.width(stage.end), "dx": p.width(stage.start),
                      "x": p.width(recompute.saved_position) if recompute is not None else None}
            names = ["dy", *spec.operands, *spec.returned]
        else:
            spec = forward_kernel(p, stage)
            widths = {"x": p.width(stage.start), "y": p.width(stage.end)}
            names = ["x", *spec.operands, *spec.returned]
        sizes = [widths[name] if name in widths else operand_width(p, stage, name) for name in names]
        return RowTraffic(sum(sizes)) if fixed(*sizes) else None

    def forward(self, em, stage, block):
        p = em.pipeline
        x_in, out = em.values[stage.start], value_name(p, stage.end)
        if stage.kind == "passthrough":  # MakeExtraOutput hands out its input as is
            for op in stage.ops:
                if op.extra_output is not None:
                    em.alias(block, extra_output_name(op), x_in)
            return x_in
        spec = em.kernel("forward", stage)
        for op in random_ops(stage.ops):  # a fresh key per call; None in eval mode (keep all)
            block.lines.append(f"{seed_name(op)} = ref.new_seed({x_in}) if training else None")
        names = {"y": out, **io_names(stage)}
        block.lines.append(f"{', '.join(names[r] for r in spec.returned)} = "
                           f"kernels.{spec.name}({', '.join([x_in] + [names[o] for o in spec.operands])})")
        for index, alias in forward_aliases(stage).items():
            if alias != "write":
                em.alias(block, extra_output_name(p.ops[index]), x_in if alias == "input" else out)
        return out

    def backward(self, em, stage, block, dy, d_in):
        p = em.pipeline
        if stage.kind == "passthrough":  # AddExtraInput hands its grad to both inputs
            for op in stage.ops:
                if op.extra_input is not None:
                    em.grad_alias(block, f"d_{extra_input_name(op)}", dy)
            return dy
        spec = em.kernel("backward", stage)
        if not spec.ctx["writes_dx"]:
            d_in = dy
        names = {"dx": d_in, **io_names(stage)}
        recompute = em.plan.recompute.get(stage.start)
        if recompute is not None:
            names["x"] = em.values[recompute.saved_position]
        block.lines.append(f"{', '.join(names[r] for r in spec.returned)} = "
                           f"kernels.{spec.name}({', '.join([dy] + [names[o] for o in spec.operands])})")
        for index, alias in backward_aliases(stage).items():
            if alias != "write":
                em.grad_alias(block, f"d_{extra_input_name(p.ops[index])}", dy if alias == "dy" else d_in)
        return d_in


ELEMENTWISE = ElementwiseStage()
