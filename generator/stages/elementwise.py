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

import math

from .. import kernels as kn
from ..ir import Sym
from ..kernels import KernelParam as P
from ..ops import OPS, elementwise_kinds
from ..calls import Launch, TorchCall
from ..values import seed_name
from .base import (NO_TRAFFIC, Recompute, RowTraffic, Saves, StageImpl, extra_input_name, extra_output_name,
                   fixed, param_name)

ELEMENTWISE_THREADS = 128  # threads per block along the row; each thread moves 16-byte vectors


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
        extra = {op.extra_in for op in stage.ops if _reads_operand(op) and op.extra_in is not None}
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
        if pass_ == "forward":
            return [forward_kernel(plan.pipeline, stage), *(forward_kernel(plan.pipeline, stage, n) for n in specialise)]
        spec = backward_kernel(plan, stage)
        column_grads = any(step["grad"] == "column" for step in spec.ctx["steps"])
        return [spec, *([kn.column_sum(spec.ctx["grad_columns"])] if column_grads else []),
                *(backward_kernel(plan, stage, n) for n in specialise)]

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
                if op.extra_output is not None:
                    em.alias(block, op.extra_out, stage.input)
            return em.name(stage.input)
        spec = em.kernel("forward", stage)
        for op in random_ops(stage.ops):
            block.add(new_seed(p, op, stage.input))
        operands = {"y": stage.output, **io_names(stage)}
        block.add(Launch(spec.name, [stage.input] + [operands[o] for o in spec.operands],
                         [operands[r] for r in spec.returned]))
        for index, alias in forward_aliases(stage).items():
            if alias != "write":
                em.alias(block, p.ops[index].extra_out, stage.input if alias == "input" else stage.output)
        return em.table[stage.output].name

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
        operands = {"dx": d_in, **io_names(stage)}
        recompute = em.plan.recompute.get(stage.start)
        if recompute is not None:
            operands["x"] = recompute.saved
        block.add(Launch(spec.name, [dy] + [operands[o] for o in spec.operands], [operands[r] for r in spec.returned]))
        for index, alias in backward_aliases(stage).items():
            if alias != "write":
                em.grad_alias(block, f"d_{extra_input_name(p.ops[index])}", dy if alias == "dy" else d_in)
        return d_in


ELEMENTWISE = ElementwiseStage()


# --- what each op of a run is to the kernel -----------------------------------------------------

def _width_halving_kinds() -> set[str]:
    return {op.kind for op in OPS.values() if op.halves_width}


def _reduced(op) -> bool:
    """The op's operand grad is reduced (a parameter's) rather than handed on per element."""
    operand = op.opdef.operand
    return operand is not None and operand.grad in ("column", "scalar")


def _reads_operand(op) -> bool:
    return op.opdef.operand is not None and op.opdef.operand.read_in_backward


def _operand_names(op, rel: int) -> tuple[str, str]:
    """(operand, its grad) as the kernel and launcher name them: bias3/dbias3, extra_in3/d_extra_in3."""
    if op.opdef.operand.source == "param":
        param = op.opdef.params[0].name
        return f"{param}{rel}", f"d{param}{rel}"
    if op.opdef.operand.source == "random":
        return f"seed{rel}", ""
    return f"extra_in{rel}", f"d_extra_in{rel}"


def operand_width(pipeline, stage, name: str, kernel_ops=None):
    """Values per row of a kernel's operand or result, by its name (``_operand_names``,
    ``io_names``): an extra input or output (or its grad) is as wide as its op's input, a per-row
    operand (RowScale's scales) one value; a parameter, its grad (a column sum) and a Dropout key
    are per call: 0. ``kernel_ops``: the ops the names number, where not the whole run
    (``kernel_number``)."""
    kind, rel = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")):]
    op = (stage.ops if kernel_ops is None else kernel_ops)[int(rel)]
    if kind in ("extra_out", "d_extra_out"):
        return pipeline.width(op.index)
    if kind in ("extra_in", "d_extra_in"):
        broadcast = op.opdef.operand.broadcast if kind == "extra_in" else op.opdef.operand.grad
        return {"element": pipeline.width(op.index), "row": 1}.get(broadcast, 0)
    return 0  # bias3 / dbias3 / seed3


def random_ops(ops):
    """The ops drawing random operands (Dropout): their forward depends on the training mode."""
    return [op for op in ops if op.opdef.operand is not None and op.opdef.operand.source == "random"]


def new_seed(pipeline, op, x: int) -> TorchCall:
    """A random op's key: a fresh one per call (on ``x``'s device); None in eval mode (keep all)."""
    return TorchCall("{seed} = ref.new_seed({x}) if {training} else None", dict(x=x, training=pipeline.training),
                     dict(seed=op.seed))


def operand_ctypes(steps) -> dict[str, str]:
    """{operand: its C type}: a random operand is its 64-bit key, any other a T tensor (a missing
    name: the saved run input or an extra output's grad, both T)."""
    return {dict(s)["operand"]: "const long long*" if dict(s)["broadcast"] == "random" else "const T*"
            for s in steps if dict(s)["operand"]}


def kernel_number(stage, op, kernel_ops=None) -> int:
    """``op``'s number in its kernel, which names its operands and results: its place in the run,
    or among ``kernel_ops`` (a norm kernel's own ops, whose numbers do not depend on an
    AddExtraInput or MakeExtraOutput before its norm, so stages that differ only by those share
    one kernel)."""
    if kernel_ops is None:
        return op.index - stage.start
    return [o.index for o in kernel_ops].index(op.index)


def io_names(stage, kernel_ops=None) -> dict[str, int | str]:
    """{launcher operand or result: what the generated module passes} for a run's ops (or for
    ``kernel_ops``: ``kernel_number``): a value (a parameter, a random key, an extra input or
    output), or a grad's name."""
    operands: dict[str, int | str] = {}
    for op in stage.ops if kernel_ops is None else kernel_ops:
        rel = kernel_number(stage, op, kernel_ops)
        if op.opdef.operand is not None:
            operand, grad = _operand_names(op, rel)
            if op.opdef.operand.source == "param":
                operands[operand] = op.param(op.opdef.params[0].name)
                name = param_name(op, op.opdef.params[0].name)
            elif op.opdef.operand.source == "random":
                operands[operand], name = op.seed, seed_name(op)
            else:
                operands[operand], name = op.extra_in, extra_input_name(op)
            if grad:
                operands[grad] = "d_" + name
        if op.extra_output is not None:
            operands[f"extra_out{rel}"] = op.extra_out
            operands[f"d_extra_out{rel}"] = "d_" + extra_output_name(op)
    return operands


def _glu_index(ops) -> int | None:
    return next((op.index for op in ops if op.opdef.halves_width), None)


def _alias(stage, op, changes: str, first: str, last: str) -> str:
    """Where an extra tensor of ``op`` comes from: the run's ``first`` tensor when no op before it
    changes ``changes`` (value or grad), its ``last`` tensor when none after does, else 'write'."""
    before = any(getattr(o.opdef, changes) for o in stage.ops if o.index < op.index)
    after = any(getattr(o.opdef, changes) for o in stage.ops if o.index > op.index)
    return first if not before else last if not after else "write"


def forward_aliases(stage) -> dict[int, str]:
    """For each extra output of a forward run: 'input', 'output' (the same tensor) or 'write'."""
    return {op.index: _alias(stage, op, "changes_value", "input", "output")
            for op in stage.ops if op.opdef.functor_form == "tee"}


def backward_aliases(stage) -> dict[int, str]:
    """For each per-element addend of a backward run (an extra input), its grad: 'dx', 'dy' (the
    same tensor) or 'write'."""
    return {op.index: _alias(stage, op, "changes_grad", "dx", "dy")
            for op in stage.ops if op.opdef.operand is not None and op.opdef.operand.grad == "element"}


def op_step(stage, op, glu: int | None, kernel_ops=None, **extra) -> tuple[tuple[str, object], ...]:
    """One op of a run as the templates see it: its number in the kernel (``kernel_number``), its
    form and functor, its operand (name, broadcast, grad), lanes 'a' (and 'b' before a GLU: the
    row's second half)."""
    rel = kernel_number(stage, op, kernel_ops)
    lanes = ("a", "b") if glu is not None and op.index <= glu else ("a",)  # a GLU reads both halves
    constants = op.opdef.device_args(op.args)
    operand = op.opdef.operand
    names = _operand_names(op, rel) if operand is not None else ("", "")
    step = dict(index=rel, lanes=lanes, form=op.opdef.functor_form, struct=op.opdef.device_struct,
                cuda_args=tuple(f"{float(c)!r}f" for c in constants),
                python_args=tuple(repr(float(c)) for c in constants), label=op.describe(kernel=True),
                reference=op.opdef.reference_names, operand=names[0], operand_grad=names[1],
                broadcast=operand.broadcast if operand else "", grad=operand.grad if operand else "",
                reads_operand=bool(operand and operand.read_in_backward),
                tee=f"extra_out{rel}" if op.extra_output is not None else "",
                interleave=op.opdef.interleave(op.args), **extra)
    return tuple(sorted(step.items()))


def device_headers(stage) -> tuple[str, ...]:
    return tuple(sorted({op.opdef.device_header for op in stage.ops if op.opdef.device_struct}))


def _size(width) -> tuple[str, dict]:
    """A kernel's size suffix and its size-dependent context: a fixed width, or ``any`` (the
    kernel takes ``n`` at run time; ``generic``)."""
    if isinstance(width, Sym):
        return "any", dict(width=None, align=None, generic=True, geometry="any_row_vectors")
    return f"n{width}", dict(width=width, align=width, generic=False, geometry="row_vectors")


def _interleave(stage, size: dict) -> dict:
    """The run's GLU's glu_interleave_size (None: halves) and, with one, vectors that stay within a
    block of it: the widest access must divide the block size too."""
    k = next((op.opdef.interleave(op.args) for op in stage.ops if op.opdef.halves_width), None)
    if k is None:
        return dict(interleave=None)
    return dict(interleave=k, align=k if size["align"] is None else math.gcd(size["align"], k))


def _relative(size, width):
    """A size of a run in terms of the kernel's own N, its output width (a size-generic run's
    sizes are multiples of the pipeline's n; its kernel, shared by every pipeline that has the run,
    knows only N)."""
    return Sym(size.factor / width.factor) if isinstance(size, Sym) else size


def _generic_name(chain: str, direction: str, qualifier: str = "") -> str:
    """The name of a run's size-generic kernel: its launcher dispatches to every fixed-size kernel
    of the package that names it here (same ops and constants, so the same computation)."""
    return kn.kernel_name(chain, f"{direction}_any", qualifier)[0]


def forward_kernel(pipeline, stage, n: int | None = None) -> kn.KernelSpec:
    """The run's forward kernel; at input size ``n`` if given (a specialisation)."""
    glu = _glu_index(stage.ops)
    aliases = forward_aliases(stage)
    width = pipeline.width(stage.end, n)
    suffix, size = _size(width)
    steps = tuple(op_step(stage, op, glu, write=aliases.get(op.index) == "write") for op in stage.ops)
    operands = [dict(s)["operand"] for s in steps if dict(s)["operand"]]
    written = [dict(s)["tee"] for s in steps if dict(s)["tee"] and dict(s)["write"]]
    ctypes = operand_ctypes(steps)
    abi = (P("x", "const T*"), *(P(o, ctypes.get(o, "const T*")) for o in operands), *(P(w, "T*") for w in written),
           P("y", "T*"), P("rows", "int"), *((P("n", "int"),) if size["generic"] else ()))
    tags = "_".join(op.tag for op in stage.ops)
    return kn.make_spec(
        kn.kernel_name(tags, f"fwd_{suffix}"), "elementwise_fwd", ", ".join(op.describe(kernel=True) for op in stage.ops),
        abi=abi, operands=operands, returned=["y", *written], headers=("common.cuh", *device_headers(stage)),
        in_width=_relative(pipeline.width(stage.start, n), width), glu=glu is not None, steps=steps,
        threads=ELEMENTWISE_THREADS, generic_name=_generic_name(tags, "fwd"), **{**size, **_interleave(stage, size)},
    )


def backward_kernel(plan, stage, n: int | None = None) -> kn.KernelSpec:
    """The run's backward kernel; at input size ``n`` if given (a specialisation)."""
    pipeline = plan.pipeline
    glu = _glu_index(stage.ops)
    aliases = backward_aliases(stage)
    recompute = plan.recompute.get(stage.start)
    width = pipeline.width(stage.end, n)
    suffix, size = _size(width)
    steps, grad_columns = [], 0
    output_for = recompute.output_for if recompute is not None else None  # Saves: backward_from_output
    for op in stage.ops:
        replays = recompute is not None and recompute.replay_from <= op.index <= recompute.last
        replays = replays or op.index == output_for  # its input: its saved output
        steps.append(dict(op_step(
            stage, op, glu, write=aliases.get(op.index) == "write", grad_offset=_relative(grad_columns, width),
            recompute=replays, apply=replays and op.index < recompute.last and op.index != output_for,
            needs_input=op.opdef.needs_input_in_backward,
            # an addend whose grad is aliased, not written: nothing to do in this kernel
            inert=not op.opdef.changes_grad and not _reduced(op) and aliases.get(op.index, "write") != "write",
        )))
        steps[-1]["uses_functor"] = bool(steps[-1]["struct"]) and (steps[-1]["apply"] or not steps[-1]["inert"])
        grad_columns += pipeline.width(op.index, n) if _reduced(op) else 0
    # Operands: the saved run input, those the replayed forward and the backward read, the extra
    # outputs' grads; results: dx when the run changes the grad, the addends' written grads, then
    # the reduced grads (summed from the partials).
    operands = ["x"] if recompute is not None else []
    for s in steps:
        if s["operand"] and (s["apply"] or s["reads_operand"]):
            operands.append(s["operand"])
        elif s["tee"]:
            operands.append("d_" + s["tee"])
    writes_dx = any(op.opdef.changes_grad for op in stage.ops)
    written = (["dx"] if writes_dx else []) + [s["operand_grad"] for s in steps if s["grad"] == "element" and s["write"]]
    reduced = [s["operand_grad"] for s in steps if s["grad"] in ("column", "scalar", "row")]
    # a per-row operand's grad: each thread's sum over its columns, per row, summed by the launcher
    row_partials = [f"row_partials{s['index']}" for s in steps if s["grad"] == "row"]
    ctypes = operand_ctypes(steps)
    # A fixed-width kernel whose reduced grads are all per column sums them itself at a few rows,
    # column-tiled (kernels.COLUMN_TILED_ROWS); a size-generic one, or one with a scalar's grad,
    # leaves that to the launcher (the column_sum kernel, torch's sum).
    grads = {s["grad"] for s in steps}
    column_tiled = not size["generic"] and "column" in grads and "scalar" not in grads
    abi = (P("dy", "const T*"), *(P(o, ctypes.get(o, "const T*")) for o in operands), *(P(w, "T*") for w in written),
           *((P("partials", "float*"),) if grad_columns else ()), *((P("column_grads", "T*"),) if column_tiled else ()),
           *(P(r, "float*") for r in row_partials),
           P("rows", "int"), *((P("n", "int"),) if size["generic"] else ()))
    first_needing = next((op.index for op in stage.ops if op.opdef.needs_input_in_backward), None)
    qualifier = ""
    if output_for is not None:
        qualifier = "from_output"
    elif recompute is not None and recompute.replay_from != first_needing:
        qualifier = f"from_{pipeline.ops[recompute.replay_from].tag}"
    tags = "_".join(op.tag for op in stage.ops)
    saved_two_lanes = recompute is not None and glu is not None and recompute.replay_from <= glu
    return kn.make_spec(
        kn.kernel_name(tags, f"bwd_{suffix}", qualifier), "elementwise_bwd",
        ", ".join(op.describe(kernel=True) for op in stage.ops) + " backward",
        abi=abi, operands=operands, returned=written + reduced,
        headers=("column_sum.cuh" if column_tiled else "common.cuh", *device_headers(stage)),
        in_width=_relative(pipeline.width(stage.start, n), width), glu=glu is not None,
        steps=tuple(tuple(sorted(s.items())) for s in steps),
        threads=ELEMENTWISE_THREADS, writes_dx=writes_dx, generic_name=_generic_name(tags, "bwd", qualifier),
        **{**size, **_interleave(stage, size)},
        saved_offset=None if recompute is None else recompute.replay_from - stage.start,
        saved_two_lanes=saved_two_lanes, grad_columns=_relative(grad_columns, width), column_tiled=column_tiled,
        row_unroll=_row_unroll(steps, recompute is not None, saved_two_lanes) if grads & {"column", "scalar"} else 1,
    )


# A backward that sums a parameter's grad loops over rows (one wave of blocks); unrolled, one thread
# has several rows' loads in flight. About 8 16-byte vectors in flight a thread is enough: a row
# that loads more (a GLU's two halves, extra inputs, extra outputs' grads) needs fewer rows at once,
# and more only cost registers. Measured on an H200 (bench/NOTES.md, 2026-11-26): Bias + GELU (2
# vectors a row) is 1.5-4% slower unrolled less than 4 times; Dropout + SwiGLU (3) 6-10% quicker in
# bf16 unrolled twice; a 10-op chain that loads 8 vectors a row 26% quicker not unrolled.
ROW_VECTORS_IN_FLIGHT = 8


def _row_vectors(steps, recomputes: bool, saved_two_lanes: bool) -> int:
    """The vectors a backward's thread loads for each row: dy, the saved input (both halves before
    a GLU), each per-element operand it reads (once a lane) and each extra output's grad."""
    vectors = 1 + ((2 if saved_two_lanes else 1) if recomputes else 0)
    for s in steps:
        if s["tee"] or (s["operand"] and s["broadcast"] == "element" and (s["apply"] or s["reads_operand"])):
            vectors += len(s["lanes"])
    return vectors


def _row_unroll(steps, recomputes: bool, saved_two_lanes: bool) -> int:
    vectors = _row_vectors(steps, recomputes, saved_two_lanes)
    return next((unroll for unroll in (4, 2) if unroll * vectors <= ROW_VECTORS_IN_FLIGHT), 1)
