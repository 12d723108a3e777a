"""GLUs with TE's glu_interleave_size: the input rows alternate blocks [a(k), b(k), a(k), ...] (so a
fused GEMM epilogue sees gate and linear columns in one tile). The kernels read the blocks in place:
no de-interleaving copies, forward or backward."""

import transformer_engine.pytorch as te

HIDDEN = 256
FFN = 512

interleaved_mlp = te.ops.Sequential(
    te.ops.Linear(HIDDEN, 2 * FFN), te.ops.SwiGLU(glu_interleave_size=32), te.ops.Linear(FFN, HIDDEN),
)
interleaved_any = te.ops.Sequential(te.ops.ClampedSwiGLU(glu_interleave_size=16, limit=3.0))
