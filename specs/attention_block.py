"""Pre-norm transformer layers with self-attention over packed sequences (issue 38).

Written in the design note's spelling (``te.Sequential``, ``te.Residual``, the attention ops in the
``te.`` namespace). The fused QKV projection's width is (heads + 2 * kv_heads) * head_dim with
head_dim = hidden / heads; the attention op reads it and gives heads * head_dim = hidden columns.
"""

import transformer_engine.pytorch as te

HIDDEN = 256

# Grouped-query attention (4 query heads sharing 2 kv heads of 64), causal, with rotary embeddings,
# then a SwiGLU MLP: the Llama layer's structure at a small size.
attention_block = te.Sequential(
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, 512, bias=False),  # q, k, v: (4 + 2 * 2) heads of 64
        te.GroupedQueryAttention(HIDDEN, 4, 2, te.DotProductAttention, rotary_base=10000.0),
        te.Linear(HIDDEN, HIDDEN, bias=False),
    ),
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, 1024, bias=False),
        te.SwiGLU(),
        te.Linear(512, HIDDEN, bias=False),
    ),
)

# Multi-head attention without a mask (each token sees its whole sequence) and no rotary.
mha_block = te.Sequential(
    te.Residual(
        te.LayerNorm(HIDDEN),
        te.Linear(HIDDEN, 3 * HIDDEN),  # q, k, v: 3 * 4 heads of 64
        te.MultiHeadedSelfAttention(HIDDEN, 4, attn_mask_type="no_mask"),
        te.Linear(HIDDEN, HIDDEN),
    ),
)

# Multi-query attention (one kv head), causal, with rotary embeddings.
mqa_block = te.Sequential(
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, HIDDEN + 2 * 64, bias=False),  # q, k, v: (4 + 2) heads of 64
        te.MultiQuerySelfAttention(HIDDEN, 4, rotary_base=10000.0),
        te.Linear(HIDDEN, HIDDEN, bias=False),
    ),
)
