"""FP8 GEMMs for a generated module built for FP8 (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).

A module called inside ``autocast`` (fp8_autocast's ``fp8_runs``) makes its call through
``fp8_eagerly`` (eager under torch.compile), which gets its ``Fp8Call`` from ``fp8_call``. The
generated FP8 stages call it: each GEMM's operands cast to FP8 with the recipe's scales (delayed:
the state's, recording the amaxes; current: each tensor's own; block: each 1x128 or 128x128
block's; row-wise: each row's) by the package's quantize kernels, the GEMM through
fp8_casts.scaled_mm, the FP8 weight kept until the parameter changes.
"""

import torch

from .fp8_casts import _Quantized, _QuantizedWeight, dequantized, epilogue, scaled_mm
from .fp8_autocast import active, update_states
from .fp8_recipes import ScaleOptions, fast_accumulation, fp8_dtype, recipe_kind


# --- what generated FP8 stages call -----------------------------------------------------------------

class Fp8Call:
    """One module call under ``autocast``: its recipe, each GEMM's state and index in it (in the
    plan's order) and the package's quantize launchers (``casts``: _kernels' fp8_amax and
    fp8_cast_e4m3 / _e5m2). The generated FP8 stages call ``linear`` in the forward,
    ``grad_output``, ``dgrad`` and ``weight_grad`` in the backward, ``produce`` where a kernel
    writes a GEMM's operand in FP8 itself, and the Function ``backward_done`` last."""

    def __init__(self, frame, gemms, casts, device, training, quantize=None):
        self.recipe, self.calibrating = frame.recipe, not frame.enabled
        self.kind = recipe_kind(self.recipe)
        self.gemms, self.casts, self.training, self.device = gemms, casts, training, device
        self.quantize = quantize or {}  # (GEMM, mode) -> the state of the spec's Quantize that casts there
        # a call captured into a user's CUDA graph: its replays are the steps (see _weight, backward_done)
        self.capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        self.amaxes, self.amaxes_taken = None, 0  # current scaling: the floats kernels keep amaxes in
        self.step, self.first = frame.step, False
        self.fast = fast_accumulation(self.recipe)  # each GEMM's (its MMParams, TE's)
        self.options = ScaleOptions(self.recipe)  # each cast role's epsilon and power-of-2 rule
        # TE's backward_override: the backward's GEMMs in high precision, on the forward's
        # high-precision operands ("high_precision") or its FP8 ones dequantized ("dequantized")
        self.override = getattr(self.recipe, "backward_override", None)
        if self.kind == "delayed":
            for state in dict.fromkeys([*(state for state, _ in gemms), *self.quantize.values()]):
                state.prepare(self.recipe, device)
                for mode in state.modes if training else ():  # (a Quantize's: the modes it casts in)
                    getattr(self.step, mode).setdefault(id(state), (state, mode, self.recipe, frame.group, casts))
        if training and not self.step.first_taken:  # TE's is_first_fp8_module: it updates the backward slots
            self.step.first_taken = self.first = True

    def _slot(self, gemm, mode, which):
        """The delayed-scaling state and slot of GEMM ``gemm``'s operand ``which`` (0: x forward, dy
        backward; 1: the weight) in ``mode``: a Quantize's own where the spec puts one there (TE's
        Linear then casts nothing itself: the Quantize's FP8 tensor is its operand; ``gemm`` "y" or
        "dx": a Quantize at the pipeline's end, round_trip's), else the GEMM's holder's."""
        quantize = self.quantize.get((gemm, mode)) if which == 0 else None
        if quantize is not None:
            return quantize, 0
        state, index = self.gemms[gemm]
        return state, state.slot(mode, index, which)

    def _role(self, gemm, mode, which):
        """ScaleOptions' role of GEMM ``gemm``'s operand ``which`` in ``mode``: a spec Quantize's
        cast where one casts there, else the Linear's own of x, w or grad."""
        if which == 0 and (gemm, mode) in self.quantize:
            return "quantize"
        return "w" if which == 1 else "x" if mode == "forward" else "grad"

    def _delayed(self, gemm, mode, which):
        """Delayed scaling's scale for GEMM ``gemm``'s operand ``which`` in ``mode`` (_slot's), and
        the element of the history's first row its amax is max-ed into."""
        state, slot = self._slot(gemm, mode, which)
        scales, history = state.modes[mode]
        return scales[slot], history[0, slot]

    def _record(self, x, gemm, mode, which):
        """Delayed scaling (calibrating): x's amax into its slot of the history's first row."""
        _, kept = self._delayed(gemm, mode, which)
        kept.copy_(torch.maximum(kept, self.casts.fp8_amax(x)))

    def amax(self):
        """For a kernel that writes an FP8 GEMM's operand: a zeroed float it keeps the tensor's amax
        in, which the operand's cast (``linear``'s or ``grad_output``'s ``amax``) reads instead of
        an amax pass of its own; None where the recipe reads none (delayed scaling records the amax
        in its cast, row-wise scales per row, calibrating runs in high precision). One zeroed
        buffer a call serves all (two operands a GEMM at most)."""
        if self.kind != "current" or self.calibrating:
            return None
        if self.amaxes is None or self.amaxes_taken == self.amaxes.numel():
            self.amaxes = torch.zeros(2 * len(self.gemms), device=self.device, dtype=torch.float32)
            self.amaxes_taken = 0
        self.amaxes_taken += 1
        return self.amaxes[self.amaxes_taken - 1]

    def _tensorwise(self, x, gemm, mode, which, transpose, amax=None):
        """x cast with one scale, the state's (delayed: x's amax recorded in its slot, in the same
        pass) or x's own (current: from ``amax`` where the kernel that wrote x kept it, else an
        amax pass first), and with ``transpose`` its transpose (TE's cast-transpose). Returns the
        _Quantized x and its transpose (or None)."""
        forward = mode == "forward"
        cast = self.casts.fp8_cast_e4m3 if fp8_dtype(self.recipe, forward) == torch.float8_e4m3fn \
            else self.casts.fp8_cast_e5m2
        if self.kind == "delayed":
            scale, kept = self._delayed(gemm, mode, which)  # x's amax max-ed into kept by the cast itself
            y, y_t, scale_inv = cast(x, scale, None, 0, 0, int(transpose), kept)
        else:
            amax = self.casts.fp8_amax(x) if amax is None else amax
            eps_bits, power_2 = self.options[self._role(gemm, mode, which)]
            y, y_t, scale_inv = cast(x, None, amax, eps_bits, power_2, int(transpose), None)
        return _Quantized(y, scale_inv), _Quantized(y_t, scale_inv) if transpose else None

    def produce(self, gemm, mode, fp8_kernel, kernel, *inputs):
        """An FP8 GEMM's operand (``mode`` "forward": GEMM ``gemm``'s x; "backward": its output's
        grad) written by the kernel that computes it: ``fp8_kernel``, the variant of ``kernel`` that
        stores its output in FP8 with its transpose (templates/cuda/fp8_tile.cuh), from
        ``inputs``. Delayed scaling launches it once (the state's scale; the amax recorded in its
        slot), current scaling twice (the amax alone, then the stores with the scale from it).
        Returns the operand as ``linear`` and ``grad_output`` take it, the FP8 tensor and its
        transpose (none without grad: the forward's weight grad is not coming); where the
        recipe casts no producer's output (row-wise, calibrating), ``kernel``'s high-precision
        output, which they cast."""
        if (self.calibrating or self.kind in ("rowwise", "block")
                or self.override is not None and (mode == "backward" or self.override == "high_precision")):
            return kernel(*inputs)  # (under backward_override: the grad not cast, or x kept as it is)
        forward = mode == "forward"
        e5m2 = int(fp8_dtype(self.recipe, forward) == torch.float8_e5m2)
        transpose = int(self.training or not forward)
        if self.kind == "delayed":
            scale, kept = self._delayed(gemm, mode, 0)
            y, y_t, scale_inv = fp8_kernel(*inputs, scale, None, kept, e5m2, 0, 0, transpose, 1)
        else:
            amax = self.amax()
            fp8_kernel(*inputs, None, None, amax, e5m2, 0, 0, 0, 0)  # the amax alone
            eps_bits, power_2 = self.options[self._role(gemm, mode, 0)]
            y, y_t, scale_inv = fp8_kernel(*inputs, None, amax, None, e5m2, eps_bits, power_2, transpose, 1)
        return _Quantized(y, scale_inv), _Quantized(y_t, scale_inv) if transpose else None

    def _rowwise(self, x, forward):
        """x [rows, k] cast with a scale per row (the row-wise recipe: one kernel, a block a row)."""
        e4m3 = fp8_dtype(self.recipe, forward) == torch.float8_e4m3fn
        cast_rows = self.casts.fp8_cast_rows_e4m3 if e4m3 else self.casts.fp8_cast_rows_e5m2
        return _Quantized(*cast_rows(x, int(self.recipe.use_power_2_scales)))

    def _columnwise(self, x, forward):
        """x [rows, k] cast with a scale per column, transposed ([k, rows rounded up to 16]): the
        row-wise recipe's weight-grad and dgrad operands (a column amax pass, then the cast)."""
        e4m3 = fp8_dtype(self.recipe, forward) == torch.float8_e4m3fn
        cast_cols = self.casts.fp8_cast_cols_e4m3 if e4m3 else self.casts.fp8_cast_cols_e5m2
        return _Quantized(*cast_cols(x, self.casts.fp8_amax_cols(x), int(self.recipe.use_power_2_scales)))

    def _blocks(self, x, role, transpose):
        """x [rows, k] cast with TE's block scales (Float8BlockScaling; ``role`` "x", "w" or "grad":
        its block dim and QParams): the row-wise copy and, with ``transpose``, the transposed one
        (1D: blocks along its own rows), each from x, in one pass (quantize_blocks.cuh)."""
        dim = getattr(self.recipe, f"{role}_block_scaling_dim")
        e4m3 = fp8_dtype(self.recipe, role != "grad") == torch.float8_e4m3fn
        cast = self.casts.fp8_cast_blocks_e4m3 if e4m3 else self.casts.fp8_cast_blocks_e5m2
        y, s, y_t, s_t = cast(x, int(dim == 2), *self.options[role], 1, int(transpose))
        return _Quantized(y, s, dim), _Quantized(y_t, s_t, dim) if transpose else None

    def _weight(self, gemm, weight):
        """The GEMM's FP8 weight, cast again only when the parameter changed (TE's weight cache:
        a weight changed through ``.data`` is not seen; ``forget_fp8_weights`` drops the cache).
        A call captured into a CUDA graph casts it and caches nothing: each replay casts the weight
        as it then is (an optimizer changes it in place between replays, unseen by the cache)."""
        state, index = self.gemms[gemm]
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self.kind)
        cached = state.weights[index]
        if cached is not None and cached.key == key and not self.capturing:
            return cached
        w = weight.detach()
        if self.kind == "rowwise":
            rows, columns = self._rowwise(w, True), self._columnwise(w, True)
        elif self.kind == "block":
            rows, columns = self._blocks(w, "w", transpose=True)
        else:
            rows, columns = self._tensorwise(w, gemm, "forward", 1, transpose=True)
        cached = _QuantizedWeight(rows, columns, weight.dtype, key)
        if not self.capturing:
            state.weights[index] = cached
        return cached

    def linear(self, gemm, x, weight, bias=None, alpha=1.0, add=None, activation=None, amax=None):
        """The forward GEMM number ``gemm``: ``activation(alpha (x W^T + bias) + add)`` with x and W
        cast to FP8 (``amax``: x's, where the kernel that wrote x kept it; x may be ``produce``'s
        FP8 pair, cast already). Returns y, what the weight grad reads of x (its FP8 transpose,
        cast with x in one pass; x itself for the row-wise recipe, whose weight grad casts x per
        column, and calibrating; None without grad: the backward keeps nothing else of x) and the
        FP8 weight (the dgrad's). Under backward_override: x and the weight as the backward's
        high-precision GEMMs read them (as they are, or their FP8 values dequantized)."""
        if self.calibrating:  # high precision, the amaxes recorded
            if self.kind == "delayed":
                self._record(x, gemm, "forward", 0)
                self._record(weight, gemm, "forward", 1)
            y = epilogue(x.mm(weight.t()), alpha, bias, add, activation, False)
            return y, x if self.training else None, weight
        w = self._weight(gemm, weight)
        if isinstance(x, tuple):  # written in FP8 by the kernel that computed it (produce)
            xq, x_t = x
        elif self.kind == "rowwise":
            xq, x_t = self._rowwise(x, True), x if self.training else None
        elif self.kind == "block":
            xq, x_t = self._blocks(x, "x", transpose=self.training and self.override is None)
        else:
            xq, x_t = self._tensorwise(x, gemm, "forward", 0, transpose=self.training and self.override is None,
                                       amax=amax)
        fused_bias = bias if alpha == 1.0 else None
        y = scaled_mm(xq, w.rows, weight.dtype, fused_bias, fast_accum=self.fast["fprop"])
        y = epilogue(y, alpha, bias, add, activation, fused_bias is not None)
        if self.override is None or not self.training:
            return y, x_t, w
        if self.override == "high_precision":  # (produce left x in high precision)
            return y, x, weight
        return y, dequantized(xq).to(weight.dtype), dequantized(w.rows).to(weight.dtype)

    def grad_output(self, gemm, dy, amax=None):
        """dy cast for the GEMM's dgrad and weight grad (E5M2 under HYBRID): tensorwise one
        cast-transpose (``amax``: dy's, where the kernel that wrote dy kept it); row-wise per row
        of dy and per column. ``produce``'s FP8 pair is returned as it is."""
        if isinstance(dy, tuple):  # written in FP8 by the kernel that computed it (produce)
            return dy
        if self.calibrating or self.override is not None:  # (backward_override: dy is not cast)
            if self.kind == "delayed":
                self._record(dy, gemm, "backward", 0)
            return dy, dy
        if self.kind == "rowwise":
            return self._rowwise(dy, False), self._columnwise(dy, False)
        if self.kind == "block":
            return self._blocks(dy, "grad", transpose=True)
        return self._tensorwise(dy, gemm, "backward", 0, transpose=True, amax=amax)

    def round_trip(self, end, x):
        """A spec Quantize at the pipeline's end (``end`` "y": the output, forward) or start ("dx":
        x's grad, backward): x cast to FP8 with the Quantize's scaling and back, the values of the
        FP8 tensor TE hands the caller (calibrating: x, its amax recorded)."""
        mode = "forward" if end == "y" else "backward"
        if self.calibrating or self.override is not None and mode == "backward":
            if self.kind == "delayed":
                self._record(x, end, mode, 0)
            return x
        if self.kind == "rowwise":
            q = self._rowwise(x, mode == "forward")
        elif self.kind == "block":
            q, _ = self._blocks(x, "x" if mode == "forward" else "grad", transpose=False)
        else:
            q, _ = self._tensorwise(x, end, mode, 0, transpose=False)
        return dequantized(q).to(x.dtype)

    def dgrad(self, dy, weight, alpha=1.0, add=None):
        """dx = alpha dy W (+ add): ``dy`` from grad_output, ``weight`` the forward's FP8 weight (or
        what ``linear`` returned of it)."""
        rows, _ = dy
        if self.calibrating or self.override is not None:
            dx = rows.mm(weight)
        else:
            dx = scaled_mm(rows, weight.columns, weight.dtype, fast_accum=self.fast["dgrad"])
        if alpha != 1.0:
            dx.mul_(alpha)
        return dx if add is None else dx.add_(add)

    def weight_grad(self, weight, dy, x_t, alpha=1.0, out_dtype=None):
        """dW = alpha dy^T x: ``dy`` from grad_output, ``x_t`` what ``linear`` returned of x (its FP8
        transpose; row-wise and calibrating: x, cast per column here), in ``out_dtype`` (default
        the weight's; fp32 for TE's accumulate_into_main_grad, which the shipped reference's
        add_into_main_grad does)."""
        _, columns = dy
        out_dtype = out_dtype or weight.dtype
        if self.calibrating or self.override is not None:
            dw = columns.t().mm(x_t).to(out_dtype)
        elif self.kind == "rowwise":  # both padded alike
            dw = scaled_mm(columns, self._columnwise(x_t, True), out_dtype, fast_accum=self.fast["wgrad"])
        else:  # both transposes zero-padded alike (to a multiple of 16 rows of the step; blocks: of 128)
            dw = scaled_mm(columns, x_t, out_dtype, fast_accum=self.fast["wgrad"])
        if alpha != 1.0:
            dw.mul_(alpha)
        return dw

    def backward_done(self):
        """After the module's backward: the backward slots' update, where this was the first FP8
        module called in its autocast (TE updates them after the last backward to run). Under a
        CUDA graph's capture the update is captured too: each replay updates as a step does."""
        if self.first:
            update_states(self.step.backward.values())


def fp8_call(module, x, casts):
    """The Fp8Call of a call of ``module`` on ``x`` that ``fp8_runs``. ``casts``: the package's
    quantize launchers (its _kernels). Each GEMM's state is found from ``module.fp8_gemms`` (its
    holder's path, its index there)."""
    frame = active()
    kind = recipe_kind(frame.recipe)
    if kind not in module.fp8_recipes:
        raise RuntimeError(
            f"{type(module).__name__} was generated for the FP8 recipes {list(module.fp8_recipes)}, not "
            f"{type(frame.recipe).__name__}: add \"{kind}\" to fp8 in [tool.fusegen] (or its pipeline's table) "
            "and generate again")
    gemms = tuple((module.get_submodule(path).fp8, index) for path, index in module.fp8_gemms)
    quantize = {(gemm, mode): module.get_submodule(path).fp8  # the spec's Quantize ops, where it has any
                for gemm, mode, path in getattr(module, "fp8_quantize", ())}
    return Fp8Call(frame, gemms, casts, x.device, torch.is_grad_enabled(), quantize)
