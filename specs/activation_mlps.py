"""MLPs with the activations that take constants or square: GPT-OSS's clamped SwiGLU and the
squared-ReLU MLP (Nemotron). Their kernels put ClampedSwiGLU and SReLU through every path."""

import transformer_engine.pytorch as te

HIDDEN = 1024
FFN = 2048

# Non-default constants, so the kernels are built from them. The clamps' derivatives jump, so the
# pipeline tests (low-precision GEMM outputs) keep clear of the limit; the kernel tests feed inputs
# that cross it.
gpt_oss_mlp = te.ops.Sequential(
    te.ops.RMSNorm(HIDDEN),
    te.ops.Linear(HIDDEN, 2 * FFN),
    te.ops.ClampedSwiGLU(limit=6.0, alpha=1.5, glu_linear_offset=0.5),
    te.ops.Linear(FFN, HIDDEN),
)

relu2_mlp = te.ops.Sequential(
    te.ops.LayerNorm(HIDDEN),
    te.ops.Linear(HIDDEN, FFN),
    te.ops.SReLU(),
    te.ops.Linear(FFN, HIDDEN),
)
