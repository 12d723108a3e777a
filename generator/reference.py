"""Reference math for every op in the catalog, in plain PyTorch.

This file is the catalog's executable semantics (te_ops_catalog.md, sections 2.x). It imports only
torch: the generator copies it verbatim into the output package as ``_reference.py``, where the
generated modules run it on CPU tensors, and fusegen's eager ``Sequential`` builds on it.
Math runs in float32 (or float64 for float64 inputs); callers round to the storage dtype.
"""

import math

import torch

GELU_K0 = 0.79788456  # sqrt(2 / pi)
GELU_K1 = 0.03567741  # sqrt(2 / pi) * 0.044715


def compute(t: torch.Tensor) -> torch.Tensor:
    """The tensor in its math precision: float32 for 16-bit floats, else unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


# --- parameters ---------------------------------------------------------------------------------

def init_parameter(p: torch.Tensor, init: str) -> None:
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


# --- linear -------------------------------------------------------------------------------------

def linear(x, weight):
    return x @ weight.t()


def linear_bwd(dy, x, weight):
    """(dx, dweight) of y = x W^T for 2-D x, dy."""
    return dy @ weight, dy.t() @ x


# --- elementwise --------------------------------------------------------------------------------

def bias(x, b):
    return x + b


def bias_bwd(dy):
    """Bias gradient: the column sum of dy over all rows (dx is dy itself)."""
    return dy.reshape(-1, dy.shape[-1]).sum(0)


def constant_scale(x, scale):
    return x * scale


def constant_scale_bwd(x, dy, scale):
    return dy * scale


def add_extra_input(x, r):
    return x + r


def make_extra_output(x):
    return x


def gelu(x):
    return x * (0.5 + 0.5 * torch.tanh(x * (GELU_K0 + GELU_K1 * x * x)))


def gelu_bwd(x, dy):
    t = torch.tanh(GELU_K0 * x * (1 + 0.044715 * x * x))
    return dy * (0.5 * x * (1 - t * t) * (GELU_K0 + 0.1070322243 * x * x) + 0.5 * (1 + t))


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


def _glu(act):
    def fwd(x):
        a, b = x.chunk(2, dim=-1)  # the FIRST half is the gate (unlike torch.nn.functional.glu)
        return act(a) * b

    return fwd


def _glu_bwd(act, act_bwd):
    def bwd(x, dy):
        a, b = x.chunk(2, dim=-1)
        return torch.cat([act_bwd(a, dy * b), dy * act(a)], dim=-1)

    return bwd


swiglu = _glu(silu)
swiglu_bwd = _glu_bwd(silu, silu_bwd)
geglu = _glu(gelu)
geglu_bwd = _glu_bwd(gelu, gelu_bwd)


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


# --- normalization ------------------------------------------------------------------------------

def _gamma(weight, zero_centered_gamma):
    g = compute(weight)
    return g + 1 if zero_centered_gamma else g


def layer_norm(x, weight, b, eps, zero_centered_gamma):
    """LayerNorm over the last dim of 2-D x: (y, mean, rstd), statistics in float32."""
    xf = compute(x)
    mean = xf.mean(-1)
    rstd = torch.rsqrt(((xf - mean[:, None]) ** 2).mean(-1) + eps)
    y = (xf - mean[:, None]) * rstd[:, None] * _gamma(weight, zero_centered_gamma) + compute(b)
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd(dy, x, mean, rstd, weight, zero_centered_gamma):
    """(dx, dweight, dbias) of layer_norm, dx in float32 math."""
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
    """(dx, dweight) of rms_norm, dx in float32 math."""
    xhat = compute(x) * rstd[:, None]
    dyf = compute(dy)
    g = dyf * _gamma(weight, zero_centered_gamma)
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, (dyf * xhat).sum(0)
