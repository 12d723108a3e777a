"""Transformer Engine's monolithic modules as a TE user writes them (issue 39): each expands to the
te.ops ops it computes and fuses as they do, its parameters under TE's names
(``0.layer_norm_weight``, ``0.fc1_weight``, ...), so a TE checkpoint loads into the generated module."""

import transformer_engine.pytorch as te

HIDDEN = 1024
FFN = 4096

# te.LayerNormMLP: RMSNorm, fc1 (2 * FFN outputs for the gated SwiGLU), SwiGLU, fc2, no biases (Llama)
te_layernorm_mlp = te.Sequential(
    te.LayerNormMLP(HIDDEN, FFN, bias=False, normalization="RMSNorm", activation="swiglu"),
)

# te.LayerNormLinear: LayerNorm (zero-centred gamma), then a Linear with bias (a QKV projection)
te_layernorm_linear = te.Sequential(
    te.LayerNormLinear(HIDDEN, 3 * HIDDEN, zero_centered_gamma=True),
)
