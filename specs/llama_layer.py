"""The Llama-3-8B decoder layer of issue 38, in the design note's spelling: bench/bench_layer.py
measures it (``generated.LlamaLayer``) against eager PyTorch and torch.compile.

Grouped-query attention of 32 query heads and 8 key/value heads of 128 with rotary base 500000,
over packed sequences, then a SwiGLU MLP of 14336; each block pre-norm (RMSNorm) inside a
Residual, no biases.
"""

import transformer_engine.pytorch as te

HIDDEN = 4096
HEADS = 32
KV_HEADS = 8
FFN = 14336
HEAD_DIM = HIDDEN // HEADS

llama_layer = te.Sequential(
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False),  # q, k, v: 32 + 2 * 8 heads of 128
        te.GroupedQueryAttention(HIDDEN, HEADS, KV_HEADS, te.DotProductAttention, rotary_base=500000.0),
        te.Linear(HIDDEN, HIDDEN, bias=False),
    ),
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, 2 * FFN, bias=False),
        te.SwiGLU(),
        te.Linear(FFN, HIDDEN, bias=False),
    ),
)
