"""te.TransformerLayer as a TE user writes it (issue 39): an encoder layer expands to its
self-attention and its MLP, each in a residual branch (Dropout(hidden_dropout) before the add),
and fuses as the hand-written chain does; its parameters keep TE's nested names
(``0.self_attention.layernorm_qkv.query_weight``, ``0.layernorm_mlp.fc1_weight``), so a TE
checkpoint loads into the generated module. The GPT-style layer keeps TE's split QKV parameters
(fuse_qkv_params=False), the Llama-style one fuses them in TE's interleaved layout
(fuse_qkv_params=True); both keep TE's attention_dropout=0.1."""

import transformer_engine.pytorch as te

HIDDEN = 256

# GPT-style: pre-LayerNorm, 4 heads of 64, biases, GELU MLP, dropout 0.1 on each block's output
te_gpt_layer = te.Sequential(
    te.TransformerLayer(HIDDEN, 4 * HIDDEN, 4, attn_input_format="bshd"),
)

# Llama-style (rotary as TE passes it, a table through forward(rotary_pos_emb=...)): pre-RMSNorm,
# grouped-query attention (8 query heads sharing 2 kv heads of 32), SwiGLU, no biases, no hidden dropout
te_llama_layer = te.Sequential(
    te.TransformerLayer(HIDDEN, 512, 8, num_gqa_groups=2, hidden_dropout=0.0, bias=False,
                        activation="swiglu", normalization="RMSNorm", fuse_qkv_params=True,
                        attn_input_format="thd"),
)
