"""The MLP from Transformer Engine's te.ops documentation: LayerNorm, then a SwiGLU feed-forward."""

import transformer_engine.pytorch as te

HIDDEN = 4096
FFN = 14336

te_mlp = te.ops.Sequential(
    te.ops.LayerNorm(HIDDEN),
    te.ops.Linear(HIDDEN, 2 * FFN),
    te.ops.SwiGLU(),
    te.ops.Linear(FFN, HIDDEN),
)
