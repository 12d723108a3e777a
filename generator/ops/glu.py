"""Gated linear units: SwiGLU, GEGLU, GPT-OSS's ClampedSwiGLU, GLU, QGEGLU, ReGLU, SReGLU, SiTUGLU.

A GLU splits the row in halves and gates the FIRST half (unlike torch.nn.functional.glu):
y = act(a) * b, half the input width; with ``glu_interleave_size=k`` (SwiGLU, SiTUGLU,
ClampedSwiGLU, as in TE) the halves are alternating blocks of k instead. Each is one ``OpDef`` naming its functor in
templates/cuda/activations.cuh (fwd(a, b), bwd(a, b, dy, da, db)). The reference functions below
are shipped by source into the output's ``_reference.py`` (ops/shipped.py): they may use only
``torch``, ``math`` and other shipped functions (the activations they gate are listed in
``reference_helpers``).
"""

from .activations import gelu, gelu_bwd, qgelu, qgelu_bwd, relu, relu_bwd, silu, silu_bwd, srelu, srelu_bwd
from .lazy import torch
from .opdef import CACHE_QUANTIZED_INPUT, Arg, OpDef, check_finite, check_positive_finite, float_tag, register


def gated(x, act):
    """act(a) * b over the row's halves: the FIRST half a is gated (unlike torch.nn.functional.glu)."""
    a, b = x.chunk(2, dim=-1)
    return act(a) * b


def gated_bwd(x, dy, act, act_bwd):
    """[da, db] of act(a) * b."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([act_bwd(a, dy * b), dy * act(a)], dim=-1)


def swiglu(x):
    return gated(x, silu)


def swiglu_bwd(x, dy):
    return gated_bwd(x, dy, silu, silu_bwd)


def geglu(x):
    return gated(x, gelu)


def geglu_bwd(x, dy):
    return gated_bwd(x, dy, gelu, gelu_bwd)


# TE's glu_interleave_size (SwiGLU, SiTUGLU, ClampedSwiGLU): the input rows alternate blocks
# [a(k), b(k), a(k), ...]. The kernels read the blocks where they are (no de-interleaving copies);
# the reference math de-interleaves (common.deinterleave).
INTERLEAVE = Arg("glu_interleave_size", "int", None, keyword_only=True,
                 check=lambda v: None if v > 0 else "must be positive")


def _interleave_tag(a) -> str:
    return f"_i{a['glu_interleave_size']}" if a["glu_interleave_size"] is not None else ""


def _simple_glu(name, tag, struct, forward, backward, helpers, summary, interleaves=False):
    register(OpDef(
        name, "glu", args=(INTERLEAVE, CACHE_QUANTIZED_INPUT) if interleaves else (CACHE_QUANTIZED_INPUT,),
        tag=(lambda a: tag + _interleave_tag(a)) if interleaves else (lambda a: tag),
        interleave=(lambda a: a["glu_interleave_size"]) if interleaves else (lambda a: None),
        device_struct=struct, out_features=lambda a, n: n // 2,
        reference=(forward, backward), reference_helpers=(gated, gated_bwd, *helpers),
        summary=summary, needs_input_in_backward=True,
    ))


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


_simple_glu("SwiGLU", "swiglu", "fg::SwiGLU<Math>", swiglu, swiglu_bwd, (silu, silu_bwd),
            "silu(a) * b, a = first half", interleaves=True)
_simple_glu("GEGLU", "geglu", "fg::GeGLU<Math>", geglu, geglu_bwd, (gelu, gelu_bwd),
            "gelu_tanh(a) * b, a = first half")
register(OpDef(
    # GPT-OSS: a' = min(a, limit); y = a' * sigmoid(alpha * a') * (clamp(b, -limit, limit) + offset)
    "ClampedSwiGLU", "glu",
    args=(INTERLEAVE, Arg("limit", "float", 7.0, keyword_only=True, check=check_positive_finite),
          Arg("alpha", "float", 1.702, keyword_only=True, check=check_finite),
          Arg("glu_linear_offset", "float", 1.0, keyword_only=True, check=check_finite), CACHE_QUANTIZED_INPUT),
    tag=lambda a: "clamped_swiglu" + "".join(
        f"_{key}{float_tag(a[name])}" for key, name, default in
        (("l", "limit", 7.0), ("a", "alpha", 1.702), ("o", "glu_linear_offset", 1.0)) if a[name] != default)
    + _interleave_tag(a),
    interleave=lambda a: a["glu_interleave_size"],
    device_struct="fg::ClampedSwiGLU<Math>", device_args=lambda a: (a["limit"], a["alpha"], a["glu_linear_offset"]),
    out_features=lambda a, n: n // 2,
    reference=(clamped_swiglu, clamped_swiglu_bwd),
    summary="min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit) + offset), a = first half",
    needs_input_in_backward=True,
))


def sigmoid(x):
    return torch.sigmoid(x)


def sigmoid_bwd(x, dy):
    s = torch.sigmoid(x)
    return dy * s * (1 - s)


def glu(x):
    return gated(x, sigmoid)


def glu_bwd(x, dy):
    return gated_bwd(x, dy, sigmoid, sigmoid_bwd)


def qgeglu(x):
    return gated(x, qgelu)


def qgeglu_bwd(x, dy):
    return gated_bwd(x, dy, qgelu, qgelu_bwd)


def reglu(x):
    return gated(x, relu)


def reglu_bwd(x, dy):
    return gated_bwd(x, dy, relu, relu_bwd)


def sreglu(x):
    return gated(x, srelu)


def sreglu_bwd(x, dy):
    return gated_bwd(x, dy, srelu, srelu_bwd)


def situglu(x, beta1, beta2):
    a, b = x.chunk(2, dim=-1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))


def situglu_bwd(x, dy, beta1, beta2):
    """da = dy·g(b)·[(1 − t²)σ + β1·t·σ(1 − σ)], t = tanh(a/β1); db = dy·act(a)·(1 − tanh²(b/β2))."""
    a, b = x.chunk(2, dim=-1)
    t, s, u = torch.tanh(a / beta1), torch.sigmoid(a), torch.tanh(b / beta2)
    da = dy * beta2 * u * ((1 - t * t) * s + beta1 * t * s * (1 - s))
    db = dy * beta1 * t * s * (1 - u * u)
    return torch.cat([da, db], dim=-1)


_simple_glu("GLU", "glu", "fg::GLU<Math>", glu, glu_bwd, (sigmoid, sigmoid_bwd), "sigmoid(a) * b, a = first half")
_simple_glu("QGEGLU", "qgeglu", "fg::QGeGLU<Math>", qgeglu, qgeglu_bwd, (qgelu, qgelu_bwd),
            "a * sigmoid(1.702 a) * b, a = first half")
_simple_glu("ReGLU", "reglu", "fg::ReGLU", reglu, reglu_bwd, (relu, relu_bwd), "relu(a) * b, a = first half")
_simple_glu("SReGLU", "sreglu", "fg::SReGLU", sreglu, sreglu_bwd, (srelu, srelu_bwd),
            "relu(a)^2 * b, a = first half")
register(OpDef(
    # Sigmoid-tanh-unit GLU: act(a) = β1·tanh(a/β1)·σ(a), g(b) = β2·tanh(b/β2)
    "SiTUGLU", "glu",
    args=(INTERLEAVE, Arg("beta1", "float", 4.0, keyword_only=True, check=check_positive_finite),
          Arg("beta2", "float", 25.0, keyword_only=True, check=check_positive_finite), CACHE_QUANTIZED_INPUT),
    tag=lambda a: "situglu" + "".join(
        f"_{key}{float_tag(a[name])}" for key, name, default in (("b", "beta1", 4.0), ("c", "beta2", 25.0))
        if a[name] != default) + _interleave_tag(a),
    interleave=lambda a: a["glu_interleave_size"],
    device_struct="fg::SiTUGLU<Math>", device_args=lambda a: (a["beta1"], a["beta2"]),
    out_features=lambda a, n: n // 2,
    reference=(situglu, situglu_bwd),
    summary="beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2), a = first half",
    needs_input_in_backward=True,
))
