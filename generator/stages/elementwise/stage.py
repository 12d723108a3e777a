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

from ...calls import Fp8Produce, Launch
from ...ops import elementwise_kinds
from ...values import seed_name
from ..base import NO_TRAFFIC, Recompute, RowTraffic, Saves, StageImpl, fixed
from ..column_sum import column_sum
from ..gemm import fp8_amax, fp8_only, fp8_operands, fp8_producer
from .kernels import backward_kernel, fp8_variant_fits, forward_kernel
from .steps import (backward_aliases, forward_aliases, grad_is_reduced, io_names, new_seed, operand_width, random_ops,
                    reads_operand, width_halving_kinds)


class ElementwiseStage(StageImpl):
    name = "elementwise"

    def check(self, pass_, chain):
        kinds = elementwise_kinds()
        other = [kind for kind in chain if kind not in kinds]
        if other:
            return f"an elementwise stage runs only elementwise ops ({', '.join(sorted(kinds))}), not {other[0]}"
        if sum(kind in width_halving_kinds() for kind in chain) > 1:
            return "an elementwise stage holds at most one GLU (it halves the width)"
        return None

    def kind(self, pass_, ops):
        if pass_ == "forward":
            active = any(op.opdef.changes_value for op in ops)
        else:
            active = any(op.opdef.changes_grad or grad_is_reduced(op) for op in ops)
        return self.name if active else "passthrough"

    def saves(self, pipeline, stage, have):
        if stage.kind == "passthrough":
            return Saves()
        # extra inputs the backward functors read (a product's operand), and the forward values
        # they need, recomputed from the nearest one the forward materialised
        extra = {op.extra_in for op in stage.ops if reads_operand(op) and op.extra_in is not None}
        needing = [op.index for op in stage.ops if op.opdef.needs_input_in_backward]
        if not needing:
            return Saves(extra_inputs=frozenset(extra))
        # the ops up to the first that needs its input whose input the forward materialised
        readers = [op for op in stage.ops if op.index <= needing[0] and op.input in have]
        if not readers:
            # nothing before the op is materialised (a GEMM epilogue ran it): its output serves
            # when its backward reads that as well as its input (OpDef.backward_from_output)
            op = pipeline.ops[needing[0]]
            assert op.opdef.backward_from_output and op.output in have, \
                f"{op.describe()}: its backward needs a value no stage materialised (a rule bug)"
            extra |= {o.extra_in for o in pipeline.ops[op.index + 1:needing[-1]] if o.extra_in is not None}
            return Saves(values=frozenset({op.output}), extra_inputs=frozenset(extra),
                         recompute=Recompute(op.output, op.index + 1, needing[-1], output_for=op.index))
        start = readers[-1]  # the nearest
        extra |= {op.extra_in for op in pipeline.ops[start.index:needing[-1]] if op.extra_in is not None}
        return Saves(values=frozenset({start.input}), extra_inputs=frozenset(extra),
                     recompute=Recompute(start.input, start.index, needing[-1]))

    def saved_shapes(self, em, stage):
        return {seed_name(op): ("[1]", "int64") for op in random_ops(stage.ops)}  # one key per call

    def kernels(self, plan, stage, pass_):
        """The run's kernel (size-generic in a size-generic pipeline), its column sum, and the
        fixed-size kernels the pipeline is specialised for (its launcher dispatches to them)."""
        if stage.kind == "passthrough":
            return []
        specialise = plan.pipeline.specialise
        sizes = (None, *specialise)  # (None: the run's own size)
        if pass_ == "forward":
            specs = [forward_kernel(plan.pipeline, stage, n) for n in sizes]
            if stage.output in fp8_operands(plan, "forward"):  # an FP8 GEMM's x
                # written in FP8 by the run's kernel where the GEMM alone reads it (fp8_tile.cuh),
                # else the variants that keep its amax for the cast
                if (fp8_variant_fits(specs[0]) and fp8_only(plan, stage.output, "forward")
                        and "output" not in forward_aliases(stage).values()):
                    return [*specs, forward_kernel(plan.pipeline, stage, fp8=True)]
                specs += [forward_kernel(plan.pipeline, stage, n, amax=True) for n in sizes]
            return specs
        spec = backward_kernel(plan, stage)
        column_grads = any(step["grad"] == "column" for step in spec.ctx["steps"])
        specs = [spec, *([column_sum(spec.ctx["grad_columns"])] if column_grads else []),
                 *(backward_kernel(plan, stage, n) for n in specialise)]
        if spec.ctx["writes_dx"] and stage.input in fp8_operands(plan, "backward"):  # dx an FP8 GEMM's dy: likewise
            if (fp8_variant_fits(spec) and fp8_only(plan, stage.input, "backward")
                    and set(backward_aliases(stage).values()) <= {"write", "dy"}):
                return [*specs, backward_kernel(plan, stage, fp8=True)]
            specs += [backward_kernel(plan, stage, n, amax=True) for n in sizes]
        return specs

    def row_traffic(self, plan, pass_, stage):
        if stage.kind == "passthrough":  # aliases: nothing moves
            return NO_TRAFFIC
        p = plan.pipeline
        if pass_ == "backward":
            spec, recompute = backward_kernel(plan, stage), plan.recompute.get(stage.start)
            widths = {"dy": p.features(stage.output), "dx": p.features(stage.input),
                      "x": p.features(recompute.saved) if recompute is not None else None}
            names = ["dy", *spec.operands, *spec.returned]
        else:
            spec = forward_kernel(p, stage)
            widths = {"x": p.features(stage.input), "y": p.features(stage.output)}
            names = ["x", *spec.operands, *spec.returned]
        sizes = [widths[name] if name in widths else operand_width(p, stage, name) for name in names]
        return RowTraffic(sum(sizes)) if fixed(*sizes) else None

    def forward(self, em, stage, block):
        p = em.pipeline
        if stage.kind == "passthrough":  # MakeExtraOutput hands out its input as is
            for op in stage.ops:
                if op.extra_out is not None:
                    em.alias(block, op.extra_out, stage.input)
            return em.name(stage.input)
        spec = em.kernel("forward", stage)
        for op in random_ops(stage.ops):
            block.add(new_seed(p, op, stage.input))
        operands = {"y": stage.output, **io_names(stage)}
        args = [stage.input] + [operands[o] for o in spec.operands]
        produced = fp8_producer(em, stage, "forward", stage.output)  # y an FP8 GEMM's x, which it alone reads
        if produced is not None:
            fp8_spec, gemm = produced
            block.add(Fp8Produce(em.fp8, gemm, "forward", fp8_spec.name, spec.name, args, stage.output))
        else:
            spec, args = fp8_amax(em, block, stage, "forward", stage.output, spec, args)  # y an FP8 GEMM's x
            block.add(Launch(spec.name, args, [operands[r] for r in spec.returned]))
        for index, alias in forward_aliases(stage).items():
            if alias != "write":
                em.alias(block, p.ops[index].extra_out, stage.input if alias == "input" else stage.output)
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        p = em.pipeline
        if stage.kind == "passthrough":  # AddExtraInput hands its grad to both inputs
            for op in stage.ops:
                if op.extra_in is not None:
                    em.grad_alias(block, em.grad(op.extra_in), dy)
            return dy
        spec = em.kernel("backward", stage)
        if not spec.ctx["writes_dx"]:
            d_in = dy
        operands = {"dx": d_in, **io_names(stage, grad=em.grad)}
        recompute = em.plan.recompute.get(stage.start)
        if recompute is not None:
            operands["x"] = recompute.saved
        args = [dy] + [operands[o] for o in spec.operands]
        produced = fp8_producer(em, stage, "backward", d_in)  # dx an FP8 GEMM's dy, which it alone reads
        if produced is not None:
            fp8_spec, gemm = produced
            block.add(Fp8Produce(em.fp8, gemm, "backward", fp8_spec.name, spec.name, args, d_in))
        else:
            if spec.ctx["writes_dx"]:  # dx an FP8 GEMM's dy
                spec, args = fp8_amax(em, block, stage, "backward", d_in, spec, args)
            block.add(Launch(spec.name, args, [operands[r] for r in spec.returned]))
        for index, alias in backward_aliases(stage).items():
            if alias != "write":
                em.grad_alias(block, em.grad(p.ops[index].extra_in), dy if alias == "dy" else d_in)
        return d_in


ELEMENTWISE = ElementwiseStage()
