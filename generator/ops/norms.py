"""Row normalisations over the last dim: LayerNorm and RMSNorm (generated row kernels, fp32
statistics; a multi-dim ``normalized_shape`` normalises the last k dims, which the graph flattens
into one row of their product for the kernels, while the parameters keep TE's shape), and
L2Normalization (the same kernels at a fixed width; at any width its reference math in PyTorch,
as TE runs it).

Their kernels are templates/cuda/norm.cuh (norm stages), not elementwise functors. The reference
functions below are shipped by source into the output's ``_reference.py`` (ops/shipped.py): they
may use only ``torch``, ``math`` and other shipped functions (``compute``; ``_gamma`` is shipped as
a reference helper).
"""

from .common import compute
from .lazy import torch
import math

from .opdef import (
    DEVICE, DTYPE, SM_MARGIN, Arg, OpDef, Param, check_eps, check_norm_shape, dims_of, float_tag, register)


def _gamma(weight, zero_centered_gamma):
    g = compute(weight)
    return g + 1 if zero_centered_gamma else g


def layer_norm(x, weight, b, eps, zero_centered_gamma):
    """LayerNorm over the last dim of 2-D x: (y, mean, rstd), statistics in the math precision (compute)."""
    xf = compute(x)
    mean = xf.mean(-1)
    rstd = torch.rsqrt(((xf - mean[:, None]) ** 2).mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * _gamma(weight, zero_centered_gamma) + compute(b)
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma):
    """(dx, dweight, dbias) of layer_norm, dx in the math precision (compute)."""
    xhat = (compute(x) - mean[:, None]) * rstd[:, None]
    dyf = compute(dy)
    g = dyf * _gamma(weight, zero_centered_gamma)
    dx = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dyf * xhat).sum(0), dyf.sum(0)


def rms_norm(x, weight, eps, zero_centered_gamma):
    """RMSNorm over the last dim of 2-D x: (y, rstd), rstd = rsqrt(mean(x^2) + eps)."""
    xf = compute(x)
    rstd = torch.rsqrt((xf * xf).mean(-1) + eps)
    y = xf * rstd[:, None] * _gamma(weight, zero_centered_gamma)
    return y.to(x.dtype), rstd


def rms_norm_bwd(dy, x, rstd, weight, zero_centered_gamma):
    """(dx, dweight) of rms_norm, dx in the math precision (compute)."""
    xhat = compute(x) * rstd[:, None]
    dyf = compute(dy)
    g = dyf * _gamma(weight, zero_centered_gamma)
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dyf * xhat).sum(0)


def _norm_tag(base: str, defaults_eps: float):
    def tag(a: dict) -> str:
        t = base
        if a.get("zero_centered_gamma"):
            t += "_zc"
        if a["eps"] != defaults_eps:
            t += "_eps" + float_tag(a["eps"])
        return t

    return tag


_EPS = Arg("eps", "float", 1e-5, keyword_only=True, check=check_eps)
_ZCG = Arg("zero_centered_gamma", "bool", False, keyword_only=True)
_GAMMA_INIT = lambda a: "zeros" if a["zero_centered_gamma"] else "ones"  # noqa: E731


def _row_width(a) -> int:
    """The features a norm normalises together: the product of normalized_shape."""
    return math.prod(dims_of(a["normalized_shape"]))


def _row_shape(a):
    """normalized_shape where it spans several trailing dims (the graph flattens them), else None."""
    shape = a["normalized_shape"]
    return shape if isinstance(shape, tuple) else None


_PARAM_SHAPE = lambda a: dims_of(a["normalized_shape"])  # noqa: E731  TE's: normalized_shape


def _norm_reference_args(a):
    """The reference forward's trailing arguments: (eps, zero_centered_gamma)."""
    return a["eps"], a["zero_centered_gamma"]


register(OpDef(
    "LayerNorm", "norm",
    args=(Arg("normalized_shape", "shape", check=check_norm_shape), _EPS, DEVICE, DTYPE, _ZCG, SM_MARGIN),
    params=(Param("weight", _PARAM_SHAPE, _GAMMA_INIT),
            Param("bias", _PARAM_SHAPE, lambda a: "zeros")),
    fixed_in=_row_width, row_shape=_row_shape,
    tag=_norm_tag("layernorm", 1e-5),
    reference=(layer_norm, layer_norm_bwd), reference_helpers=(_gamma,), reference_args=_norm_reference_args,
    summary="y = (x - mean) * rstd * gamma + beta",
    needs_input_in_backward=True,
))
register(OpDef(
    "RMSNorm", "norm",
    args=(Arg("normalized_shape", "shape", check=check_norm_shape), _EPS, DEVICE, DTYPE, _ZCG, SM_MARGIN),
    params=(Param("weight", _PARAM_SHAPE, _GAMMA_INIT),),
    fixed_in=_row_width, row_shape=_row_shape,
    tag=_norm_tag("rmsnorm", 1e-5),
    reference=(rms_norm, rms_norm_bwd), reference_helpers=(_gamma,), reference_args=_norm_reference_args,
    summary="y = x * rsqrt(mean(x^2) + eps) * gamma",
    needs_input_in_backward=True,
))


def l2_normalization(x, eps):
    """x / sqrt(sum(x^2) + eps) over the last dim (eps inside the root, no mean), as TE's."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2_normalization_bwd(x, dy, eps):
    """(dx,): r * (dy - x * sum(x * dy) / (sum(x^2) + eps)), r = rsqrt(sum(x^2) + eps)."""
    s = (x * x).sum(-1, keepdim=True) + eps
    return (torch.rsqrt(s) * (dy - x * (x * dy).sum(-1, keepdim=True) / s),)


def l2_norm_rows(x, eps):
    """L2Normalization over the last dim of 2-D x in the norm kernels' form: (y, rstd), rstd =
    rsqrt(sum(x^2) + eps)."""
    xf = compute(x)
    rstd = torch.rsqrt((xf * xf).sum(-1) + eps)
    return (xf * rstd[:, None]).to(x.dtype), rstd


def l2_norm_rows_bwd(dy, x, rstd):
    """dx of l2_norm_rows from its saved rstd, in the math precision: rstd (dy - xhat sum(dy xhat))."""
    xhat = compute(x) * rstd[:, None]
    dyf = compute(dy)
    return rstd[:, None] * (dyf - xhat * (dyf * xhat).sum(-1, keepdim=True))


register(OpDef(
    # TE runs it as torch.compile'd PyTorch, not a kernel. At a fixed width it runs in the norm
    # kernels (fusion_rules/l2_normalization.py, with l2_norm_rows* in their form); in a
    # size-generic pipeline it is an opaque op, its reference math in PyTorch (stages/opaque.py).
    # seq_length and micro_batch_size only warm up TE's JIT.
    "L2Normalization", "l2_normalization",
    args=(Arg("eps", "float", 1e-6, keyword_only=True, check=check_eps),
          Arg("seq_length", "int", None, keyword_only=True, in_kernel=False),
          Arg("micro_batch_size", "int", None, keyword_only=True, in_kernel=False)),
    reference=(l2_normalization, l2_normalization_bwd), reference_args=lambda a: (a["eps"],),
    reference_helpers=(l2_norm_rows, l2_norm_rows_bwd), tag=_norm_tag("l2norm", 1e-6),
    opaque=True, needs_input_in_backward=True,
    summary="y = x / sqrt(sum(x^2) + eps) over the features (runs as its reference math, as in TE)",
))
