"""te.MultiheadAttention as a TE user writes it (issue 39): it expands to the te.ops ops it
computes (norm, the QKV Linear, the attention op, the output projection) and fuses as they do, its
parameters under TE's names and layouts, so a TE checkpoint loads into the generated module.

The first keeps TE's QKV default, fuse_qkv_params=False: ``0.layernorm_qkv.query_weight``,
``key_weight``, ``value_weight`` (and biases), row blocks of one buffer that the GEMM reads as one
weight without a copy. The second fuses them (fuse_qkv_params=True) in TE's default
qkv_weight_interleaved=True layout, rows grouped per GQA group (``0.layernorm_qkv.weight``),
handed to the GEMM in [q | k | v] order. x is read batch first (qkv_format="bshd") and packed
("thd": tokens with cu_seqlens); TE's default "sbhd" is in specs/te_models.py. The attention
drops softmax probabilities in training with TE's default attention_dropout=0.1.
"""

import transformer_engine.pytorch as te

HIDDEN = 256

# GPT-style: LayerNorm, QKV and output projections with biases, 4 heads of 64, causal
te_gpt_attention = te.Sequential(
    te.MultiheadAttention(HIDDEN, 4, input_layernorm=True, qkv_format="bshd"),
)

# Llama-style: RMSNorm, grouped-query attention (8 query heads sharing 2 kv heads of 32), no biases;
# rotary as TE passes it, a table through forward's rotary_pos_emb (the prep kernels' table variant)
te_gqa_attention = te.Sequential(
    te.MultiheadAttention(HIDDEN, 8, num_gqa_groups=2, input_layernorm=True,
                          normalization="RMSNorm", bias=False, fuse_qkv_params=True, qkv_format="thd"),
)
