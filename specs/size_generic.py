"""Pipelines in which no op fixes the feature size, as TE runs them at any width: their kernels
take the width at run time (16-byte vectors when a row and its pointers allow, one element at a
time otherwise). `swiglu_any` is also built at the width in pyproject.toml's
[tool.fusegen.pipelines.swiglu_any] features; its launcher hands rows of that width to the
fixed-size kernel."""

import transformer_engine.pytorch as te

gelu_any = te.ops.Sequential(te.ops.GELU())
swiglu_any = te.ops.Sequential(te.ops.SwiGLU())
# An extra output after the GLU: the half-width value, handed out mid-run.
glu_tee_any = te.ops.Sequential(te.ops.SwiGLU(), te.ops.MakeExtraOutput(), te.ops.ConstantScale(0.5))
# ... and a GELU after it: its backward recomputes the SwiGLU in registers, then GELU's derivative.
glu_gelu_any = te.ops.Sequential(te.ops.SwiGLU(), te.ops.MakeExtraOutput(), te.ops.GELU())
# A residual branch: add, scale, hand out the sum, activate.
residual_any = te.ops.Sequential(
    te.ops.AddExtraInput(),
    te.ops.ConstantScale(0.5),
    te.ops.MakeExtraOutput(),
    te.ops.QGELU(),
)
