"""TE's row-scaled activations (MoE routing weights): y = f(x) * s[row], the scales an extra input
of one value per row; the scale and its gradient (summed over each row) fuse into the activation's
kernels. Size-generic where no op fixes the width, as TE runs them."""

import transformer_engine.pytorch as te

HIDDEN = 256
FFN = 512

moe_srelu = te.ops.Sequential(te.ops.Linear(HIDDEN, FFN), te.ops.ScaledSReLU(), te.ops.Linear(FFN, HIDDEN))
moe_swiglu = te.ops.Sequential(te.ops.ScaledSwiGLU())
moe_situglu = te.ops.Sequential(te.ops.ScaledSiTUGLU(glu_interleave_size=32, beta1=2.0))
moe_geglu = te.ops.Sequential(te.ops.ScaledClampedQGeGLU(limit=5.0))
