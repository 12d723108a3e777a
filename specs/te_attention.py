"""te.MultiheadAttention as a TE user writes it (issue 39): it expands to the te.ops ops it
computes (norm, the fused QKV Linear, the attention op, the output projection) and fuses as they
do, its parameters under TE's names (``0.layernorm_qkv.weight``, ``0.proj.weight``, ...), so a TE
checkpoint loads into the generated module.

fusegen reads TE's QKV weight in one layout: fuse_qkv_params=True, qkv_weight_interleaved=False
([all q heads | all k heads | all v heads]) and reads a 3-D x batch first (qkv_format="bshd";
"thd": packed tokens with cu_seqlens). TE's defaults for these are refused with what to write
(README, TE's modules). The attention drops softmax probabilities in training with TE's default
attention_dropout=0.1.
"""

import transformer_engine.pytorch as te

HIDDEN = 256

# GPT-style: LayerNorm, QKV and output projections with biases, 4 heads of 64, causal
te_gpt_attention = te.Sequential(
    te.MultiheadAttention(HIDDEN, 4, input_layernorm=True, fuse_qkv_params=True,
                          qkv_weight_interleaved=False, qkv_format="bshd"),
)

# Llama-style: RMSNorm, grouped-query attention (8 query heads sharing 2 kv heads of 32), no biases;
# rotary as TE passes it, a table through forward's rotary_pos_emb (the prep kernels' table variant)
te_gqa_attention = te.Sequential(
    te.MultiheadAttention(HIDDEN, 8, num_gqa_groups=2, input_layernorm=True,
                          normalization="RMSNorm", bias=False, fuse_qkv_params=True, qkv_weight_interleaved=False,
                          qkv_format="thd"),
)
