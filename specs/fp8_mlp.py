"""FP8 (issue 40): the Llama-3-8B MLP block the FP8 benchmark runs, a narrow MLP whose casts are
kernels of their own, and a small MLP of TE's module whose FP8 state TE's modules hold.
pyproject.toml builds them for FP8 ([tool.fusegen.pipelines] fp8): inside
``generated.autocast(recipe=...)`` their GEMMs run in FP8, outside it in bf16.
"""

import transformer_engine.pytorch as te

HIDDEN = 4096
FFN = 14336

# RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU, Linear 14336 -> 4096, and the residual around them
llama_mlp = te.Sequential(
    te.Residual(
        te.RMSNorm(HIDDEN),
        te.Linear(HIDDEN, 2 * FFN, bias=False),
        te.SwiGLU(),
        te.Linear(FFN, HIDDEN, bias=False),
    ),
)

# A SwiGLU 320 wide, no multiple of the FP8 variants' 256 columns: its kernels keep their outputs'
# amaxes for the separate casts (the _amax variants) instead of writing FP8 themselves
fp8_narrow_mlp = te.ops.Sequential(
    te.ops.RMSNorm(128),
    te.ops.Linear(128, 640, bias=False),
    te.ops.SwiGLU(),
    te.ops.Linear(320, 128, bias=False),
)

# TE's monolithic module: its two GEMMs' FP8 state in one _extra_state, as TE's
fp8_layernorm_mlp = te.Sequential(te.LayerNormMLP(256, 512, activation="swiglu", normalization="RMSNorm"))
