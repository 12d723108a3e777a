"""TE's Reshape: per-head RMSNorm (the projection's output viewed as heads of 64, normalised, viewed
back), and a size-generic pipeline that views any input as rows of 64. Each Reshape is a view in
the generated forward and backward, and the outputs take the leading dims it makes."""

import transformer_engine.pytorch as te

HIDDEN = 256
HEAD = 64

head_norm = te.ops.Sequential(
    te.ops.Linear(HIDDEN, HIDDEN),
    te.ops.Reshape((-1, HIDDEN // HEAD, HEAD)),
    te.ops.RMSNorm(HEAD),
    te.ops.Reshape((-1, HIDDEN)),
    te.ops.GELU(),
)
rows_of_64 = te.ops.Sequential(te.ops.SiLU(), te.ops.Reshape((-1, HEAD)), te.ops.MakeExtraOutput(), te.ops.Bias(HEAD))
