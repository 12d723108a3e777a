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


def reshaped_lead(module, op, shape, numel, last=None, multiple_of=1):
    """The leading dims of ``numel`` elements reshaped to ``shape`` (TE's Reshape, torch.reshape's
    rules: one -1 inferred), or a clear error naming the module and the op. A -1 last dim must
    come out as ``last`` where the ops after it fix it, else a multiple of ``multiple_of`` (their
    GLUs split each row)."""
    known = math.prod([d for d in shape if d != -1])  # lists, not generators: torch.compile traces this
    given = list(shape)
    if -1 in shape and numel % known == 0:
        shape = tuple([numel // known if d == -1 else d for d in shape])
    if math.prod(shape) != numel or -1 in shape:
        raise ValueError(f"{module}: {op} cannot reshape the {numel} elements it receives to "
                         f"{given}; give an input whose size fits the shape")
    made = f"{module}: {op} reshapes the {numel} elements it receives to {list(shape)}, but"
    if last is not None and shape[-1] != last:
        raise ValueError(f"{made} the ops after it take {last} features; give an input of "
                         f"{known * last} elements")
    if shape[-1] % multiple_of:
        raise ValueError(f"{made} the ops after it split each row into halves (GLUs), so its last "
                         f"dim must be a multiple of {multiple_of}; give an input whose size fits")
    return torch.Size(shape[:-1])


def flattened_lead(module, op, lead, dims):
    """The leading dims once the last len(dims) dims are one (a norm's multi-dim normalized_shape),
    or a clear error naming the module and the op where the input's dims before the last are not
    dims[:-1]."""
    k = len(dims) - 1
    if len(lead) < k or tuple(lead[len(lead) - k:]) != tuple(dims[:-1]):
        raise ValueError(f"{module}: {op} normalises the last {len(dims)} dims, so its input's "
                         f"shape must end in {list(dims)}, got {[*lead, dims[-1]]}; give an input "
                         f"of shape [..., {', '.join(map(str, dims))}]")
    return torch.Size(lead[:len(lead) - k])


def unflattened_lead(lead, dims):
    """The leading dims once a row flattened by ``flattened_lead`` has its dims back."""
    return torch.Size((*lead, *dims[:-1]))


def deinterleave(x, k):
    """Rows of alternating blocks [a(k), b(k), a(k), b(k), ...] (TE's glu_interleave_size) as [a | b]."""
    rows, width = x.shape
    return x.reshape(rows, width // (2 * k), 2, k).transpose(1, 2).reshape(rows, width)


def interleave(x, k):
    """The inverse of ``deinterleave``: [a | b] as alternating blocks of k."""
    rows, width = x.shape
    return x.reshape(rows, 2, width // (2 * k), k).transpose(1, 2).reshape(rows, width)


def autocasting(x):
    """Whether torch.autocast is on for tensor ``x``'s device (meta tensors have no autocast; a
    non-tensor is left to the input checks to report)."""
    return isinstance(x, torch.Tensor) and not x.is_meta and torch.is_autocast_enabled(x.device.type)


def to_autocast_dtype(device_type, *tensors):
    """The module's inputs and parameters in torch.autocast's dtype for ``device_type``, as TE
    computes under autocast (floating tensors only; anything else is passed on for the input
    checks to report). The casts are differentiable: the grads reach the parameters in their
    own dtype."""
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def construct_module(owner, target, where, positional, keywords, device, dtype):
    """A module of the user's code (ops/module.py), built with its spec arguments, then placed."""
    import importlib

    module_name, _, attribute = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"{owner}: cannot import {target} for {where}: {err}; make it importable "
                          "where the generated package runs") from None
    module = cls(*positional, **dict(keywords))
    if device is not None or dtype is not None:
        module.to(device=device, dtype=dtype)
    return module


def check_module_output(owner, where, x, y):
    """A user module between fused ops must keep the tensor's shape (the fused stages after it were
    planned for it)."""
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"{owner}: {where} returned {got} for an input of shape {list(x.shape)}; "
                         "fusegen runs a module between fused ops only when it keeps the tensor's "
                         "shape")


def run_module(owner, where, module, x, lead):
    """A user module's stage (stages/module.py): the module on the 2-D running tensor ``x`` with
    its leading dims ``lead``, its output checked and made 2-D again."""
    x_in = x.reshape(*lead, x.shape[1])
    y = module(x_in)
    check_module_output(owner, where, x_in, y)
    return y.reshape(x.shape)


# --- random operands (Operand "random", Dropout): counter-based draws, as fg::uniform ------------

def _mul32(h, c):
    """(h * c) mod 2**32 for h < 2**32 and a constant c < 2**32, in int64 without overflow."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(h):
    """MurmurHash3's 32-bit finaliser, as fg::mix32."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(key, index):
    """The draws of elements ``index`` (an int64 tensor) under ``key`` (a 1-element int64 tensor),
    uniform in [0, 1) with 24 bits, as fg::uniform computes them."""
    key = key.reshape(()).to(index.device)
    h = _mix32((index & 0xFFFFFFFF) ^ (key & 0xFFFFFFFF))
    h = _mix32(h ^ ((index >> 32) & 0xFFFFFFFF) ^ ((key >> 32) & 0xFFFFFFFF))
    return (h >> 8).double() * 2.0**-24


def draws(key, like):
    """One draw per element of ``like`` (element i: its flat index in ``like``), in float64; all 1
    (keep, unscaled) when ``key`` is None, in eval mode."""
    if key is None:
        return torch.ones(like.shape, dtype=torch.float64, device=like.device)
    index = torch.arange(like.numel(), dtype=torch.int64, device=like.device).reshape(like.shape)
    return uniform(key, index)


def new_seed(like):
    """A fresh 64-bit key from PyTorch's generator on ``like``'s device."""
    return torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64, device=like.device)


# In this order at the top of _reference.py, after its imports.
COMMON = (compute, init_parameter, reshaped_lead, flattened_lead, unflattened_lead, deinterleave, interleave, autocasting, to_autocast_dtype, construct_module, check_module_output, run_module, _mul32, _mix32, uniform, draws, new_seed)
