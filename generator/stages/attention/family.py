"""The attention_prep kernel family: a few rows a block, each thread a few pairs of 16-byte
vectors (the two halves of a head that rotate-half mixes); templates/attention_prep/."""

from __future__ import annotations

from ...kernels import KernelFamily, register_family
from ..launchers import by_dtype

# Threads a block: 128, doubled while a thread would hold more than MAX_UNITS pairs of vectors
# (registers), up to 1024.
THREADS, MAX_UNITS, MAX_THREADS = 128, 4, 1024
# Bytes a block reads at least (as whole rows): an H100 moved one 12 KB bf16 row a block at 59% of
# a copy's bandwidth, 24 KB (one fp32 row) at 96%: a block's fixed latencies (the offsets'
# search, the angles, the barrier) need that many bytes in flight to hide behind.
BLOCK_BYTES = 24 * 1024
MAX_ROWS = 32  # rows a block at most (a row's angles take head_dim / 2 floats of shared memory each)
# the shared memory a block's cos and sin take at most: a row holds head_dim / 2 angles of each (a
# table variant's head_dim, both halves'), so the table variant of head_dim 256 runs 16 rows a block
ANGLE_BYTES = 32 * 1024


def prep_rows(heads: int, kv_heads: int, head_dim: int, itemsize: int, table: bool = False) -> int:
    """Rows a block of a prep kernel: enough for BLOCK_BYTES of input, at most MAX_ROWS and what
    ANGLE_BYTES holds."""
    row_bytes = (heads + 2 * kv_heads) * head_dim * itemsize
    angle_rows = ANGLE_BYTES // (2 * 4 * (head_dim if table else head_dim // 2))
    return max(1, min(MAX_ROWS, angle_rows, BLOCK_BYTES // row_bytes))


def prep_threads(heads: int, kv_heads: int, head_dim: int, vec: int, rows: int) -> int:
    """Threads a block of a prep kernel for ``rows`` rows of heads + 2 kv_heads heads of
    head_dim, vec elements a vector: at most MAX_UNITS pairs a thread where 1024 threads allow,
    and no more threads than pairs (rounded up to a warp)."""
    units = rows * (heads + 2 * kv_heads) * (head_dim // 2 // vec)
    threads = THREADS
    while -(-units // threads) > MAX_UNITS and threads < MAX_THREADS:
        threads *= 2
    return min(threads, -(-units // 32) * 32)


class AttentionPrep(KernelFamily):
    name = "attention_prep"
    template = "attention_prep/attention_prep.cu.j2"
    launcher_template = "attention_prep/attention_prep.py.j2"

    def rows(self, spec, itemsize):
        """Rows a block."""
        ctx = spec.ctx
        return prep_rows(ctx["heads"], ctx["kv_heads"], ctx["head_dim"], itemsize, ctx["table"])

    def launch_size(self, spec, itemsize):
        """Threads a block."""
        ctx = spec.ctx
        return prep_threads(ctx["heads"], ctx["kv_heads"], ctx["head_dim"], spec.vec(itemsize),
                            self.rows(spec, itemsize))

    def template_context(self, spec, dtype, itemsize):
        return dict(threads=self.launch_size(spec, itemsize), rows_per_block=self.rows(spec, itemsize))

    def launcher_context(self, spec, dtypes):
        return dict(rows_per_block=by_dtype(lambda itemsize: self.rows(spec, itemsize), dtypes))

    def launcher_io(self, spec):
        args = ["dq", "dk", "dv", "cu_seqlens"] if spec.ctx["inverse"] else ["x", "cu_seqlens"]
        args += ["table"] if spec.ctx["table"] else []  # TE's per-call rotary table
        return dict(args=args, outputs=1)


ATTENTION_PREP = register_family(AttentionPrep())
