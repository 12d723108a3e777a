"""A pre-norm residual block: y = x + Linear(RMSNorm(x)) written with extra tensors.

MakeExtraOutput hands x out (the residual stream); AddExtraInput adds the residual back.
"""

import transformer_engine.pytorch as te

HIDDEN = 4096

prenorm_block = te.ops.Sequential(
    te.ops.MakeExtraOutput(),
    te.ops.RMSNorm(HIDDEN),
    te.ops.Linear(HIDDEN, HIDDEN),
    te.ops.AddExtraInput(),
)
