"""Unary activations: GELU (tanh approximation), ReLU, SiLU, SReLU (squared ReLU), QGELU (x·σ(1.702x)).

Each is one ``OpDef`` naming its functor in templates/cuda/activations.cuh (fwd(x), bwd(x, dy))
and its reference forward and backward here, which compute the same formulas (in float64, the
constants are the kernel's float literals, written inline). The reference functions below are
shipped by source into the output's ``_reference.py`` (ops/shipped.py): they may use only
``torch``, ``math`` and other shipped functions.
"""

from .common import compute
from .lazy import torch
from .opdef import CACHE_QUANTIZED_INPUT, OpDef, register


def gelu(x):
    # 0.79788456 = sqrt(2 / pi), 0.03567741 = sqrt(2 / pi) * 0.044715 (as in fg::Gelu)
    return x * (0.5 + 0.5 * torch.tanh(x * (0.79788456 + 0.03567741 * x * x)))


def gelu_bwd(x, dy):
    k0 = 0.79788456  # sqrt(2 / pi)
    t = torch.tanh(k0 * x * (1 + 0.044715 * x * x))
    return dy * (0.5 * x * (1 - t * t) * (k0 + 0.1070322243 * x * x) + 0.5 * (1 + t))


def addmm_gelu(bias, x, weight):
    """GELU(x W^T + b) with GELU's tanh approximation, as one GEMM on CUDA: cuBLASLt's bias + GELU
    epilogue (torch._addmm_activation; cuBLASLt's GELU is the tanh approximation). On CPU that
    function applies the erf GELU instead, so there the GEMM runs, then the reference GELU."""
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return gelu(compute(torch.addmm(bias, x, weight.t()))).to(x.dtype)


def relu(x):
    return torch.clamp_min(x, 0)


def relu_bwd(x, dy):
    return torch.where(x > 0, dy, torch.zeros_like(dy))


def silu(x):
    return x * torch.sigmoid(x)


def silu_bwd(x, dy):
    s = torch.sigmoid(x)
    return dy * (s + x * s * (1 - s))


def srelu(x):
    return torch.clamp_min(x, 0).square()


def srelu_bwd(x, dy):
    return dy * torch.clamp_min(2 * x, 0)


register(OpDef(
    # its own kind: the no-grad forward's GEMM epilogue can take it (fusion_rules/linear_epilogue.py)
    "GELU", "gelu", args=(CACHE_QUANTIZED_INPUT,), tag=lambda a: "gelu", device_struct="fg::Gelu<Math>",
    reference=(gelu, gelu_bwd), summary="tanh-approximated GELU", needs_input_in_backward=True,
    reference_helpers=(addmm_gelu,),
))
register(OpDef(
    # its own kind: a GEMM epilogue can take it (fusion_rules/linear_epilogue.py), other activations not
    "ReLU", "relu", args=(CACHE_QUANTIZED_INPUT,), tag=lambda a: "relu", device_struct="fg::Relu",
    reference=(relu, relu_bwd), summary="max(x, 0)", needs_input_in_backward=True, backward_from_output=True,
))
register(OpDef(
    "SiLU", "activation", args=(CACHE_QUANTIZED_INPUT,), tag=lambda a: "silu", device_struct="fg::Silu<Math>",
    reference=(silu, silu_bwd), summary="x * sigmoid(x)", needs_input_in_backward=True,
))
register(OpDef(
    "SReLU", "activation", args=(CACHE_QUANTIZED_INPUT,), tag=lambda a: "srelu", device_struct="fg::Srelu",
    reference=(srelu, srelu_bwd), summary="relu(x)^2", needs_input_in_backward=True,
))


def qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def qgelu_bwd(x, dy):
    s = torch.sigmoid(1.702 * x)
    return dy * (s + 1.702 * x * s * (1 - s))


register(OpDef(
    "QGELU", "activation", args=(CACHE_QUANTIZED_INPUT,), tag=lambda a: "qgelu", device_struct="fg::Qgelu<Math>",
    reference=(qgelu, qgelu_bwd), summary="x * sigmoid(1.702 x) (quick GELU)", needs_input_in_backward=True,
))
