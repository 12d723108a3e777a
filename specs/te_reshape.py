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
# A -1 last dim (TE's Reshape((2, 3, -1))) is the width torch infers: known at run time where no op
# after it needs one (split_rows), fixed by the op after it that does (split_norm).
split_rows = te.ops.Sequential(te.ops.Reshape((2, 3, -1)), te.ops.SwiGLU(), te.ops.AddExtraInput())
split_norm = te.ops.Sequential(te.ops.GELU(), te.ops.Reshape((2, 3, -1)), te.ops.RMSNorm(HEAD))
# Only Identity ops (views, like Reshape): the module returns its input, a view of it as TE's fuser
# does, and passes the grad through; no kernel.
identity_only = te.ops.Sequential(te.ops.Identity(), te.ops.Identity())
