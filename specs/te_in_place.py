"""TE's in-place residual adds: AddExtraInput(in_place=True) also writes its sum into the caller's
residual tensor (catalog 2.10), as TE's ForwardLinearBiasAdd pattern and pre-norm blocks use it;
values and grads are those of the out-of-place add."""

import transformer_engine.pytorch as te

HIDDEN = 256

# A block's output projection adding into the residual stream.
residual_in_place = te.ops.Sequential(te.ops.Linear(HIDDEN, HIDDEN), te.ops.AddExtraInput(in_place=True))
# The residual stream's update, then the next block's norm.
prenorm_in_place = te.ops.Sequential(te.ops.AddExtraInput(in_place=True), te.ops.RMSNorm(HIDDEN))
# The sum mid-run, inside one fused elementwise kernel.
in_place_mid = te.ops.Sequential(te.ops.Bias(HIDDEN), te.ops.AddExtraInput(in_place=True), te.ops.GELU())
