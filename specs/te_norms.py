"""L2Normalization between two Linears: TE runs it as torch.compile'd PyTorch; here, at its fixed
width, it runs in the generated norm kernels (fusion_rules/l2_normalization.py)."""

import transformer_engine.pytorch as te

l2norm_block = te.ops.Sequential(
    te.ops.Linear(256, 256), te.ops.L2Normalization(eps=1e-5), te.ops.Linear(256, 256),
)

# Norms over several trailing dims (TE's and PyTorch's multi-dim normalized_shape): the kernels
# normalise rows of the dims' product, and the parameters keep normalized_shape as their shape.
layernorm_2d = te.ops.Sequential(te.ops.LayerNorm((7, 2)))
rmsnorm_groups = te.ops.Sequential(
    te.ops.Linear(64, 64), te.ops.RMSNorm((4, 64), zero_centered_gamma=True), te.ops.Linear(64, 32),
)
