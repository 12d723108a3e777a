"""Dropout(p): in training, y = x * keep / (1 - p) with keep drawn per element with probability
1 - p; in eval mode, y = x. Backward: dx = dy * keep / (1 - p) with the SAME keep, regenerated
from the draw rather than stored (catalog 2.11, 6.3 item 17).

The draws are counter-based: element ``i`` of the op's value under a 64-bit key is a fixed hash of
(key, i) (``uniform`` in ops/common.py; ``fg::uniform`` in templates/cuda/common.cuh is the same
function), so the forward and backward kernels, and the CPU reference, draw identical masks with
no state but the key. The key comes from PyTorch's generator on the value's device once per call (``new_seed``):
reproducible under ``torch.manual_seed``, fresh each call, drawn on the GPU so a CUDA graph replays
fresh draws. The key tensor is the op's operand (``Operand("random", ...)``); in eval mode the
generated module passes None, which every kernel reads as "keep all, unscaled" (draws of 1).

A draw has 24 bits, so p acts at a resolution of 2**-24 (TE's fused kernel: 2**-8): an element is
kept when its draw is at least p rounded up to a multiple of 2**-24 (``_threshold``, exact in
float32, so the kernels and the float64 reference keep the same elements); kept values are scaled
by the exact 1 / (1 - p).
"""

import math

from .lazy import torch
from .opdef import Arg, OpDef, Operand, check_probability, float_tag, register


def _threshold(p: float) -> float:
    return math.ceil(p * 2**24) / 2**24


def dropout(x, t, p, scale):
    """t: each element's draw, or 1 in eval mode (then y = x)."""
    return torch.where(t >= 1, x, torch.where(t >= p, x * scale, torch.zeros_like(x)))


def dropout_bwd(x, t, dy, p, scale):
    """(dx, dt): the forward's mask and scale on dy; the draws have no gradient."""
    return dropout(dy, t, p, scale), torch.zeros_like(dy)


register(OpDef(
    "Dropout", "dropout",
    args=(Arg("p", "float", check=check_probability),),
    tag=lambda a: "dropout" + float_tag(a["p"]),
    device_struct="fg::Dropout", device_args=lambda a: (_threshold(a["p"]), 1.0 / (1.0 - a["p"]) if a["p"] < 1 else 0.0),
    operand=Operand("random", "random", grad="none", read_in_backward=True),
    reference=(dropout, dropout_bwd),
    summary="in training, y = x * keep / (1 - p), keep ~ Bernoulli(1 - p) per element; in eval, y = x",
))
