"""The elementwise kernels' specs (a run's forward and backward, at its width or any width) and
their tuning: threads a block, rows a backward unrolls, where a backward sums its column grads
itself. What the kernels compute is templates/elementwise/; how they launch, family.py."""

from __future__ import annotations

import math

from ... import kernels as kn
from ...ir import Sym
from ...kernels import KernelParam as P
from .steps import (backward_aliases, device_headers, forward_aliases, glu_index, grad_is_reduced, op_step,
                    operand_ctypes)

ELEMENTWISE_THREADS = 128  # threads per block along the row; each thread moves 16-byte vectors
# An elementwise backward of at most this many rows whose reduced grads are all column sums runs
# column-tiled: one block a tile of columns, its threads in row lanes that take every row of those
# columns and add their sums in shared memory (templates/cuda/column_sum.cuh: sum_row_lanes). One
# plain launch: no second kernel, no barrier across the grid. Row lanes (COLUMN_TILE_LANES): 16 up
# to 16 rows (a row a thread), else 32 (at most 4 rows a thread: one unrolled batch of loads). On
# an H100 (bf16, forward + backward of Bias + GELU and Bias + SwiGLU, widths 1024 to 28672) against
# the row splits and column_sum: 16 rows 0.53-0.71x the time, 64 rows 0.54-0.79x, 128 rows
# 0.58-0.91x, 192 rows 0.64-0.92x (bench/NOTES.md).
COLUMN_TILED_ROWS = 128
COLUMN_TILE_LANES = (16, 32)  # row lanes of a column-tiled block: up to 16 rows, above


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


def _amax_param(amax: bool) -> tuple:
    """An FP8 consumer's variant (``amax``): the output's amax, max-ed into a float the launcher is
    handed (None: not kept), as current scaling's cast reads it (templates/cuda/amax.cuh)."""
    return (P("amax", "float*"),) if amax else ()


# An FP8 variant's tile (templates/cuda/fp8_tile.cuh): 32 threads along the row, of 16-byte vectors
# (8 columns at 16 bits, 4 at fp32), and 8 rows of threads, 4 rows each.
FP8_TILE_COLUMNS = 256  # a run's width must be a multiple (the widest vectors' tile)
FP8_TILE_THREADS = 256


def _fp8_abi(out: str) -> tuple:
    """An FP8 variant's output parameters: the FP8 tensor and its transpose (null: not stored), the
    scale (delayed scaling's) or the finished amax to take it from (current), the scale's inverse,
    the float the output's amax is max-ed into; then its sizes and the recipe's constants."""
    return (P(out, "unsigned char*"), P(f"{out}_t", "unsigned char*"), P("scale", "const float*"),
            P("amax", "const float*"), P("scale_inv", "float*"), P("amax_out", "float*"), P("rows", "int"),
            P("t_cols", "int"), P("e5m2", "int"), P("eps_bits", "int"), P("power_2", "int"))


def fp8_variant_fits(spec: kn.KernelSpec) -> bool:
    """Whether a run's kernel has an FP8 variant (its only output written cast to FP8 with its
    transpose, fp8_tile.cuh): a fixed width, a multiple of FP8_TILE_COLUMNS, no interleaved GLU;
    a forward that writes no extra output, a backward that writes dx alone and sums no grad."""
    c = spec.ctx
    if c["generic"] or c["interleave"] or c["width"] % FP8_TILE_COLUMNS:
        return False
    if spec.family == "elementwise_fwd":
        return list(spec.returned) == ["y"]
    return c["writes_dx"] and list(spec.returned) == ["dx"] and not c["grad_columns"]


def forward_kernel(pipeline, stage, n: int | None = None, amax: bool = False, fp8: bool = False) -> kn.KernelSpec:
    """The run's forward kernel; at input size ``n`` if given (a specialisation); with ``amax``,
    the variant that also keeps its output's amax (its consumer is an FP8 GEMM); with ``fp8``,
    the variant that writes its output in FP8 with its transpose (fp8_variant_fits)."""
    glu = glu_index(stage.ops)
    aliases = forward_aliases(stage)
    width = pipeline.width(stage.end, n)
    suffix, size = _size(width)
    steps = tuple(op_step(stage, op, glu, write=aliases.get(op.index) == "write") for op in stage.ops)
    operands = [dict(s)["operand"] for s in steps if dict(s)["operand"]]
    written = [dict(s)["tee"] for s in steps if dict(s)["tee"] and dict(s)["write"]]
    ctypes = operand_ctypes(steps)
    abi = (P("x", "const T*"), *(P(o, ctypes.get(o, "const T*")) for o in operands), *(P(w, "T*") for w in written),
           P("y", "T*"), *_amax_param(amax), P("rows", "int"), *((P("n", "int"),) if size["generic"] else ()))
    tags = "_".join(op.tag for op in stage.ops)
    qualifier = "amax" if amax else "fp8" if fp8 else ""
    extra = dict(amax=True) if amax else {}  # (a plain kernel's context as before: its name and sources)
    returned, headers, summary = ["y", *written], ("amax.cuh" if amax else "common.cuh",), ", its amax" if amax else ""
    if fp8:
        abi = (P("x", "const T*"), *(P(o, ctypes.get(o, "const T*")) for o in operands), *_fp8_abi("y"))
        returned, headers, summary = ["y", "y_t", "scale_inv"], ("fp8_tile.cuh",), ", written in FP8 with its transpose"
        extra = dict(fp8_out=True)
    return kn.make_spec(
        kn.kernel_name(tags, f"fwd_{suffix}", qualifier), "elementwise_fwd",
        ", ".join(op.describe(kernel=True) for op in stage.ops) + summary,
        abi=abi, operands=operands, returned=returned, headers=(*headers, *device_headers(stage)),
        in_width=_relative(pipeline.width(stage.start, n), width), glu=glu is not None, steps=steps,
        threads=FP8_TILE_THREADS if fp8 else ELEMENTWISE_THREADS, generic_name=_generic_name(tags, "fwd", qualifier),
        **{**size, **_interleave(stage, size)}, **extra,
    )


def backward_kernel(plan, stage, n: int | None = None, amax: bool = False, fp8: bool = False) -> kn.KernelSpec:
    """The run's backward kernel; at input size ``n`` if given (a specialisation); with ``amax``,
    the variant that also keeps dx's amax (dx is an FP8 GEMM's output grad); with ``fp8``, the
    variant that writes dx in FP8 with its transpose (fp8_variant_fits)."""
    pipeline = plan.pipeline
    glu = glu_index(stage.ops)
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
            inert=not op.opdef.changes_grad and not grad_is_reduced(op) and aliases.get(op.index, "write") != "write",
        )))
        steps[-1]["uses_functor"] = bool(steps[-1]["struct"]) and (steps[-1]["apply"] or not steps[-1]["inert"])
        grad_columns += pipeline.width(op.index, n) if grad_is_reduced(op) else 0
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
    # column-tiled (COLUMN_TILED_ROWS); a size-generic one, or one with a scalar's grad,
    # leaves that to the launcher (the column_sum kernel, torch's sum).
    grads = {s["grad"] for s in steps}
    column_tiled = not size["generic"] and "column" in grads and "scalar" not in grads
    abi = (P("dy", "const T*"), *(P(o, ctypes.get(o, "const T*")) for o in operands), *(P(w, "T*") for w in written),
           *((P("partials", "float*"),) if grad_columns else ()), *((P("column_grads", "T*"),) if column_tiled else ()),
           *(P(r, "float*") for r in row_partials), *_amax_param(amax),
           P("rows", "int"), *((P("n", "int"),) if size["generic"] else ()))
    first_needing = next((op.index for op in stage.ops if op.opdef.needs_input_in_backward), None)
    qualifier = ""
    if output_for is not None:
        qualifier = "from_output"
    elif recompute is not None and recompute.replay_from != first_needing:
        qualifier = f"from_{pipeline.ops[recompute.replay_from].tag}"
    tags = "_".join(op.tag for op in stage.ops)
    saved_two_lanes = recompute is not None and glu is not None and recompute.replay_from <= glu
    qualifier = "_".join(part for part in (qualifier, "amax" if amax else "", "fp8" if fp8 else "") if part)
    extra = dict(amax=True) if amax else {}  # (a plain kernel's context as before: its name and sources)
    returned = written + reduced
    headers = (*(("amax.cuh",) if amax else ()), "column_sum.cuh" if column_tiled else "common.cuh")
    summary = ", dx's amax" if amax else ""
    if fp8:
        abi = (P("dy", "const T*"), *(P(o, ctypes.get(o, "const T*")) for o in operands), *_fp8_abi("dx"))
        returned, headers, summary = ["dx", "dx_t", "scale_inv"], ("fp8_tile.cuh",), ", dx written in FP8 with its transpose"
        extra = dict(fp8_out=True)
    return kn.make_spec(
        kn.kernel_name(tags, f"bwd_{suffix}", qualifier), "elementwise_bwd",
        ", ".join(op.describe(kernel=True) for op in stage.ops) + " backward" + summary,
        abi=abi, operands=operands, returned=returned, headers=(*headers, *device_headers(stage)),
        in_width=_relative(pipeline.width(stage.start, n), width), glu=glu is not None,
        steps=tuple(tuple(sorted(s.items())) for s in steps),
        threads=FP8_TILE_THREADS if fp8 else ELEMENTWISE_THREADS, writes_dx=writes_dx,
        generic_name=_generic_name(tags, "bwd", qualifier),
        **{**size, **_interleave(stage, size)},
        saved_offset=None if recompute is None else recompute.replay_from - stage.start,
        saved_two_lanes=saved_two_lanes, grad_columns=_relative(grad_columns, width), column_tiled=column_tiled,
        row_unroll=_row_unroll(steps, recompute is not None, saved_two_lanes) if grads & {"column", "scalar"} else 1,
        **extra,
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
