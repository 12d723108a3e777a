"""FP8 casts and GEMMs as TE makes them (part of a fusegen output's runtime: templates/runtime/,
copied verbatim; do not edit): the cast (saturating), TE's current scale, torchao's row-wise one,
the quantize kernels' CPU path (fp8_reference_amax, fp8_reference_cast), an FP8 tensor and a cached
FP8 weight, and ``scaled_mm``: torch._scaled_mm on GPUs with FP8, elsewhere the same FP8 values
multiplied in fp32 (the recipe emulated, so CPU tests check it).
"""

import struct

import torch

from .fp8_recipes import _EPS_ROWWISE, FLT_MAX


def cast(x, scale, dtype):
    """``x * scale`` in fp32, converted to ``dtype`` saturating (TE's cast: __NV_SATFINITE; torch's
    own conversion does not saturate, 1000 -> NaN in E4M3)."""
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp_(-limit, limit).to(dtype)


def current_scale(amax, max_value, epsilon=0.0, power_2=False, overflow=FLT_MAX):
    """TE's compute_scale_from_amax (common/recipe/recipe_common.cuh): ``max / max(amax, epsilon)``;
    1 where the amax is 0, inf or NaN; ``overflow`` where the division overflows (FLT_MAX; block
    scaling: x's dtype's largest); with ``power_2``, the mantissa dropped (the scale floored to a
    power of 2)."""
    amax = amax.to(torch.float32)
    if epsilon > 0:
        amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.full_like(amax, max_value) / amax  # (no host-to-device copy)
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, overflow), scale)
    if power_2:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # & 0xFF800000
    return scale


def rowwise_scale(amax, max_value, power_2=True):
    """torchao's row-wise scale: ``max / max(amax, 1e-12)`` in fp64, rounded to fp32, with
    ``power_2`` floored to a power of 2 by dropping its mantissa (TE's mask; torchao's
    exp2(floor(log2)) agrees but where log2 rounds up just below a power of 2)."""
    scale = (max_value / torch.clamp(amax.to(torch.float64), min=_EPS_ROWWISE)).to(torch.float32)
    return (scale.view(torch.int32) & -8388608).view(torch.float32) if power_2 else scale


def padded_transpose(y):
    """An FP8 tensor's transpose [cols, rows rounded up to 16], zeros past the rows, as the quantize
    kernels write it (a GEMM over the rows reads the padding)."""
    rows, cols = y.shape
    y_t = torch.zeros((cols, -(-rows // 16) * 16), dtype=torch.uint8, device=y.device).view(y.dtype)
    y_t[:, :rows] = y.t()
    return y_t


def fp8_reference_cast_rows(x, power_2, dtype):
    """The quantize family's fp8_cast_rows_* off the GPU: x cast with a scale per row; the inverse
    scales [rows, 1]."""
    x = x.detach()
    scale = rowwise_scale(fp8_reference_amax_rows(x), torch.finfo(dtype).max, bool(power_2))
    return cast(x, scale, dtype), torch.reciprocal(scale)


def fp8_reference_amax_rows(x):
    """max |x| per row, [rows, 1] fp32 (a NaN wins)."""
    if x.shape[1] == 0:
        return torch.zeros((x.shape[0], 1), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax(dim=1, keepdim=True).to(torch.float32)


def fp8_reference_amax_cols(x):
    """The quantize family's fp8_amax_cols off the GPU: max |x| per column, [cols] fp32."""
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
    return x.detach().abs().amax(dim=0).to(torch.float32)


def fp8_reference_cast_cols(x, amax, power_2, dtype):
    """The quantize family's fp8_cast_cols_* off the GPU: x cast with a scale per column from its
    amax, transposed and zero-padded to a multiple of 16 rows; the inverse scales [cols, 1]."""
    x = x.detach()
    scale = rowwise_scale(amax.reshape(1, -1), torch.finfo(dtype).max, bool(power_2))
    return padded_transpose(cast(x, scale, dtype)), torch.reciprocal(scale).reshape(-1, 1)


def fp8_reference_amax(x):
    """max |x| as a 0-dim fp32 tensor (a NaN wins): the quantize family's fp8_amax off the GPU."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def fp8_reference_cast(x, scale, amax, eps_bits, power_2, transpose, amax_out, dtype):
    """The quantize family's fp8_cast_* off the GPU (CPU, meta): the same results (templates/
    quantize/quantize.py.j2 documents them) from torch's ops."""
    x = x.detach()
    if amax is not None:
        epsilon = struct.unpack("<f", struct.pack("<i", eps_bits))[0]
        scale = current_scale(amax, torch.finfo(dtype).max, epsilon, bool(power_2))
    y = cast(x, scale, dtype)
    y_t = padded_transpose(y) if transpose else y.new_empty(0)
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, fp8_reference_amax(x)))
    return y, y_t, torch.reciprocal(torch.as_tensor(scale, dtype=torch.float32, device=x.device))


def fp8_reference_produced(y, scale, amax, amax_out, e5m2, eps_bits, power_2, transpose, stores):
    """A producer kernel's FP8 variant off the GPU (templates/cuda/fp8_tile.cuh): its output ``y``,
    computed as the plain kernel's reference computes it, cast as fp8_cast would (``stores``), or
    only its amax max-ed into ``amax_out`` (current scaling's first launch)."""
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    if stores:
        return fp8_reference_cast(y, scale, amax, eps_bits, power_2, transpose, amax_out, dtype)
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, fp8_reference_amax(y)))
    empty = torch.empty(0, dtype=dtype, device=y.device)
    return empty, empty, torch.ones((), dtype=torch.float32, device=y.device)


def fp8_reference_delayed_update(history, scale, amax, most_recent, scaled_max_bits):
    """The quantize family's fp8_delayed_update off the GPU, in place (quantize.cuh:
    delayed_update_slot, TE's fused kernel): the step's amax is ``amax`` where given and not 0,
    else the history's first row; where it is not 0 the history rolls up a row, its first zeroed
    and the amax last; the amax to scale from is the max of the old window but its first row and
    the step's (a NaN drops out, as fmaxf drops it) or, ``most_recent``, the step's; the scale
    max / amax where that is finite and positive, else kept, FLT_MAX where it overflows."""
    last = history[0].clone()
    if amax is not None:
        last = torch.where(amax != 0, amax.to(torch.float32), last)
    rolled = last != 0
    zero = torch.zeros_like(last)
    window = torch.cat([history[1:], last[None]]).nan_to_num(nan=0.0, posinf=float("inf")).amax(0)
    new_history = torch.cat([zero[None], history[2:], last[None]]) if history.shape[
        0] > 1 else zero[None]
    chosen = last if most_recent else torch.where(rolled, window, zero)
    history.copy_(torch.where(rolled, new_history, history))
    scaled_max = torch.tensor(scaled_max_bits, dtype=torch.int32).view(torch.float32).item()
    new = torch.where(
        torch.isfinite(chosen) & (chosen > 0), torch.full_like(chosen, scaled_max) / chosen, scale)
    scale.copy_(torch.where(torch.isinf(new), torch.full_like(new, FLT_MAX), new))
    return history, scale


def fp8_reference_cast_blocks(x, square, eps_bits, power_2, rows_out, columns_out, dtype):
    """The quantize family's fp8_cast_blocks_* off the GPU (quantize_blocks.cuh): x [rows, cols]
    cast
    with TE's scale per block, 1x128 or (``square``) 128x128, the overflowing scale x's dtype's
    largest; with ``rows_out`` the row-wise copy y and its inverse scales s (1D: [cols / 128, rows];
    2D: [row blocks, cols / 128]), with ``columns_out`` the transposed copy y_t [cols, rows rounded
    up to 128] (zeros past the rows; 1D: blocks of 128 rows of a column) and s_t (1D: [row blocks,
    cols]; 2D: s transposed). What is not asked for is an empty tensor."""
    x = x.detach()
    rows, cols = x.shape
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 128)
    epsilon = struct.unpack("<f", struct.pack("<i", eps_bits))[0]
    limit, overflow = torch.finfo(dtype).max, torch.finfo(x.dtype).max
    padded = torch.zeros((row_blocks * 128, col_blocks * 128), dtype=torch.float32, device=x.device)
    padded[:rows, :cols] = x
    blocks = padded.reshape(row_blocks, 128, col_blocks, 128)  # [row block, row, col block, col]

    def scales(amax):
        return current_scale(amax, limit, epsilon, bool(power_2), overflow)

    if square:
        row_scale = col_scale = scales(blocks.abs().amax(dim=(1, 3)))[:, None, :, None]
        s, s_t = row_scale[:, 0, :, 0], row_scale[:, 0, :, 0].t()
    else:
        row_scale = scales(blocks.abs().amax(dim=3))[..., None]  # a row's 128 columns
        col_scale = scales(blocks.abs().amax(dim=1))[:, None]  # a column's 128 rows
        s = row_scale[..., 0].permute(2, 0, 1).reshape(col_blocks, -1)[:, :rows]
        s_t = col_scale[:, 0].reshape(row_blocks, -1)[:, :cols]
    y, y_t = torch.empty(0, dtype=dtype, device=x.device), torch.empty(
        0, dtype=dtype, device=x.device)
    if rows_out:
        y = cast(blocks, row_scale, dtype).reshape(padded.shape)[:rows, :cols].contiguous()
    if columns_out:
        y_t = cast(blocks, col_scale, dtype).reshape(padded.shape)[:, :cols].t().contiguous()
    empty = torch.empty(0, dtype=torch.float32, device=x.device)
    return (y, torch.reciprocal(s).contiguous() if rows_out else empty, y_t,
            torch.reciprocal(s_t).contiguous() if columns_out else empty)


def dequantized(q):
    """An FP8 tensor's value in fp32: ``data * scale_inv``, the scales spread over their blocks."""
    data = q.data.to(torch.float32)
    if q.block is None:
        return data * q.scale_inv
    rows, cols = data.shape
    if q.block == 2:  # [row blocks, col blocks]
        spread = q.scale_inv.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    else:  # [col blocks, rows]: a row's 128 columns share one
        spread = q.scale_inv.t().repeat_interleave(128, 1)[:, :cols]
    return data * spread


class _Quantized:
    """An FP8 tensor: ``data`` [rows, k], one per element, and ``scale_inv``: a 0-dim tensor, one
    per
    row [rows, 1], or (``block`` 1 or 2) one per 1x128 block [k / 128, rows] or per 128x128 block
    [rows / 128, k / 128], as torch._scaled_mm reads them; its value is ``dequantized``'s."""

    __slots__ = ("data", "scale_inv", "block")

    def __init__(self, data, scale_inv, block=None):
        self.data, self.scale_inv, self.block = data, scale_inv, block


class _QuantizedWeight:
    """A weight [N, K] cast for the forward (``rows``: row-major [N, K]) and for the dgrad
    (``columns``: its transpose [K, N]), in ``dtype`` before the cast, as of ``key`` (the
    parameter's address and _version counter, and the recipe): TE's weight cache, reused until
    the parameter changes."""

    __slots__ = ("rows", "columns", "dtype", "key")

    def __init__(self, rows, columns, dtype, key):
        self.rows, self.columns, self.dtype, self.key = rows, columns, dtype, key


def epilogue(y, alpha, bias, add, activation, bias_added):
    """What the high-precision GEMM stage's epilogue does after the product: alpha (x W^T + b),
    the extra input added (beta = 1), the ReLU or GELU (tanh) of the GEMM's forms."""
    if alpha != 1.0:
        y.mul_(alpha)
        if bias is not None:
            y.add_(bias, alpha=alpha)  # s (x W^T + b), as the high-precision stage
    elif bias is not None and not bias_added:
        y.add_(bias)
    if add is not None:
        y.add_(add)
    if activation == "relu":
        return torch.relu_(y)
    if activation == "gelu":
        return torch.nn.functional.gelu(y, approximate="tanh")
    return y


def scaled_mm(a, b, out_dtype, bias=None, fast_accum=False):
    """``dequantized(a) dequantized(b)^T``: a [M, K], b [N, K] (row-major FP8), plus ``bias``, in
    ``out_dtype``. ``torch._scaled_mm`` on GPUs with FP8 (compute capability 8.9 on) where K and N
    are multiples of 16; elsewhere the same FP8 values multiplied in fp32. Block scales as it takes
    them: a's 1x128 [M, K / 128] column-major, b's 1x128 [K / 128, N], b's 128x128 [K / 128,
    N / 128] (a transposed view); cuBLAS reads those with their leading dimension rounded up to 4
    (TE's CuBLASScaleMunger pads them) and torch passes none padded, so block-scaled GEMMs need M
    and, with 128x128 scales, K / 128 to be multiples of 4 (else emulated: correct, slower)."""
    n, k = b.data.shape
    if a.block is not None:
        scale_a, scale_b = a.scale_inv.t(), b.scale_inv if b.block == 1 else b.scale_inv.t()
        fits = k % 128 == 0 and a.data.shape[0] % 4 == 0 and (b.block == 1 or k // 128 % 4 == 0)
    else:
        (
            scale_a,
            scale_b
        ) = a.scale_inv, b.scale_inv if b.scale_inv.dim() == 0 else b.scale_inv.reshape(1, n)
        fits = k % 16 == 0
    if a.data.is_cuda and fits and n % 16 == 0 and _fp8_gemms(a.data.device):
        # _scaled_mm takes a bias in a 16-bit output's dtype only
        fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
        out = torch._scaled_mm(a.data, b.data.t(), scale_a, scale_b, bias=bias if fused_bias else None,
                               out_dtype=out_dtype, use_fast_accum=fast_accum)
        return out if bias is None or fused_bias else out.add_(bias)
    if a.block is not None:
        out = dequantized(a) @ dequantized(b).t()
    else:
        out = (a.data.to(torch.float32) @ b.data.to(torch.float32).t()) * (scale_a * scale_b)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


_FP8_DEVICES = {}


def _fp8_gemms(device):
    """Whether the GPU multiplies FP8 (compute capability 8.9 on), asked once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FP8_DEVICES:
        _FP8_DEVICES[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _FP8_DEVICES[index]
