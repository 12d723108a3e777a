"""FP8 GEMMs for a generated module built for FP8 (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).

``fp8_call`` gives a module called inside ``autocast`` its ``Fp8Call``, which the generated FP8
stages call: each GEMM's operands cast to FP8 with the recipe's scales (delayed: the state's,
recording the amaxes; current: each tensor's own; row-wise: each row's), the GEMM through
``torch._scaled_mm`` (on CPU, or without FP8 hardware, the same FP8 values multiplied in fp32:
the recipe emulated, so CPU tests check it), the FP8 weight kept until the parameter changes.
"""

import torch

from .fp8_recipes import _EPS_ROWWISE, FLT_MAX, active, fp8_dtype, fp8_max, recipe_kind, update_states

def cast(x, scale, dtype):
    """``x * scale`` in fp32, converted to ``dtype`` saturating (TE's cast: __NV_SATFINITE; torch's
    own conversion does not saturate, 1000 -> NaN in E4M3)."""
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp_(-limit, limit).to(dtype)


def current_scale(amax, max_value, epsilon=0.0, power_2=False):
    """TE's compute_scale_from_amax (common/recipe/recipe_common.cuh): ``max / max(amax, epsilon)``;
    1 where the amax is 0, inf or NaN; FLT_MAX where the division overflows; with ``power_2``, the
    mantissa dropped (the scale floored to a power of 2)."""
    amax = amax.to(torch.float32)
    if epsilon > 0:
        amax = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    scale = torch.tensor(max_value, dtype=torch.float32, device=amax.device) / amax
    bad = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    if power_2:
        scale = (scale.view(torch.int32) & -8388608).view(torch.float32)  # & 0xFF800000
    return scale


def rowwise_scale(amax, max_value):
    """torchao's row-wise scale: ``max / max(amax, 1e-12)`` in fp64, rounded down to a power of 2."""
    scale = (max_value / torch.clamp(amax.to(torch.float64), min=_EPS_ROWWISE)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale)))


class _Quantized:
    """An FP8 tensor: ``data`` [rows, k], one per element, and ``scale_inv``, a 0-dim tensor or one
    per row [rows, 1]; its value is ``data * scale_inv``."""

    __slots__ = ("data", "scale_inv")

    def __init__(self, data, scale_inv):
        self.data, self.scale_inv = data, scale_inv


class _QuantizedWeight:
    """A weight [N, K] cast for the forward (``rows``: row-major [N, K]) and for the dgrad
    (``columns``: its transpose [K, N]), in ``dtype`` before the cast, as of ``key`` (the
    parameter's address and _version counter, and the recipe): TE's weight cache, reused until
    the parameter changes."""

    __slots__ = ("rows", "columns", "dtype", "key")

    def __init__(self, rows, columns, dtype, key):
        self.rows, self.columns, self.dtype, self.key = rows, columns, dtype, key


def scaled_mm(a, b, out_dtype, bias=None, fast_accum=False):
    """``(a.data * a.scale_inv) (b.data * b.scale_inv)^T``: a [M, K], b [N, K] (row-major FP8), plus
    ``bias``, in ``out_dtype``. ``torch._scaled_mm`` on GPUs with FP8 (compute capability 8.9 on)
    where K and N are multiples of 16; elsewhere the same FP8 values multiplied in fp32."""
    n, k = b.data.shape
    scale_b = b.scale_inv if b.scale_inv.dim() == 0 else b.scale_inv.reshape(1, n)
    if a.data.is_cuda and k % 16 == 0 and n % 16 == 0 and _fp8_gemms(a.data.device):
        # _scaled_mm takes a bias in a 16-bit output's dtype only
        fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
        out = torch._scaled_mm(a.data, b.data.t(), a.scale_inv, scale_b, bias=bias if fused_bias else None,
                               out_dtype=out_dtype, use_fast_accum=fast_accum)
        return out if bias is None or fused_bias else out.add_(bias)
    out = (a.data.to(torch.float32) @ b.data.to(torch.float32).t()) * (a.scale_inv * scale_b)
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


def _padded_mm(a, b, out_dtype):
    """scaled_mm over the step's rows (the weight grad's reduction dim), zero-padded to a multiple
    of 16 on the GPU where it is not (zeros add nothing), as _scaled_mm needs."""
    m = a.data.shape[1]
    if m % 16 and a.data.is_cuda:
        pad = 16 - m % 16
        a = _Quantized(torch.cat([a.data, a.data.new_zeros(a.data.shape[0], pad)], 1), a.scale_inv)
        b = _Quantized(torch.cat([b.data, b.data.new_zeros(b.data.shape[0], pad)], 1), b.scale_inv)
    return scaled_mm(a, b, out_dtype)


def _epilogue(y, alpha, bias, add, activation, bias_added):
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


def add_into_main_grad(weight, dw):
    """TE's accumulate_into_main_grad for an FP8 weight grad ``dw`` (fp32): added into
    ``weight.main_grad``; returns what autograd gets as the weight's grad, as the shipped
    reference's accumulate_into_main_grad does (Megatron's grad_added_to_main_grad protocol)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None or tuple(main_grad.shape) != tuple(weight.shape):
        raise RuntimeError(
            "a Linear with accumulate_into_main_grad=True adds its weight gradient into weight.main_grad: set "
            "weight.main_grad to a tensor of the weight's shape (usually float32, zeroed per step) before backward")
    main_grad.add_(dw.to(main_grad.dtype))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    placeholder = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return placeholder(weight.shape, dtype=weight.dtype, device=weight.device)


# --- what generated FP8 stages call -----------------------------------------------------------------

class Fp8Call:
    """One module call under ``autocast``: its recipe, and each GEMM's state and index in it, in
    the plan's order. The generated FP8 stages call ``linear`` in the forward, ``grad_output``,
    ``dgrad`` and ``weight_grad`` in the backward, and the Function ``backward_done`` last."""

    def __init__(self, frame, gemms, device, training):
        self.recipe, self.calibrating = frame.recipe, not frame.enabled
        self.kind = recipe_kind(self.recipe)
        self.gemms, self.step, self.first = gemms, frame.step, False
        if self.kind == "delayed":
            for state in dict.fromkeys(state for state, _ in gemms):
                state.prepare(self.recipe, device)
                if training:
                    self.step.forward.setdefault(id(state), (state, "forward", self.recipe, frame.group))
                    self.step.backward.setdefault(id(state), (state, "backward", self.recipe, frame.group))
        if training and not self.step.first_taken:  # TE's is_first_fp8_module: it updates the backward slots
            self.step.first_taken = self.first = True

    def _record(self, x, gemm, mode, which):
        """Delayed scaling: x's amax into its slot of the history's first row (max with what the
        step recorded there already)."""
        state, index = self.gemms[gemm]
        history = state.modes[mode][1]
        slot = state.slot(mode, index, which)
        history[0, slot] = torch.maximum(history[0, slot], x.abs().amax().to(torch.float32))

    def _tensorwise(self, x, gemm, mode, which):
        """x cast with one scale, the state's (delayed: x's amax recorded) or x's own (current).
        Returns the FP8 tensor and the scale (a tensor of its own: the backward casts with it)."""
        forward = mode == "forward"
        if self.kind == "delayed":
            state, index = self.gemms[gemm]
            scale = state.modes[mode][0][state.slot(mode, index, which)].clone()
            self._record(x, gemm, mode, which)
        else:
            scale = current_scale(x.abs().amax(), fp8_max(self.recipe, forward), self.recipe.amax_epsilon,
                                  self.recipe.use_power_2_scales)
        return _Quantized(cast(x, scale, fp8_dtype(self.recipe, forward)), torch.reciprocal(scale)), scale

    def _rowwise(self, x, forward):
        """x [rows, k] cast with a scale per row (the row-wise recipe)."""
        scale = rowwise_scale(x.abs().amax(dim=1, keepdim=True), fp8_max(self.recipe, forward))
        return _Quantized(cast(x, scale, fp8_dtype(self.recipe, forward)), torch.reciprocal(scale))

    def _weight(self, gemm, weight):
        """The GEMM's FP8 weight, cast again only when the parameter changed (TE's weight cache:
        a weight changed through ``.data`` is not seen; ``forget_fp8_weights`` drops the cache)."""
        state, index = self.gemms[gemm]
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self.kind)
        cached = state.weights[index]
        if cached is not None and cached.key == key:
            return cached
        w = weight.detach()
        if self.kind == "rowwise":
            rows, columns = self._rowwise(w, True), self._rowwise(w.t().contiguous(), True)
        else:
            rows, _ = self._tensorwise(w, gemm, "forward", 1)
            columns = _Quantized(rows.data.t().contiguous(), rows.scale_inv)
        state.weights[index] = cached = _QuantizedWeight(rows, columns, weight.dtype, key)
        return cached

    def linear(self, gemm, x, weight, bias=None, alpha=1.0, add=None, activation=None):
        """The forward GEMM number ``gemm``: ``activation(alpha (x W^T + bias) + add)`` with x and W
        cast to FP8. Returns y, x's scale (the weight grad casts x with it again: the forward's
        FP8 values; None row-wise) and the FP8 weight (the dgrad's)."""
        if self.calibrating:  # high precision, the amaxes recorded
            if self.kind == "delayed":
                self._record(x, gemm, "forward", 0)
                self._record(weight, gemm, "forward", 1)
            y = x.mm(weight.t())
            return _epilogue(y, alpha, bias, add, activation, False), None, weight
        w = self._weight(gemm, weight)
        if self.kind == "rowwise":
            xq, x_scale = self._rowwise(x, True), None
        else:
            xq, x_scale = self._tensorwise(x, gemm, "forward", 0)
        fused_bias = bias if alpha == 1.0 else None
        y = scaled_mm(xq, w.rows, x.dtype, fused_bias, fast_accum=True)  # TE: fprop with fast accumulation
        return _epilogue(y, alpha, bias, add, activation, fused_bias is not None), x_scale, w

    def grad_output(self, gemm, dy):
        """dy cast for the GEMM's dgrad and weight grad (E5M2 under HYBRID): tensorwise one cast,
        its transpose the weight grad's; row-wise per row of dy and per column."""
        if self.calibrating:
            if self.kind == "delayed":
                self._record(dy, gemm, "backward", 0)
            return dy, dy
        if self.kind == "rowwise":
            return self._rowwise(dy, False), self._rowwise(dy.t().contiguous(), False)
        rows, _ = self._tensorwise(dy, gemm, "backward", 0)
        return rows, _Quantized(rows.data.t().contiguous(), rows.scale_inv)

    def dgrad(self, dy, weight, alpha=1.0, add=None):
        """dx = alpha dy W (+ add): ``dy`` from grad_output, ``weight`` the forward's FP8 weight."""
        rows, _ = dy
        if self.calibrating:
            dx = rows.mm(weight)
        else:
            dx = scaled_mm(rows, weight.columns, weight.dtype)  # TE: dgrad without fast accumulation
        if alpha != 1.0:
            dx.mul_(alpha)
        return dx if add is None else dx.add_(add)

    def weight_grad(self, weight, dy, x, x_scale, alpha=1.0, main_grad=False):
        """dW = alpha dy^T x: ``dy`` from grad_output, x cast as the forward cast it (its scale
        ``x_scale``; row-wise, per column); added into ``weight.main_grad`` where ``main_grad``
        (TE's accumulate_into_main_grad)."""
        _, columns = dy
        out_dtype = torch.float32 if main_grad else weight.dtype
        if self.calibrating:
            dw = columns.t().mm(x).to(out_dtype)
        else:
            if self.kind == "rowwise":
                xt = self._rowwise(x.t().contiguous(), True)
            else:
                xt = _Quantized(cast(x.t().contiguous(), x_scale, fp8_dtype(self.recipe, True)),
                                torch.reciprocal(x_scale))
            dw = _padded_mm(columns, xt, out_dtype)
        if alpha != 1.0:
            dw.mul_(alpha)
        return add_into_main_grad(weight, dw) if main_grad else dw

    def backward_done(self):
        """After the module's backward: the backward slots' update, where this was the first FP8
        module called in its autocast (TE updates them after the last backward to run)."""
        if self.first and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            update_states(self.step.backward.values())


def fp8_call(module, x, *gemms):
    """The Fp8Call of a call of ``module`` (on ``x``) inside an autocast that quantizes or
    calibrates, else None (the module runs in high precision). ``gemms``: (Fp8State, the GEMM's
    index in it) per GEMM, in the plan's order."""
    if torch.compiler.is_compiling():  # (the FP8 stages are no compiled op yet: high precision there)
        return None
    frame = active()
    if frame is None:
        return None
    kind = recipe_kind(frame.recipe)
    if kind not in module.fp8_recipes:
        raise RuntimeError(
            f"{type(module).__name__} was generated for the FP8 recipes {list(module.fp8_recipes)}, not "
            f"{type(frame.recipe).__name__}: add \"{kind}\" to fp8 in [tool.fusegen] (or its pipeline's table) "
            "and generate again")
    return Fp8Call(frame, gemms, x.device, torch.is_grad_enabled())
