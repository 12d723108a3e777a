"""Dropout as TE places it: after an MLP's activation, and before the residual add ("bias, dropout,
add"), fused into the elementwise kernels around it; before a GLU (its draws cover both halves);
and alone, at any width. Masks are drawn from a per-call key and regenerated in backward."""

import transformer_engine.pytorch as te

HIDDEN = 256
FFN = 512

dropout_mlp = te.ops.Sequential(
    te.ops.Linear(HIDDEN, FFN),
    te.ops.GELU(),
    te.ops.Dropout(0.1),
    te.ops.Linear(FFN, HIDDEN),
    te.ops.Dropout(0.1),
    te.ops.AddExtraInput(),
)
dropout_glu = te.ops.Sequential(te.ops.Linear(HIDDEN, 2 * FFN), te.ops.Dropout(0.2), te.ops.SwiGLU())
dropout_any = te.ops.Sequential(te.ops.Dropout(0.25))
# "Bias, dropout, add" then the norm, as after attention: one norm kernel applies the bias and the
# dropout as it loads x, adds the residual and writes it once (fusion_rules/dropout_norm.py).
post_attention = te.ops.Sequential(
    te.ops.Linear(HIDDEN, HIDDEN),
    te.ops.Dropout(0.1),
    te.ops.AddExtraInput(),
    te.ops.MakeExtraOutput(),
    te.ops.LayerNorm(HIDDEN),
)
# Dropout after a norm: the norm kernel drops out the normalized row before it stores it.
norm_dropout = te.ops.Sequential(te.ops.RMSNorm(HIDDEN), te.ops.Dropout(0.3), te.ops.Linear(HIDDEN, FFN))
# A MakeExtraOutput right before a norm that a Dropout follows: the extra output, the norm kernel's
# input and the input its backward reads are one tensor (this shape crashed the build: issue 36).
tee_norm_dropout = te.ops.Sequential(
    te.ops.Linear(HIDDEN, HIDDEN),
    te.ops.MakeExtraOutput(),
    te.ops.RMSNorm(HIDDEN),
    te.ops.Dropout(0.3),
)
