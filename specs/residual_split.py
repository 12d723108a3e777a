"""A feed-forward block split in two around the residual stream (TE docs' residual example).

fc1 hands its normalized input out as an extra output; fc2 adds a residual extra input.
"""

from transformer_engine.pytorch.ops import (
    AddExtraInput,
    LayerNorm,
    Linear,
    MakeExtraOutput,
    Sequential,
    SwiGLU,
)

HIDDEN = 4096
FFN = 14336

fc1 = Sequential(
    LayerNorm(HIDDEN),
    MakeExtraOutput(),
    Linear(HIDDEN, 2 * FFN),
    SwiGLU(),
)

fc2 = Sequential(
    Linear(FFN, HIDDEN),
    AddExtraInput(),
)
