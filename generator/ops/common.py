"""Helpers every reference function may call, shipped first in the output's ``_reference.py``.

Like the op modules' reference functions, these are copied by source (ops.shipped), so they may
use only ``torch``, ``math`` and each other.
"""

import math

from .lazy import torch


def compute(t):
    """The tensor in the reference math's precision. On CPU, float64: one rounding at the end, and
    no dependence on torch's float32 CPU math (torch 2.13's float32 tanh on CPU is off by up to
    ~1e-4 in some processes). On a GPU (fusegen's eager Sequential, the benchmarks' eager peer),
    float32 for 16-bit floats, as the kernels and plain PyTorch compute."""
    if not t.is_floating_point():
        return t
    if t.device.type == "cpu":
        return t.double()
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def init_parameter(p, init):
    """Initialise a parameter in place as TE does (catalog section 5, item 6)."""
    with torch.no_grad():
        if init == "ones":
            p.fill_(1.0)
        elif init == "zeros":
            p.zero_()
        elif init == "kaiming_uniform":  # nn.Linear's default, as BasicLinear
            torch.nn.init.kaiming_uniform_(p, a=math.sqrt(5))
        else:
            raise ValueError(f"unknown parameter init {init!r}")


# In this order at the top of _reference.py, after its imports.
COMMON = (compute, init_parameter)
