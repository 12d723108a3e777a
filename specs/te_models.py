"""Whole models from te.TransformerLayer as a TE user writes them (issue 39's done-when), each
beside the hand-written Sequential of the same layers: a generated te_* module loads a state_dict
laid out with TE's names (``0.self_attention.layernorm_qkv.query_weight``, ...) and computes what
the hand-written one computes (tests/ops/test_te_models.py trains both and compares).

GPT-style: three layers of 4 heads of 64, each with other settings: TE's defaults (pre-LayerNorm,
GELU, biases); zero-centred gamma with eps 1e-6 and quick-GELU; residuals after the norms
(apply_residual_connection_post_layernorm). Llama-style: two layers of RMSNorm, SwiGLU, no biases,
grouped-query attention (8 query heads sharing 2 kv heads, then one: multi-query).
"""

import transformer_engine.pytorch as te

HIDDEN = 256
FFN = 4 * HIDDEN
LLAMA_FFN = 512

te_gpt_stack = te.Sequential(
    te.TransformerLayer(HIDDEN, FFN, 4, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                        qkv_weight_interleaved=False, attn_input_format="thd"),
    te.TransformerLayer(HIDDEN, FFN, 4, layernorm_epsilon=1e-6, zero_centered_gamma=True, activation="qgelu",
                        hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                        qkv_weight_interleaved=False, attn_input_format="thd"),
    te.TransformerLayer(HIDDEN, FFN, 4, apply_residual_connection_post_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                        qkv_weight_interleaved=False, attn_input_format="thd"),
)

gpt_stack = te.Sequential(
    te.Residual(
        te.LayerNorm(HIDDEN),
        te.Linear(HIDDEN, 3 * HIDDEN),
        te.MultiHeadedSelfAttention(HIDDEN, 4),
        te.Linear(HIDDEN, HIDDEN),
    ),
    te.Residual(te.LayerNorm(HIDDEN), te.Linear(HIDDEN, FFN), te.GELU(), te.Linear(FFN, HIDDEN)),
    te.Residual(
        te.LayerNorm(HIDDEN, eps=1e-6, zero_centered_gamma=True),
        te.Linear(HIDDEN, 3 * HIDDEN),
        te.MultiHeadedSelfAttention(HIDDEN, 4),
        te.Linear(HIDDEN, HIDDEN),
    ),
    te.Residual(te.LayerNorm(HIDDEN, eps=1e-6, zero_centered_gamma=True), te.Linear(HIDDEN, FFN), te.QGELU(),
                te.Linear(FFN, HIDDEN)),
    te.LayerNorm(HIDDEN),  # the residual is the norm's output
    te.Residual(te.Linear(HIDDEN, 3 * HIDDEN), te.MultiHeadedSelfAttention(HIDDEN, 4), te.Linear(HIDDEN, HIDDEN)),
    te.LayerNorm(HIDDEN),
    te.Residual(te.Linear(HIDDEN, FFN), te.GELU(), te.Linear(FFN, HIDDEN)),
)

te_llama_stack = te.Sequential(
    te.TransformerLayer(HIDDEN, LLAMA_FFN, 8, num_gqa_groups=2, bias=False, activation="swiglu",
                        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                        qkv_weight_interleaved=False, attn_input_format="thd"),
    te.TransformerLayer(HIDDEN, LLAMA_FFN, 8, num_gqa_groups=1, bias=False, activation="swiglu",
                        normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True,
                        qkv_weight_interleaved=False, attn_input_format="thd"),
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
