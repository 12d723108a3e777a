"""The norm kernels' tuning: threads a row, what a forward holds in registers, where a backward
sums its parameter grads. Every bound is the H100's, measured (bench/NOTES.md)."""

from __future__ import annotations

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

# A backward of at most this many row splits (one block a row: as many rows) adds its fp32
# parameter-grad partials into the grads itself, in the same cooperative launch
# (templates/cuda/column_sum.cuh: finish_column_sums); with more, the column_sum kernel's second
# launch costs less than each thread's longer sum. On an H100 (forward + backward of bench/'s norms
# and bias chains, against two launches): 16 rows 0.79-0.97x the time, 32 rows 0.86-0.98x, 64 rows
# 0.96-1.12x, 128 rows 1.11-1.78x (bench/NOTES.md).
SUMS_IN_KERNEL_SPLITS = 32


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
