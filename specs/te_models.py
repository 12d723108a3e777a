"""Whole models from te.TransformerLayer as a TE user writes them (issue 39's done-when), each
beside the hand-written Sequential of the same layers: a generated te_* module loads a state_dict
laid out with TE's names (``0.self_attention.layernorm_qkv.query_weight``, ...) and computes what
the hand-written one computes (tests/ops/test_te_models.py trains both and compares).

GPT-style: three layers of 4 heads of 64 at TE's defaults (x [seq, batch, hidden], pre-LayerNorm,
GELU, biases, hidden and attention dropout 0.1, the QKV projection as query, key and value
parameters), each with other settings: as they are; zero-centred gamma with eps 1e-6 and
quick-GELU; residuals after the norms (apply_residual_connection_post_layernorm). Llama-style: two
layers of RMSNorm, SwiGLU, no biases, no dropout, packed sequences, grouped-query attention (8
query heads sharing 2 kv heads, then one: multi-query), the first with TE's split QKV parameters,
the second with them fused (fuse_qkv_params=True: one weight, rows per GQA group as TE lays
them out by default).
"""

import transformer_engine.pytorch as te

HIDDEN = 256
FFN = 4 * HIDDEN
LLAMA_FFN = 512

# TE's defaults: x [seq, batch, hidden] ("sbhd"), causal, hidden and attention dropout 0.1 in
# training, split QKV parameters
te_gpt_stack = te.Sequential(
    te.TransformerLayer(HIDDEN, FFN, 4),
    te.TransformerLayer(HIDDEN, FFN, 4, layernorm_epsilon=1e-6, zero_centered_gamma=True, activation="qgelu"),
    te.TransformerLayer(HIDDEN, FFN, 4, apply_residual_connection_post_layernorm=True),
)

gpt_stack = te.Sequential(
    te.Residual(
        te.LayerNorm(HIDDEN),
        te.Linear(HIDDEN, 3 * HIDDEN),
        te.MultiHeadedSelfAttention(HIDDEN, 4, dropout=0.1, qkv_format="sbhd"),
        te.Linear(HIDDEN, HIDDEN),
        te.Dropout(0.1),
    ),
    te.Residual(te.LayerNorm(HIDDEN), te.Linear(HIDDEN, FFN), te.GELU(), te.Linear(FFN, HIDDEN), te.Dropout(0.1)),
    te.Residual(
        te.LayerNorm(HIDDEN, eps=1e-6, zero_centered_gamma=True),
        te.Linear(HIDDEN, 3 * HIDDEN),
        te.MultiHeadedSelfAttention(HIDDEN, 4, dropout=0.1, qkv_format="sbhd"),
        te.Linear(HIDDEN, HIDDEN),
        te.Dropout(0.1),
    ),
    te.Residual(te.LayerNorm(HIDDEN, eps=1e-6, zero_centered_gamma=True), te.Linear(HIDDEN, FFN), te.QGELU(),
                te.Linear(FFN, HIDDEN), te.Dropout(0.1)),
    te.LayerNorm(HIDDEN),  # the residual is the norm's output
    te.Residual(te.Linear(HIDDEN, 3 * HIDDEN), te.MultiHeadedSelfAttention(HIDDEN, 4, dropout=0.1, qkv_format="sbhd"),
                te.Linear(HIDDEN, HIDDEN), te.Dropout(0.1)),
    te.LayerNorm(HIDDEN),
    te.Residual(te.Linear(HIDDEN, FFN), te.GELU(), te.Linear(FFN, HIDDEN), te.Dropout(0.1)),
)

# Llama-style: packed sequences ("thd", with cu_seqlens), no dropout
te_llama_stack = te.Sequential(
    te.TransformerLayer(HIDDEN, LLAMA_FFN, 8, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0, bias=False,
                        activation="swiglu", normalization="RMSNorm", attn_input_format="thd"),
    te.TransformerLayer(HIDDEN, LLAMA_FFN, 8, num_gqa_groups=1, hidden_dropout=0.0, attention_dropout=0.0, bias=False,
                        activation="swiglu", normalization="RMSNorm", attn_input_format="thd", fuse_qkv_params=True),
)

llama_stack = te.Sequential(
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, (8 + 2 * 2) * 32, bias=False),
        te.GroupedQueryAttention(HIDDEN, 8, 2),
        te.Linear(HIDDEN, HIDDEN, bias=False),
    ),
    te.Residual(te.RMSNorm(HIDDEN), te.Linear(HIDDEN, 2 * LLAMA_FFN, bias=False), te.SwiGLU(),
                te.Linear(LLAMA_FFN, HIDDEN, bias=False)),
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, (8 + 2 * 1) * 32, bias=False),
        te.GroupedQueryAttention(HIDDEN, 8, 1),
        te.Linear(HIDDEN, HIDDEN, bias=False),
    ),
    te.Residual(te.RMSNorm(HIDDEN), te.Linear(HIDDEN, 2 * LLAMA_FFN, bias=False), te.SwiGLU(),
                te.Linear(LLAMA_FFN, HIDDEN, bias=False)),
)
