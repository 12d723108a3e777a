"""Pre-norm transformer blocks written with Residual: y = x + ops(x).

Each Residual is data flow (a tee at its start, an add at its end, joined by one value), so the
add that closes one fuses into the next Residual's norm kernel and a GEMM that ends one adds into
the residual with beta = 1, as with TE's extra-tensor channels.
"""

import transformer_engine.pytorch as te

HIDDEN = 1024

# An MLP block then a projection block: the first Residual's closing add fuses into the second's
# LayerNorm (and its grad into the LayerNorm's backward); the second's GEMM adds into the residual.
residual_blocks = te.ops.Sequential(
    te.ops.Residual(
        te.ops.RMSNorm(HIDDEN),
        te.ops.Linear(HIDDEN, 4 * HIDDEN),
        te.ops.GELU(),
        te.ops.Linear(4 * HIDDEN, HIDDEN),
    ),
    te.ops.Residual(
        te.ops.LayerNorm(HIDDEN),
        te.ops.Linear(HIDDEN, HIDDEN, bias=False),  # its GEMM adds into the residual (beta = 1)
    ),
)

# The design note's spelling (te.Residual), a nested Residual, and a Residual that ends in an
# elementwise op (its add fuses into that op's kernel).
nested_residual = te.ops.Sequential(
    te.ops.Linear(HIDDEN, HIDDEN, bias=False),
    te.Residual(
        te.ops.LayerNorm(HIDDEN),
        te.ops.Residual(
            te.ops.RMSNorm(HIDDEN),
            te.ops.Linear(HIDDEN, HIDDEN),
        ),
        te.ops.GELU(),
    ),
    te.ops.RMSNorm(HIDDEN),
)
