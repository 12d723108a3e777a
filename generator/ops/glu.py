"""Gated linear units: SwiGLU, GEGLU and GPT-OSS's ClampedSwiGLU.

A GLU splits the row in halves and gates the FIRST half (unlike torch.nn.functional.glu):
y = act(a) * b, half the input width. Each is one ``OpDef`` naming its functor in
templates/cuda/activations.cuh (fwd(a, b), bwd(a, b, dy, da, db)). The reference functions below
are shipped by source into the output's ``_reference.py`` (ops/shipped.py): they may use only
``torch``, ``math`` and other shipped functions (the activations they gate are listed in
``reference_helpers``).
"""

from .activations import gelu, gelu_bwd, silu, silu_bwd
from .lazy import torch
from .opdef import Arg, OpDef, check_finite, check_positive_finite, float_tag, register


def swiglu(x):
    a, b = x.chunk(2, dim=-1)  # the FIRST half is the gate (unlike torch.nn.functional.glu)
    return silu(a) * b


def swiglu_bwd(x, dy):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([silu_bwd(a, dy * b), dy * silu(a)], dim=-1)


def geglu(x):
    a, b = x.chunk(2, dim=-1)  # the FIRST half is the gate (unlike torch.nn.functional.glu)
    return gelu(a) * b


def geglu_bwd(x, dy):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([gelu_bwd(a, dy * b), dy * gelu(a)], dim=-1)


def clamped_swiglu(x, limit, alpha, offset):
    a, b = x.chunk(2, dim=-1)
    g = torch.clamp_max(a, limit)
    return g * torch.sigmoid(alpha * g) * (torch.clamp(b, -limit, limit) + offset)


def clamped_swiglu_bwd(x, dy, limit, alpha, offset):
    """No gradient through an active clamp: da = 0 where a > limit, db = 0 where |b| > limit."""
    a, b = x.chunk(2, dim=-1)
    g = torch.clamp_max(a, limit)
    s = torch.sigmoid(alpha * g)
    linear = torch.clamp(b, -limit, limit) + offset
    da = torch.where(a > limit, torch.zeros_like(dy), dy * linear * (s + alpha * g * s * (1 - s)))
    db = torch.where(b.abs() > limit, torch.zeros_like(dy), dy * g * s)
    return torch.cat([da, db], dim=-1)


register(OpDef(
    "SwiGLU", "glu", tag=lambda a: "swiglu", device_struct="fg::SwiGLU",
    out_features=lambda a, n: n // 2,
    reference=(swiglu, swiglu_bwd), reference_helpers=(silu, silu_bwd),
    summary="silu(a) * b, a = first half", needs_input_in_backward=True,
))
register(OpDef(
    "GEGLU", "glu", tag=lambda a: "geglu", device_struct="fg::GeGLU",
    out_features=lambda a, n: n // 2,
    reference=(geglu, geglu_bwd), reference_helpers=(gelu, gelu_bwd),
    summary="gelu_tanh(a) * b, a = first half", needs_input_in_backward=True,
))
register(OpDef(
    # GPT-OSS: a' = min(a, limit); y = a' * sigmoid(alpha * a') * (clamp(b, -limit, limit) + offset)
    "ClampedSwiGLU", "glu",
    args=(Arg("limit", "float", 7.0, keyword_only=True, check=check_positive_finite),
          Arg("alpha", "float", 1.702, keyword_only=True, check=check_finite),
          Arg("glu_linear_offset", "float", 1.0, keyword_only=True, check=check_finite)),
    tag=lambda a: "clamped_swiglu" + "".join(
        f"_{key}{float_tag(a[name])}" for key, name, default in
        (("l", "limit", 7.0), ("a", "alpha", 1.702), ("o", "glu_linear_offset", 1.0)) if a[name] != default),
    device_struct="fg::ClampedSwiGLU", device_args=lambda a: (a["limit"], a["alpha"], a["glu_linear_offset"]),
    out_features=lambda a, n: n // 2,
    reference=(clamped_swiglu, clamped_swiglu_bwd),
    summary="min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit) + offset), a = first half",
    needs_input_in_backward=True,
))
