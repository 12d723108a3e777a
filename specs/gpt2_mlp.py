"""GPT-2's MLP block (hidden 1024, as GPT-2 medium): LayerNorm, Linear, GELU (tanh), Linear."""

from fusegen.eager import GELU, LayerNorm, Linear, Sequential

HIDDEN = 1024

gpt2_mlp = Sequential(
    LayerNorm(HIDDEN),
    Linear(HIDDEN, 4 * HIDDEN),
    GELU(),
    Linear(4 * HIDDEN, HIDDEN),
)
