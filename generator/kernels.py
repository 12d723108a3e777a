"""Kernel specifications: what each fused stage of a plan needs compiled.

A ``KernelSpec`` is a function of the stage alone (the stage implementations in stages/ build
them), so its name (which spells out the op chain, the feature size and any non-default
constant) is also its cache key: pipelines that share a stage share the kernel. Each spec names
the CUDA template that instantiates it and the launcher family that calls it from Python, and
holds its ABI as data; ``context`` fills both templates.

Names are bounded (``kernel_name``): one longer than ``MAX_KERNEL_NAME`` keeps a readable prefix
of its op chain, then ``x`` + a short hash of the full name, then its direction and size, so a
long elementwise run cannot push ``kernels/<name>.<arch>.cubin`` past file-name limits.
The full name is kept in ``KernelSpec.full_name`` (the .cu header comment and MANIFEST.json).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Sequence

DTYPES = {"bfloat16": ("bf16", "__nv_bfloat16", 2), "float16": ("fp16", "__half", 2), "float32": ("fp32", "float", 4)}
NORM_MAX_THREADS = 512  # threads per row of a norm forward (and a backward of rows over 1024 vectors)
NORM_BWD_MAX_THREADS = 1024  # threads per row of a norm backward: one vector each up to 1024 a row
NORM_FWD_VECTORS = 4  # vectors per thread a norm forward aims for: loads in flight across its barriers
NORM_FWD_MIN_THREADS = 128
# A norm backward sums its fp32 dgamma (and dbeta) partials in shared memory when they fit in this
# many bytes a block: within the per-block limit of every GPU from sm_80 on (99 KB on sm_86, sm_89
# and sm_120; more than 48 KB needs the opt-in the runtime makes, Kernel(shared=...)). Such a
# backward gives each thread about NORM_BWD_VECTORS vectors, and a block of at most 512 threads
# asks for NORM_BWD_MIN_BLOCKS blocks an SM (registers capped at 64 a thread to fit them).
NORM_BWD_SHARED_BYTES = 96 * 1024
NORM_BWD_VECTORS = 2
NORM_BWD_MIN_BLOCKS = 2
# Longest kernel name. Every name of the shipped specs but the long elementwise_chain run fits;
# a file name ("<name>.compute_80.ptx") and a function's ("<name>_bf16_few_rows") stay under 64 bytes.
MAX_KERNEL_NAME = 48
NAME_HASH_CHARS = 8  # hex digits of sha256(full name) in a cut name: "x" + 8 hex


# A backward of at most this many row splits (one block a row: as many rows) adds its fp32
# parameter-grad partials into the grads itself, in the same cooperative launch
# (templates/cuda/column_sum.cuh: finish_column_sums); with more, the column_sum kernel's second
# launch costs less than each thread's longer sum. On an H100 (forward + backward of bench/'s norms
# and bias chains, against two launches): 16 rows 0.79-0.97x the time, 32 rows 0.86-0.98x, 64 rows
# 0.96-1.12x, 128 rows 1.11-1.78x (bench/NOTES.md).
SUMS_IN_KERNEL_SPLITS = 32
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


def sums_itself_up_to(spec: KernelSpec) -> int | None:
    """The rows up to which a backward adds its parameter grads itself, in its one launch (a norm
    backward's cooperative launch, an elementwise backward's column-tiled one); None: never."""
    ctx = spec.ctx
    return SUMS_IN_KERNEL_SPLITS if ctx.get("single_launch") else COLUMN_TILED_ROWS if ctx.get("column_tiled") else None


def norm_bwd_shared_partials(grad_columns: int) -> bool:
    """Whether a norm backward with ``grad_columns`` fp32 parameter-grad columns (H, or 2H for
    LayerNorm; 0 for L2Normalization, which has none) sums them in shared memory: it then holds
    only the row it is summing in registers, two blocks share an SM, and one block's reduction
    overlaps the other's loads (templates/cuda/norm.cuh: row_norm_bwd_shared)."""
    return 0 < 4 * grad_columns <= NORM_BWD_SHARED_BYTES


def norm_threads(hidden: int, vec: int, backward: bool = False, shared_partials: bool = False) -> int:
    """Threads per block of a norm kernel: a multiple of 32 covering the row's vectors, capped.

    A backward with its partials in shared memory gives each thread about 2 vectors: at up to 512
    threads, with 64 registers a thread, two blocks fit an SM. On the H100 (bf16, 16384 rows) that
    beat or matched every other split tried, at every H from 1024 to 8192 (bench/NOTES.md).

    Otherwise a backward of at most 1024 vectors a row gives each thread one (H=8192 in bf16): with
    two, a thread of a 512-thread block took 94-118 registers on sm_90, and one such block filled an
    SM; with one it takes 58-64, and the H100 ran the backward 13% faster (bench/NOTES.md).

    A forward gives each thread about 4 vectors (at least 128 threads a block): a row's loads are
    all in flight before its reductions' barriers, and fewer warps make those barriers cheaper.
    LayerNorm in bf16 on the H100 went from 89-90% of copy to 95% (H=4096) and 97% (H=8192)."""
    nvec = -(-hidden // vec)
    covering = -(-nvec // 32) * 32
    if backward and shared_partials:
        return min(NORM_BWD_MAX_THREADS, -(-nvec // NORM_BWD_VECTORS // 32) * 32)
    if backward:
        return covering if covering <= NORM_BWD_MAX_THREADS else min(NORM_MAX_THREADS, covering)
    aimed = -(-nvec // NORM_FWD_VECTORS // 32) * 32
    return min(covering, NORM_MAX_THREADS, max(NORM_FWD_MIN_THREADS, aimed))


def norm_fwd_holds(hidden: int, vec: int, threads: int, itemsize: int, params: int, residual: bool,
                   writes_h: bool, few_rows: bool) -> tuple[bool, bool]:
    """(HOLD_PARAMS, LOADS_FIRST) of a norm forward's entry point (templates/cuda/norm.cuh): whether
    it holds its ``params`` (gamma, beta) in registers from the start, and whether a row that
    writes the sum h issues all its loads before its first store. Each saves a round trip to
    memory in a block's latency, which is the kernel's at a few rows, and costs registers.

    The kernel's own entry holds the parameters where that costs a block at most 16 KB of
    registers (8 KB where the residual's loads are in flight too): held at wider rows they take so
    many that fewer blocks fit an SM, and many rows lose more than a few rows gain; the bounds are
    the H100's (bench/NOTES.md). The ``few_rows`` entry, which runs a grid of at most one wave of
    its blocks (no block waits for an SM), does both at every width. Neither where a thread holds
    one vector: nothing to issue sooner."""
    nvec = -(-hidden // vec)
    nv = -(-nvec // threads)  # vectors a thread holds (norm.cuh: RowTiling::NV)
    if nv < 2:
        return False, False
    if few_rows:
        return params > 0, writes_h
    return params > 0 and params * nv * vec * itemsize * threads <= (8192 if residual else 16384), False


def norm_fwd_few_rows(hidden: int, vec: int, threads: int, itemsize: int, params: int, residual: bool,
                      writes_h: bool) -> bool:
    """Whether a norm forward has a second entry point for at most one wave of rows: where its
    choices (norm_fwd_holds) differ from the kernel's own entry's."""
    shape = (hidden, vec, threads, itemsize, params, residual, writes_h)
    return norm_fwd_holds(*shape, few_rows=True) != norm_fwd_holds(*shape, few_rows=False)


def kernel_name(chain: str, suffix: str, qualifier: str = "") -> tuple[str, str]:
    """(name, full name) of a kernel: ``<chain>_<suffix>[_<qualifier>]``, bounded.

    ``chain`` spells what the kernel computes (op tags, e.g. "bias_scale0p5_gelu"), ``suffix`` its
    direction and size ("fwd_n384", "bwd_h768", "n1024"), ``qualifier`` a variant ("from_bias",
    "add_dresidual"). A full name of at most MAX_KERNEL_NAME characters is the name. A longer one
    becomes ``<prefix>_x<hash>_<suffix>[_<qualifier>]``: the longest prefix of ``chain`` ending at
    a ``_`` that fits, then the first NAME_HASH_CHARS hex digits of sha256(full name), so the name
    is stable and (up to the hash) unique; the qualifier is dropped when even an empty prefix
    leaves no room for it (the hash still covers it)."""
    full = "_".join(part for part in (chain, suffix, qualifier) if part)
    if len(full) <= MAX_KERNEL_NAME:
        return full, full
    marker = "x" + hashlib.sha256(full.encode()).hexdigest()[:NAME_HASH_CHARS]
    tail = "_".join(part for part in (marker, suffix, qualifier) if part)
    if len(tail) > MAX_KERNEL_NAME:
        tail = f"{marker}_{suffix}"
    assert len(tail) <= MAX_KERNEL_NAME, f"kernel suffix {suffix!r} is too long for a bounded name"
    prefix = ""
    for part in chain.split("_"):
        longer = f"{prefix}_{part}" if prefix else part
        if len(longer) + 1 + len(tail) > MAX_KERNEL_NAME:
            break
        prefix = longer
    return (f"{prefix}_{tail}" if prefix else tail), full


@dataclass(frozen=True)
class KernelParam:
    """One parameter of a kernel's C ABI. The ``.cu`` signature (templates/kernel_abi.j2) and the
    Python launch tuple (templates/kernels.py.j2) are both rendered from a spec's ``params``."""

    name: str  # the .cu parameter, and the launcher's local variable that holds it
    ctype: str  # "const T*", "T*", "const float*", "float*" or "int" (T: the kernel's dtype)
    passed: bool = True  # False: this specialisation passes a null pointer, which the kernel ignores

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its name, the template family that instantiates it, and its ABI as data.

    ``params`` is the C signature in order; ``operands`` are the launcher's tensor arguments after
    its first (x or dy), ``returned`` what the launcher returns. Stage implementations build specs
    (stages/); templates and emit only read them."""

    name: str  # e.g. "bias_swiglu_bwd_n14336" (its functions add the dtype suffix); bounded (kernel_name)
    full_name: str  # the name before bounding; equal to ``name`` unless that was cut
    family: str  # norm_fwd | norm_bwd | column_sum | elementwise_fwd | elementwise_bwd
    context: tuple[tuple[str, object], ...]  # template variables, hashable and ordered
    summary: str
    params: tuple[KernelParam, ...] = ()
    operands: tuple[str, ...] = ()
    returned: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()  # the device headers its source includes, in order
    # How the launch shape follows from the row: "row_threads" (a block per row, threads covering
    # the row's vectors: norms), "row_vectors" (grid x covering the row's vectors with ``threads``
    # per block: elementwise), "any_row_vectors" (the same for a size-generic kernel: the launcher
    # computes grid x from the run-time n and the vector width) or "" (fixed: column sums).
    geometry: str = ""

    @property
    def ctx(self) -> dict:
        ctx = dict(self.context)
        for ops in ("steps", "prologue", "epilogue"):  # elementwise ops, as (key, value) pairs
            if ops in ctx:
                ctx[ops] = [dict(step) for step in ctx[ops]]
        return ctx

    @property
    def uses_math(self) -> bool:
        """Whether a functor of its ops takes the kernel's precision of exp and division
        (``Math`` in its device_struct: fg::Gelu<Math>, common.cuh)."""
        return any(re.search(r"\bMath\b", step["struct"] or "") for step in self.ctx.get("steps", ())
                   if step.get("uses_functor", True))  # a backward builds only the functors it calls

    def vec(self, itemsize: int) -> int:
        """Widest vector (at most 16 bytes) that divides every row this kernel touches."""
        v = 16 // itemsize
        while self.ctx["align"] is not None and self.ctx["align"] % v:  # None: size-generic, any n
            v //= 2
        return v

    def launch_size(self, itemsize: int) -> int | None:
        """The dtype-dependent launch constant: threads per block ("row_threads"), blocks along
        the row ("row_vectors") or elements per vector ("any_row_vectors"); None when the launch
        does not depend on the dtype."""
        ctx, vec = self.ctx, self.vec(itemsize)
        if self.geometry == "row_threads":
            return norm_threads(ctx["hidden"], vec, backward=self.family == "norm_bwd",
                                shared_partials=ctx.get("shared_partials", False))
        if self.geometry == "row_vectors":
            return -(-ctx["width"] // vec // ctx["threads"])
        if self.geometry == "any_row_vectors":
            return vec
        return None

    def _norm_fwd_shape(self, itemsize: int) -> tuple:
        """A norm forward's arguments to norm_fwd_holds and norm_fwd_few_rows."""
        ctx = self.ctx
        params = 0 if ctx["l2"] else 2 if ctx["layernorm"] else 1
        return (ctx["hidden"], self.vec(itemsize), self.launch_size(itemsize), itemsize, params, ctx["residual"],
                ctx["writes_h"])

    def few_rows(self, itemsize: int) -> bool:
        """Whether this kernel has a ``_few_rows`` entry point (a norm forward's, norm_fwd_few_rows)."""
        return self.family == "norm_fwd" and norm_fwd_few_rows(*self._norm_fwd_shape(itemsize))

    def row_vectors(self, itemsize: int) -> int:
        """16-byte (or narrower, ``vec``) vectors in one row of dy: a column-tiled launch's blocks
        each take a tile of them (COLUMN_TILED_ROWS)."""
        return self.ctx["width"] // self.vec(itemsize)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory a block of this kernel needs: a norm backward's fp32 partials, a
        column-tiled backward's lane sums (a thread's vector of fp32 sums, in the widest vectors
        of any dtype). The latter's 4 KB a 128-thread block cost no occupancy."""
        ctx = self.ctx
        if ctx.get("column_tiled"):
            return 4 * ctx["threads"] * max(self.vec(itemsize) for _, _, itemsize in DTYPES.values())
        return 4 * ctx["grad_columns"] if ctx.get("shared_partials") else 0

    def template_context(self, dtype: str) -> dict:
        """Everything the ``.cu`` template of one dtype reads: the spec's context, its ABI, and
        the dtype's type, vector width, precision of exp and division and (per-row kernels)
        threads. The template renders that dtype's namespace of the kernel's source
        (templates/kernel_source.cu.j2)."""
        suffix, ctype, itemsize = DTYPES[dtype]
        ctx = self.ctx
        ctx.update(kernel_name=f"{self.name}_{suffix}", ctype=ctype, vec=self.vec(itemsize),
                   math=("FastMath" if itemsize < 4 else "ExactMath") if self.uses_math else None,
                   params=self.params, operands=self.operands)
        if self.geometry == "row_threads":
            ctx["threads"] = self.launch_size(itemsize)
        if self.family == "norm_fwd":  # (HOLD_PARAMS, LOADS_FIRST) of each entry point; None: no few-rows entry
            shape = self._norm_fwd_shape(itemsize)
            ctx["holds"] = norm_fwd_holds(*shape, few_rows=False)
            ctx["few_rows_holds"] = norm_fwd_holds(*shape, few_rows=True) if norm_fwd_few_rows(*shape) else None
        if ctx.get("shared_partials"):  # two blocks an SM where 64 registers a thread hold the row
            ctx["min_blocks"] = NORM_BWD_MIN_BLOCKS if ctx["threads"] * NORM_BWD_MIN_BLOCKS <= 1024 else 1
        return ctx


def kernel_abi(spec: KernelSpec) -> tuple[KernelParam, ...]:
    """The parameters of ``spec``'s kernel, in order: the one source of its ABI."""
    return spec.params


def launcher_io(spec: KernelSpec) -> dict:
    """A launcher's tensor operands (after x or dy) and results; ``written``: the results besides
    ``y`` that the kernel writes (an elementwise forward's extra outputs); ``args``: its whole
    argument list and ``outputs``: how many tensors it returns (its def, and its custom op's
    schema under torch.compile, both come from these)."""
    ctx = spec.ctx
    written = [name for name in spec.returned if name != "y"] if spec.family == "elementwise_fwd" else []
    if spec.family == "norm_fwd":
        args = ["x", *spec.operands] + (["residual"] if ctx["residual"] else []) + ([] if ctx["l2"] else ["gamma"])
        args += ["beta"] if ctx["layernorm"] else []
        outputs = 2 + ctx["writes_h"] + ctx["layernorm"]  # y, [h], [mean], rstd
    elif spec.family == "norm_bwd":
        args = ["dy", "x"] + (["mean"] if ctx["layernorm"] else []) + ["rstd"] + ([] if ctx["l2"] else ["gamma"])
        args += ["dresidual"] if ctx["add_dresidual"] else []
        outputs = 1 if ctx["l2"] else 2 + ctx["layernorm"]  # dx, [dgamma, [dbeta]]
    elif spec.family == "column_sum":
        args, outputs = ["partials", "dtype"], 1
    elif spec.family == "elementwise_fwd":
        args, outputs = ["x", *spec.operands], 1 + len(written)
    else:
        args, outputs = ["dy", *spec.operands], len(spec.returned)
    return dict(operands=list(spec.operands), returned=list(spec.returned), written=written, args=args,
                outputs=outputs)


def make_spec(name: tuple[str, str], family: str, summary: str, abi: Sequence[KernelParam] = (),
              operands: Sequence[str] = (), returned: Sequence[str] = (), headers: Sequence[str] = (),
              geometry: str = "", **context) -> KernelSpec:
    """A spec named by ``kernel_name``'s (name, full name); ``context`` fills its templates."""
    return KernelSpec(*name, family, tuple(sorted(context.items())), summary, tuple(abi), tuple(operands),
                      tuple(returned), tuple(headers), geometry)


def column_sum(columns: int) -> KernelSpec:
    P = KernelParam
    return make_spec(kernel_name("column_sum", f"n{columns}"), "column_sum",
                     f"sums fp32 per-block partials over blocks, {columns} columns",
                     abi=(P("partials", "const float*"), P("out", "T*"), P("splits", "int")),
                     returned=("out",), headers=("column_sum.cuh",), columns=columns, align=1)


