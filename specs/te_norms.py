"""L2Normalization between two Linears: TE runs it as PyTorch, and so does the generated module
(an opaque stage between the fused groups)."""

import transformer_engine.pytorch as te

l2norm_block = te.ops.Sequential(
    te.ops.Linear(256, 256), te.ops.L2Normalization(eps=1e-5), te.ops.Linear(256, 256),
)
