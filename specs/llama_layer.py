"""The Llama-3-8B decoder layer of issue 38, in the design note's spelling (``llama_layer``) and as
a Transformer Engine user writes it (``llama_layer_te``, issue 39): bench/bench_layer.py measures
both (``generated.LlamaLayer``, ``generated.LlamaLayerTe``) against eager PyTorch and torch.compile.

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

# te.TransformerLayer at TE's defaults but Llama's settings: its query, key and value weights
# (fuse_qkv_params=False), packed sequences ("thd"), no dropout; the rotary comes through forward's
# rotary_pos_emb, TE's RotaryPositionEmbedding(128, rotary_base=500000) table
llama_layer_te = te.Sequential(
    te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=KV_HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                        bias=False, activation="swiglu", normalization="RMSNorm", attn_input_format="thd"),
)

# The same layer with TE's one fused QKV weight in [q | k | v] row order (fuse_qkv_params=True,
# qkv_weight_interleaved=False): the hand-written layer's parameters under TE's names, so the
# benchmark tells TE's call form's host time from its three split parameters'
llama_layer_te_fused = te.Sequential(
    te.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=KV_HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                        bias=False, activation="swiglu", normalization="RMSNorm", attn_input_format="thd",
                        fuse_qkv_params=True, qkv_weight_interleaved=False),
)
