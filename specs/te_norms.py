"""L2Normalization between two Linears: TE runs it as torch.compile'd PyTorch; here, at its fixed
width, it runs in the generated norm kernels (fusion_rules/l2_normalization.py)."""

import transformer_engine.pytorch as te

l2norm_block = te.ops.Sequential(
    te.ops.Linear(256, 256), te.ops.L2Normalization(eps=1e-5), te.ops.Linear(256, 256),
)
