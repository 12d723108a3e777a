"""What a GEMM's epilogue absorbs (fusion_rules/linear_epilogue.py): a residual add as beta = 1
(TE's ForwardLinearBiasAdd, here with the in-place residual TE requires for it), a ConstantScale as
alpha in forward and backward (ForwardLinearScaleAdd, BackwardLinearScale), a bias with a scale
as alpha = beta, and a bias with a ReLU (cuBLASLt's epilogue)."""

import transformer_engine.pytorch as te

HIDDEN = 256

linear_residual = te.ops.Sequential(
    te.ops.BasicLinear(HIDDEN, HIDDEN), te.ops.AddExtraInput(in_place=True),
)
scaled_residual = te.ops.Sequential(
    te.ops.BasicLinear(HIDDEN, HIDDEN), te.ops.ConstantScale(0.5), te.ops.AddExtraInput(),
)
scaled_linear = te.ops.Sequential(te.ops.Linear(HIDDEN, HIDDEN), te.ops.ConstantScale(2.0), te.ops.GELU())
scaled_projection = te.ops.Sequential(te.ops.BasicLinear(HIDDEN, 128), te.ops.ConstantScale(0.25))
# cuBLASLt's bias + ReLU epilogue; the ReLU's backward reads the output the GEMM wrote.
relu_mlp = te.ops.Sequential(te.ops.Linear(HIDDEN, 2 * HIDDEN), te.ops.ReLU(), te.ops.Linear(2 * HIDDEN, HIDDEN))
