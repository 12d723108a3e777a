"""FP8 (issue 40): the runtime's recipes against independent implementations of TE's documented
rules (docs/fp8_te_semantics.md), and generated modules built for FP8 against float64 references
of the quantized computation (each operand quantized with the recipe's scales, then exact math).

CPU tests emulate the recipes (the same FP8 values multiplied in fp32); the cuda tests run
torch._scaled_mm."""

import copy
import importlib.util
import io
import math
import struct
import types

import pytest
import torch

from tests.spec_packages import imported_package

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# TE's FP8 tolerances (tests/pytorch/utils.py dtype_tols): E4M3 rtol 0.125, atol 0.0675; E5M2 0.25, 0.125
FP8_TOLS = {E4M3: dict(rtol=0.125, atol=0.0675), E5M2: dict(rtol=0.25, atol=0.125)}


@pytest.fixture(scope="module")
def fp8(package):
    """The runtime's FP8 modules (fp8_recipes, fp8_autocast, fp8_state, fp8_casts, fp8) as a generated package holds them,
    their names in one namespace."""
    names = {}
    for module in ("fp8_recipes", "fp8_autocast", "fp8_state", "fp8_casts", "fp8"):
        names.update(vars(importlib.import_module(f"{package.__name__}._runtime.{module}")))
    return types.SimpleNamespace(**names)


# --- independent implementations of TE's rules ---------------------------------------------------

def f32(value):
    """``value`` rounded to float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def te_current_scale(amax, fp8_max, epsilon=0.0, power_2=False):
    """compute_scale_from_amax (common/recipe/recipe_common.cuh), one float at a time (floats: the
    amax and epsilon are fp32 there)."""
    amax, epsilon = f32(amax), f32(epsilon)
    if amax < epsilon:
        amax = epsilon
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = f32(fp8_max / amax)  # __fdiv_rn: the float32 division rounded once
    if math.isinf(scale) or scale > 3.4028234663852886e38:
        scale = 3.4028234663852886e38
    if power_2:
        bits = struct.unpack("I", struct.pack("f", scale))[0] & 0xFF800000
        scale = struct.unpack("f", struct.pack("I", bits))[0]
    return scale


def te_delayed_update(history, scale, amax, algo, fp8_max, margin):
    """kernel_bulk of common/recipe/delayed_scaling.cu for one tensor, as lists: returns the new
    history (a list of rows) and scale."""
    length = len(history)
    last = amax
    new = [row for row in history]
    chosen = 0.0
    if last != 0.0:
        for i in range(length):
            a = history[i + 1] if i < length - 1 else last
            chosen = max(chosen, a)
            new[i] = a if i > 0 else 0.0
    if algo == "most_recent":
        chosen = last
    scaled_max = f32(fp8_max * f32(2.0 ** -margin))
    if math.isfinite(chosen) and chosen > 0:
        out = f32(scaled_max / chosen)
    else:
        out = scale
    if math.isinf(out):
        out = 3.4028234663852886e38
    return new, out


def quantized(t, scale, dtype):
    """t's FP8 values times 1/scale, in float64: x * scale rounded to float32, saturated, converted."""
    limit = torch.finfo(dtype).max
    scale_inv = torch.tensor(scale, dtype=torch.float32).reciprocal().double()  # as the GEMM scales back
    return (t.to(torch.float32) * scale).clamp(-limit, limit).to(dtype).to(torch.float64) * scale_inv


# --- the rules -----------------------------------------------------------------------------------

@pytest.mark.parametrize("power_2", [False, True])
def test_current_scale_follows_te(fp8, power_2):
    amaxes = [3.0, 1e-30, 0.0, float("inf"), float("nan"), 448.0, 7.3e-4, 1e-45, 65504.0]
    for amax in amaxes:
        for epsilon in (0.0, 1e-3):
            got = fp8.current_scale(torch.tensor(amax), 448.0, epsilon, power_2).item()
            want = te_current_scale(amax, 448.0, epsilon, power_2)
            assert got == want or (math.isnan(got) and math.isnan(want)), (amax, epsilon, got, want)


@pytest.mark.parametrize("length", [1, 2, 5])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_update_follows_te_step_by_step(fp8, package, length, algo, margin):
    recipe = fp8.DelayedScaling(amax_history_len=length, amax_compute_algo=algo, margin=margin)
    generator = torch.Generator().manual_seed(length * 10 + margin)
    history = torch.zeros(length, 3)
    scale = torch.ones(3)
    mine = [([0.0] * length, 1.0) for _ in range(3)]
    for step in range(9):
        amax = torch.rand(3, generator=generator) * 10 ** torch.randint(-3, 4, (3,), generator=generator)
        if step in (2, 5):
            amax[step % 3] = 0.0  # no roll, no new scale
        if step == 6:
            amax[1] = float("inf")  # the scale kept
        history[0] = amax
        fp8.delayed_update(history, scale, None, recipe, 448.0, package._kernels)
        for i in range(3):
            rows, old = mine[i]
            rows = [amax[i].item()] + rows[1:]
            mine[i] = te_delayed_update(rows, old, amax[i].item(), algo, 448.0, margin)
            assert history[:, i].tolist() == [f32(v) for v in mine[i][0]], (step, i)
            assert scale[i].item() == mine[i][1], (step, i, scale[i].item(), mine[i][1])


def test_cast_saturates(fp8):
    """TE's casts saturate (__NV_SATFINITE); torch's conversion on CUDA does not (1000 -> NaN in
    E4M3 on the H100, torch 2.11), so the cast clamps first."""
    x = torch.tensor([1000.0, -1000.0, 447.0, float("nan"), float("inf"), 1e-9])
    got = fp8.cast(x, torch.tensor(1.0), E4M3).float()
    assert got[:3].tolist() == [448.0, -448.0, 448.0] and math.isnan(got[3]) and got[4] == 448.0
    assert fp8.cast(torch.tensor([1e6]), torch.tensor(1.0), E5M2).item() == 57344.0


def pow2_floor(value):
    """A positive float32's mantissa dropped: the power of 2 at or below it (TE's mask)."""
    return struct.unpack("f", struct.pack("I", struct.unpack("I", struct.pack("f", value))[0] & 0xFF800000))[0]


def test_rowwise_scale_is_torchaos(fp8):
    """max / max(amax, 1e-12) in fp64, rounded to fp32, floored to a power of 2."""
    amax = torch.tensor([[3.0], [0.0], [1e-20], [448.0], [0.8]])
    want = [pow2_floor(f32(448.0 / max(a, 1e-12))) for a in amax.flatten().tolist()]
    assert fp8.rowwise_scale(amax, 448.0).flatten().tolist() == want
    assert want == [128.0, 2.0 ** 48, 2.0 ** 48, 1.0, 512.0]


# --- recipes and autocast --------------------------------------------------------------------------

def test_recipes_mirror_te_defaults(fp8):
    delayed = fp8.DelayedScaling()
    assert (delayed.margin, delayed.fp8_format, delayed.amax_history_len, delayed.amax_compute_algo,
            delayed.reduce_amax) == (0, fp8.Format.HYBRID, 1024, "max", True)
    current = fp8.Float8CurrentScaling()
    assert (current.use_power_2_scales, current.fp8_format) == (False, fp8.Format.HYBRID)
    assert fp8.fp8_dtype(delayed, True) == E4M3 and fp8.fp8_dtype(delayed, False) == E5M2
    assert fp8.fp8_dtype(fp8.Float8RowwiseScaling(), False) == E4M3
    with pytest.raises(ValueError, match="pure E5M2 training is not supported"):
        fp8.DelayedScaling(fp8_format=fp8.Format.E5M2)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        fp8.DelayedScaling(amax_compute_algo="mean")


def test_te_recipe_objects_are_read_by_name(fp8):
    class Format:  # TE's enum, by its members' names
        HYBRID = type("Member", (), {"name": "HYBRID"})()

    class DelayedScaling:  # TE's dataclass, its fields by name
        margin, fp8_format, amax_history_len, amax_compute_algo = 1, Format.HYBRID, 16, "most_recent"

    made = fp8.as_recipe(DelayedScaling())
    assert isinstance(made, fp8.DelayedScaling) and (made.margin, made.amax_history_len) == (1, 16)
    assert made.fp8_format is fp8.Format.HYBRID and made.amax_compute_algo == "most_recent"

    class MXFP8BlockScaling:
        pass

    with pytest.raises(TypeError, match="MXFP8BlockScaling.*not supported"):
        fp8.autocast(recipe=MXFP8BlockScaling())


def test_fp8_autocast_is_deprecated(fp8):
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        context = fp8.fp8_autocast(fp8_recipe=fp8.Float8CurrentScaling())
    with context:
        assert fp8.active().recipe == fp8.Float8CurrentScaling()
    assert fp8.active() is None


def test_nested_autocast(fp8):
    with fp8.autocast(recipe=fp8.DelayedScaling()) as outer:
        with fp8.autocast(enabled=False):
            assert fp8.active() is None
        with fp8.autocast(recipe=fp8.Float8CurrentScaling()) as inner:
            assert fp8.active() is inner and inner.step is outer.step
        assert fp8.active() is outer


# --- generated modules -----------------------------------------------------------------------------

LINEAR = """import transformer_engine.pytorch as te

linear = te.ops.Sequential(te.ops.Linear(64, 48))
mlp = te.ops.Sequential(te.ops.RMSNorm(64), te.ops.Linear(64, 96, bias=False), te.ops.SwiGLU(),
                        te.ops.Linear(48, 64))
# a SwiGLU 256 wide: its kernels write their FP8 GEMM operands themselves (fp8_tile.cuh's variants)
wide_mlp = te.ops.Sequential(te.ops.RMSNorm(64), te.ops.Linear(64, 512, bias=False), te.ops.SwiGLU(),
                             te.ops.Linear(256, 64))
layer_mlp = te.Sequential(te.LayerNormMLP(64, 96, activation="swiglu", normalization="RMSNorm"))
main_grad = te.ops.Sequential(te.ops.BasicLinear(64, 48, accumulate_into_main_grad=True))
# TE's explicit cast points around a GEMM, and the same GEMM without them
quantized = te.ops.Sequential(te.ops.Quantize(), te.ops.BasicLinear(64, 48), te.ops.Quantize(forward=False, backward=True))
plain = te.ops.Sequential(te.ops.BasicLinear(64, 48))
# and at the pipeline's ends: its output and x's grad handed out as TE's FP8 tensors are
ends = te.ops.Sequential(te.ops.Quantize(backward=True), te.ops.BasicLinear(64, 48), te.ops.Quantize(backward=True))
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    with imported_package(folder, "spec.py", LINEAR, "fp8_pkg", fp8=("delayed", "current", "rowwise")) as pkg:
        yield pkg


def reference_current(t, dtype, fp8_max):
    """t quantized with current scaling (TE: one scale from t's amax), float64."""
    scale = te_current_scale(t.abs().max().item(), fp8_max)
    return quantized(t, scale, dtype)


def reference_rowwise(t, dtype=E4M3, fp8_max=448.0):
    """t [rows, k] quantized with a power-of-2 scale per row (torchao's rowwise), float64."""
    out = torch.empty(t.shape, dtype=torch.float64)
    for i, row in enumerate(t):
        scale = pow2_floor(f32(fp8_max / max(row.abs().max().item(), 1e-12)))
        out[i] = quantized(row, scale, dtype)
    return out


def inputs(rows=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 64, generator=generator) * 3, torch.randn(rows, 48, generator=generator))


def close_to_float64(got, want, k):
    """The emulated GEMM sums FP8 products in fp32: within k fp32 roundings of max |want|."""
    assert torch.allclose(got.double(), want, rtol=0, atol=4 * k * 2 ** -24 * want.abs().max().item()), \
        (got.double() - want).abs().max()


@pytest.mark.parametrize("recipe", ["current", "rowwise"])
def test_linear_computes_the_quantized_gemms(fp8, package, recipe):
    """One Linear: y, dx, dW and db against the GEMMs of the recipe's quantized operands in float64
    (the operands given exactly, so the FP8 values match bit for bit)."""
    torch.manual_seed(1)
    module = package.Linear()
    x, dy = inputs()
    x.requires_grad_(True)
    made = {"current": package.Float8CurrentScaling(), "rowwise": package.Float8RowwiseScaling()}[recipe]
    with package.autocast(recipe=made):
        y = module(x)
    y.backward(dy)
    w, b = module._modules["0"].weight.detach(), module._modules["0"].bias.detach()
    if recipe == "current":
        qx, qw = reference_current(x.detach(), E4M3, 448.0), reference_current(w, E4M3, 448.0)
        qdy = reference_current(dy, E5M2, 57344.0)  # HYBRID: the grads in E5M2
        want_dx, want_dw = qdy @ qw, qdy.t() @ qx
    else:  # each operand per row along its GEMM's reduction dim
        qx, qw = reference_rowwise(x.detach()), reference_rowwise(w)
        want_dx = reference_rowwise(dy) @ reference_rowwise(w.t().contiguous()).t()
        want_dw = reference_rowwise(dy.t().contiguous()) @ reference_rowwise(x.detach().t().contiguous()).t()
    close_to_float64(y.detach(), qx @ qw.t() + b.double(), 64)
    close_to_float64(x.grad, want_dx, 48)
    close_to_float64(module._modules["0"].weight.grad, want_dw, 24)
    close_to_float64(module._modules["0"].bias.grad, dy.double().sum(0), 24)  # in high precision


def test_accumulate_into_main_grad_under_fp8(package):
    """TE's accumulate_into_main_grad: the FP8 weight grad, computed in fp32, is added into
    weight.main_grad (twice: it accumulates), autograd given Megatron's placeholder (zeros)."""
    module = package.MainGrad()
    weight = module._modules["0"].weight
    weight.main_grad = torch.zeros_like(weight)
    weight.grad_added_to_main_grad = False
    weight.zero_out_wgrad = True  # Megatron's: the placeholder grad autograd gets is zeros
    x, dy = inputs()
    for _ in range(2):
        with package.autocast(recipe=package.Float8CurrentScaling()):
            y = module(x)
        y.backward(dy)
    want = 2 * (reference_current(dy, E5M2, 57344.0).t() @ reference_current(x, E4M3, 448.0))
    close_to_float64(weight.main_grad, want, 24)
    assert weight.grad_added_to_main_grad and not weight.grad.any()


def test_linear_outside_autocast_is_high_precision(package):
    module = package.Linear()
    x, _ = inputs()
    with package.autocast(enabled=False):
        inside = module(x)
    assert torch.equal(inside, module(x))
    assert torch.allclose(module(x), x @ module._modules["0"].weight.t() + module._modules["0"].bias, atol=1e-5)


def test_delayed_scaling_steps(fp8, package):
    """Delayed scaling over three steps: each step casts with the scales of the steps before
    (1 at first), records its amaxes in the history's first row, and the update after the
    forward (the outermost autocast's exit) and after the backward follows TE's rule."""
    module = package.Linear()
    recipe = package.DelayedScaling(amax_history_len=3)
    state = module._modules["0"].fp8
    scales = {"forward": [1.0, 1.0], "backward": [1.0]}
    rows = {"forward": [[0.0] * 3, [0.0] * 3], "backward": [[0.0] * 3]}
    w = module._modules["0"].weight
    for step in range(3):
        x, dy = inputs(seed=step)
        x = x * (step + 1)
        x.requires_grad_(True)
        with package.autocast(recipe=recipe):
            y = module(x)
            # the forward recorded x's and W's amaxes in row 0; scales not updated yet
            history = state.modes["forward"][1]
            assert history[0].tolist() == [f32(x.abs().max().item()), f32(w.abs().max().item())]
        qx = quantized(x.detach(), scales["forward"][0], E4M3)
        qw = quantized(w.detach(), scales["forward"][1], E4M3)
        close_to_float64(y.detach(), qx @ qw.double().t() + module._modules["0"].bias.double(), 64)
        for i, amax in enumerate((x.abs().max().item(), w.abs().max().item())):
            rows["forward"][i] = [amax] + rows["forward"][i][1:]
            rows["forward"][i], scales["forward"][i] = te_delayed_update(
                rows["forward"][i], scales["forward"][i], amax, "max", 448.0, 0)
        assert state.modes["forward"][0].tolist() == scales["forward"]
        y.backward(dy)
        qdy = quantized(dy, scales["backward"][0], E5M2)
        close_to_float64(x.grad, qdy @ qw, 48)
        amax = dy.abs().max().item()
        rows["backward"][0] = [amax] + rows["backward"][0][1:]
        rows["backward"][0], scales["backward"][0] = te_delayed_update(
            rows["backward"][0], scales["backward"][0], amax, "max", 57344.0, 0)
        assert state.modes["backward"][0].tolist() == scales["backward"]
        assert state.modes["backward"][1][:, 0].tolist() == [f32(v) for v in rows["backward"][0]]
        with torch.no_grad():
            w.add_(0.01)  # an optimizer step: the weight is cast again next time


def test_delayed_scaling_casts_an_unchanged_weight_again_after_the_update(fp8, package):
    """The weight cache keeps a weight cast with its step's delayed-scaling scale: after the forward
    update (the outermost autocast's exit) the next step casts the weight again with the new scale
    though the parameter did not change (steps without an optimizer, the benchmark's), and records
    its amax again."""
    module = package.Linear()
    state = module._modules["0"].fp8
    w = module._modules["0"].weight
    x, _ = inputs(seed=5)
    for _ in range(2):
        with package.autocast(recipe=package.DelayedScaling()):
            y = module(x)
    # the same amaxes each step: the scales after the second step are those it cast with
    scale_x, scale_w = state.modes["forward"][0].tolist()
    assert scale_w == te_current_scale(w.abs().max().item(), 448.0) != 1.0
    qx, qw = quantized(x, scale_x, E4M3), quantized(w.detach(), scale_w, E4M3)
    close_to_float64(y.detach(), qx @ qw.double().t() + module._modules["0"].bias.double(), 64)
    assert state.modes["forward"][1][-1, 1].item() == f32(w.abs().max().item())  # the second step's amax


def test_weight_cache(package):
    """The FP8 weight is cast once while the parameter is unchanged (TE's weight cache), again
    after an in-place update, and forget_fp8_weights drops it."""
    module = package.Linear()
    x, _ = inputs()
    with package.autocast(recipe=package.Float8CurrentScaling()):
        module(x)
        first = module._modules["0"].fp8.weights[0]
        module(x)
        assert module._modules["0"].fp8.weights[0] is first
        with torch.no_grad():
            module._modules["0"].weight.mul_(2)
        module(x)
        assert module._modules["0"].fp8.weights[0] is not first
        package.forget_fp8_weights(module)
        assert module._modules["0"].fp8.weights == [None]


def test_only_the_first_module_updates_the_backward_scales(package):
    first, second = package.Linear(), package.Linear()
    x, dy = inputs()
    with package.autocast(recipe=package.DelayedScaling(amax_history_len=2)):
        y = second(first(x[:, :64]) @ torch.ones(48, 64))
    y.backward(torch.ones_like(y))
    for module in (first, second):  # both updated by the first module's backward, the last to run
        assert module._modules["0"].fp8.modes["backward"][0].item() != 1.0
        assert module._modules["0"].fp8.modes["backward"][1][0].item() == 0.0


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
@pytest.mark.parametrize("name", ["Mlp", "LayerMlp", "WideMlp"])
def test_mlps_against_the_quantized_reference(package, recipe, name):
    """RMSNorm, Linear, SwiGLU, Linear (te.ops, and TE's LayerNormMLP, two GEMMs in one holder;
    WideMlp's SwiGLU writes its FP8 operands itself, forward and backward): output and every grad
    within TE's FP8 tolerances of the same ops in float64 with each GEMM's operands quantized as the
    recipe does; the first call of delayed scaling casts with scale 1."""
    torch.manual_seed(2)
    module = getattr(package, name)()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, 0.5, 0.2)
    x, _ = inputs(16, seed=3)
    x.requires_grad_(True)
    dy = torch.randn(16, 64)
    made = {"current": package.Float8CurrentScaling(), "delayed": package.DelayedScaling(),
            "rowwise": package.Float8RowwiseScaling()}[recipe]
    with package.autocast(recipe=made):
        y = module(x)
    y.backward(dy)
    params = [p.detach().double().requires_grad_(True) for p in module.parameters()]

    def q(t, forward, reduction_last=True):
        if recipe == "rowwise":
            return reference_rowwise(t.detach().float()).to(t.device)
        if recipe == "delayed":  # the first step: scale 1
            return quantized(t.detach().float(), 1.0, E4M3 if forward else E5M2)
        return reference_current(t.detach().float(), E4M3 if forward else E5M2, 448.0 if forward else 57344.0)

    class QuantizedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return q(a, True) @ q(w, True).t()

        @staticmethod
        def backward(ctx, g):
            a, w = ctx.saved_tensors
            if recipe == "rowwise":
                return q(g, False) @ q(w.t().contiguous(), True).t(), \
                    q(g.t().contiguous(), False) @ q(a.t().contiguous(), True).t()
            return q(g, False) @ q(w, True), q(g, False).t() @ q(a, True)

    xd = x.detach().double().requires_grad_(True)
    if name != "LayerMlp":
        norm_w, w1, w2, b2 = params
        b1 = None
    else:
        norm_w, w1, b1, w2, b2 = params
    h = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    h = QuantizedLinear.apply(h, w1) + (b1 if b1 is not None else 0)
    a, g = h.chunk(2, dim=-1)
    want = QuantizedLinear.apply(torch.nn.functional.silu(a) * g, w2) + b2
    want.backward(dy.double())
    grads = FP8_TOLS[E5M2 if recipe != "rowwise" else E4M3]  # (row-wise: E4M3 grads, torchao's)
    for got, ref, tols in [(y, want, FP8_TOLS[E4M3]), (x.grad, xd.grad, grads),
                           *((p.grad, r.grad, grads) for p, r in zip(module.parameters(), params))]:
        scale = ref.abs().max()  # relative to the largest value: grads are not O(1)
        assert torch.allclose(got.double() / scale, ref.detach() / scale, **tols), (got.shape, (got - ref).abs().max())


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_producers_writing_fp8_change_no_value(fp8, package, recipe, monkeypatch):
    """WideMlp's SwiGLU writes its output and, backward, its dx in FP8 with their transposes
    (Fp8Call.produce: its kernels' FP8 variants, one launch delayed, two current): output, every
    grad and delayed scaling's state equal bit for bit over three steps those of a copy whose SwiGLU
    writes high precision for the separate casts (produce running the plain kernel, as it does for
    the row-wise recipe), and so does the no-grad forward."""
    source = importlib.import_module(f"{package.__name__}.wide_mlp")
    text = open(source.__file__).read()
    assert text.count("fp8.produce(") == 3 and "kernels.swiglu_bwd_n256_fp8" in text  # forward, backward, no-grad
    torch.manual_seed(5)
    fused = package.WideMlp()
    for parameter in fused.parameters():
        torch.nn.init.normal_(parameter, 0.3, 0.2)
    unfused = copy.deepcopy(fused)
    make = {"current": package.Float8CurrentScaling, "delayed": lambda: package.DelayedScaling(amax_history_len=2)}
    plain = lambda call, gemm, mode, fp8_kernel, kernel, *inputs: kernel(*inputs)  # noqa: E731
    for step in range(3):
        x, _ = inputs(40, seed=60 + step)
        dy = torch.randn(40, 64)
        results = []
        for module, produce in ((fused, fp8.Fp8Call.produce), (unfused, plain)):
            monkeypatch.setattr(fp8.Fp8Call, "produce", produce)
            xi = x.clone().requires_grad_(True)
            with package.autocast(recipe=make[recipe]()):
                y = module(xi)
            y.backward(dy)
            with torch.no_grad(), package.autocast(recipe=make[recipe]()):
                y_no_grad = copy.deepcopy(module)(x)
            results.append([y, y_no_grad, xi.grad, *(p.grad for p in module.parameters())])
            module.zero_grad(set_to_none=True)
        for got, want in zip(*results):
            assert torch.equal(got, want), (recipe, step)
    for a, b in zip(fused.modules(), unfused.modules()):
        if "fp8" in a.__dict__:
            for mode in a.fp8.modes:
                for got, want in zip(a.fp8.modes[mode], b.fp8.modes[mode]):
                    assert torch.equal(got, want), mode


def quantize_pair(package):
    """The Quantize spec's module and the plain BasicLinear's, holding the same weight."""
    quantized, plain = package.Quantized(), package.Plain()
    with torch.no_grad():
        plain._modules["0"].weight.copy_(quantized._modules["1"].weight)
    return quantized, plain


@pytest.mark.parametrize("recipe", ["current", "rowwise", "delayed"])
def test_quantize_ops_are_the_gemms_casts(fp8, package, recipe):
    """te.ops.Quantize (TE's ops/basic/quantize.py) before a Linear casts its input, after one (backward=True)
    the grad of its output: the Linear takes that FP8 tensor as its operand. So y, dx and dW are
    those of the Linear alone, bit for bit, over three steps; with delayed scaling the casts use and
    update the Quantizes' own state (x's amaxes in the first's forward history, dy's in the
    second's backward one) while the Linear's input and grad slots stay as made, as TE's."""
    quantized, plain = quantize_pair(package)
    make = {"current": package.Float8CurrentScaling, "rowwise": package.Float8RowwiseScaling,
            "delayed": lambda: package.DelayedScaling(amax_history_len=4)}[recipe]
    for step in range(3):
        x, dy = inputs(seed=20 + step)
        results = []
        for module in (quantized, plain):
            xi = x.clone().requires_grad_(True)
            with package.autocast(recipe=make()):
                y = module(xi)
            y.backward(dy)
            weight = module._modules["1" if module is quantized else "0"].weight
            results.append((y.detach(), xi.grad, weight.grad.clone()))
            weight.grad = None
        for got, want in zip(*results):
            assert torch.equal(got, want), (recipe, step)
    if recipe != "delayed":
        return
    first, linear, second = (quantized._modules[name].fp8 for name in ("0", "1", "2"))
    assert set(first.modes) == {"forward"} and set(second.modes) == {"backward"}
    assert first.modes["forward"][1][:, 0].tolist() == plain._modules["0"].fp8.modes["forward"][1][:, 0].tolist()
    assert second.modes["backward"][1][:, 0].tolist() == plain._modules["0"].fp8.modes["backward"][1][:, 0].tolist()
    assert linear.modes["forward"][1][:, 0].abs().sum().item() == 0.0  # its input slot never cast
    assert linear.modes["forward"][1][:, 1].tolist() == plain._modules["0"].fp8.modes["forward"][1][:, 1].tolist()
    assert linear.modes["backward"][1].abs().sum().item() == 0.0 and linear.modes["backward"][0].tolist() == [1.0]
    # the Quantizes' state is their _extra_state (TE's per-mode form, only the mode each casts in)
    state = quantized.state_dict()
    fresh, _ = quantize_pair(package)
    fresh.load_state_dict(state)
    for name in ("0", "2"):
        for mode, tensors in quantized._modules[name].fp8.modes.items():
            for got, want in zip(fresh._modules[name].fp8.modes[mode], tensors):
                assert torch.equal(got, want), (name, mode)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_quantize_at_the_ends_hands_out_the_fp8_values(fp8, package, recipe):
    """A Quantize at the pipeline's end casts its output, one at its start (backward=True) x's grad:
    TE hands the caller those FP8 tensors, whose values fusegen hands out (cast and back). With
    the same weight, y and x's grad are the plain Linear's quantized with current scaling's scale
    (delayed scaling: its third step, whose scales are the second's amaxes, those same values),
    and the Quantizes' scales are those amaxes'."""
    ends, plain = package.Ends(), package.Plain()
    with torch.no_grad():
        plain._modules["0"].weight.copy_(ends._modules["1"].weight)
    x, dy = inputs(seed=31)
    # delayed: a history of one step, so the third step's scales are the second's amaxes, which the
    # third has too (the first casts x and W with scale 1: its y differs)
    make = {"current": package.Float8CurrentScaling, "delayed": lambda: package.DelayedScaling(amax_history_len=1)}
    for _ in range(3):
        results = []
        for module in (ends, plain):
            xi = x.clone().requires_grad_(True)
            with package.autocast(recipe=make[recipe]()):
                y = module(xi)
            y.backward(dy)
            results.append((y.detach(), xi.grad))
    (y_ends, dx_ends), (y_plain, dx_plain) = results
    close_to_float64(y_ends, reference_current(y_plain, E4M3, 448.0), 1)
    close_to_float64(dx_ends, reference_current(dx_plain, E5M2, 57344.0), 1)
    assert not torch.equal(y_ends, y_plain) and not torch.equal(dx_ends, dx_plain)  # (cast: not as they were)
    if recipe == "delayed":
        assert ends._modules["2"].fp8.modes["forward"][0].item() == te_current_scale(y_plain.abs().max().item(), 448.0)
        assert ends._modules["0"].fp8.modes["backward"][0].item() == te_current_scale(dx_plain.abs().max().item(),
                                                                                      57344.0)


def test_quantize_outside_fp8_is_identity(tmp_path):
    """Outside FP8 (a pipeline not built for it, or outside autocast) a Quantize is y = x anywhere,
    as TE's outside autocast: here before a norm."""
    spec = ("import transformer_engine.pytorch as te\n\n"
            "normed = te.ops.Sequential(te.ops.Quantize(backward=True), te.ops.RMSNorm(64))\n"
            "norm = te.ops.Sequential(te.ops.RMSNorm(64))\n")
    with imported_package(tmp_path, "spec.py", spec, "quantize_pkg") as pkg:
        x, _ = inputs()
        assert torch.equal(pkg.Normed()(x), pkg.Norm()(x))


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_calls_under_torch_compile_run_eagerly(package, recipe):
    """Under torch.compile (the eager backend, on the CPU) a module built for FP8 and called inside
    autocast makes its FP8 call outside the graph, as the uncompiled module: output, x's grad,
    every parameter's and delayed scaling's state equal the uncompiled copy's bit for bit over three
    steps. Outside autocast the compiled module runs high precision, as the uncompiled one does
    (the trace is guarded on the autocast stack); fullgraph=True refuses the FP8 call, saying why."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    eager = package.Mlp()
    for parameter in eager.parameters():
        torch.nn.init.normal_(parameter, 0.5, 0.2)
    module = copy.deepcopy(eager)
    compiled = torch.compile(module, backend="eager")
    make = {"current": package.Float8CurrentScaling, "delayed": lambda: package.DelayedScaling(amax_history_len=2)}
    for step, fp8_on in enumerate((True, False, True, True)):
        x, _ = inputs(16, seed=50 + step)
        dy = torch.randn(16, 64)
        results = []
        for run, owner in ((compiled, module), (eager, eager)):
            xi = x.clone().requires_grad_(True)
            with package.autocast(enabled=fp8_on, recipe=make[recipe]()):
                y = run(xi)
            y.backward(dy)
            results.append([y, xi.grad, *(p.grad for p in owner.parameters())])
            owner.zero_grad(set_to_none=True)
        for got, want in zip(*results):
            assert torch.equal(got, want), (recipe, step, fp8_on)
        if step == 1:  # outside autocast: high precision, not the FP8 values (a copy's: no update)
            with package.autocast(recipe=make[recipe]()):
                assert not torch.equal(copy.deepcopy(eager)(x), results[1][0])
    for a, b in zip(module.modules(), eager.modules()):
        if "fp8" in a.__dict__:
            for mode in a.fp8.modes:
                for got, want in zip(a.fp8.modes[mode], b.fp8.modes[mode]):
                    assert torch.equal(got, want), mode
    torch._dynamo.reset()
    with package.autocast(recipe=make[recipe]()), pytest.raises(Exception, match="runs outside torch.compile's graph"):
        torch.compile(copy.deepcopy(eager), backend="eager", fullgraph=True)(inputs(16)[0])


def test_fp8_forward_keeps_no_high_precision_gemm_input(package):
    """Under FP8 the weight grads read the FP8 transposes the forward's casts wrote, so the forward
    keeps neither GEMM input of the MLP (the norm's output, SwiGLU's) in high precision, where the
    high-precision forward keeps both; x, which the norm's backward reads, it keeps either way."""
    x, _ = inputs(rows=40)
    kept = {}
    for mode in ("bf16", "current", "rowwise"):
        module = package.Mlp()
        module.fp8_min_rows = 0
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t
        recipe = {"current": package.Float8CurrentScaling(), "rowwise": package.Float8RowwiseScaling()}.get(mode)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with package.autocast(enabled=recipe is not None, recipe=recipe):
                y = module(x.clone().requires_grad_(True))
        y.sum().backward()  # (the backward runs on what was kept)
        kept[mode] = shapes
    assert kept["bf16"].count((40, 64)) == 2 and kept["bf16"].count((40, 48)) == 1  # x, the norm's out; SwiGLU's
    for mode in ("current", "rowwise"):
        assert kept[mode].count((40, 64)) == 1 and kept[mode].count((40, 48)) == 0, (mode, kept[mode])


def test_extra_state_round_trip(package):
    """Delayed scaling's state is in the state_dict as TE's _extra_state (te.ops: per mode; TE's
    modules: one dict with num_gemms), and loads into a fresh module and a deepcopy."""
    for name, key in (("Linear", "0._extra_state"), ("LayerMlp", "0._extra_state")):
        module = getattr(package, name)()
        x, _ = inputs()
        with package.autocast(recipe=package.DelayedScaling(amax_history_len=4)):
            y = module(x)
        y.sum().backward()
        state = module.state_dict()
        assert state[key].dtype == torch.uint8 and state[key].numel() > 0
        fresh = getattr(package, name)()
        fresh.load_state_dict(state)
        holder = fresh._modules["0"].fp8
        for mode in ("forward", "backward"):
            for got, want in zip(holder.modes[mode], module._modules["0"].fp8.modes[mode]):
                assert torch.equal(got, want)
        assert holder.recipe == package.DelayedScaling(amax_history_len=4)
        assert torch.equal(copy.deepcopy(module)._modules["0"].fp8.modes["forward"][0],
                           module._modules["0"].fp8.modes["forward"][0])
        buffer = io.BytesIO()
        torch.save(module, buffer)  # the whole module, pickled
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(loaded._modules["0"].fp8.modes["backward"][1], module._modules["0"].fp8.modes["backward"][1])
    assert package.Linear().state_dict()["0._extra_state"].numel() == 0  # FP8 never ran: TE's empty tensor
    # a checkpoint without it (saved before the pipeline was built for FP8) loads strictly
    plain = {key: value for key, value in package.Linear().state_dict().items() if "_extra_state" not in key}
    package.Linear().load_state_dict(plain)
    bad = package.Linear().state_dict()
    bad["0._extra_state"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not TE's FP8 scaling state"):
        package.Linear().load_state_dict(bad)


def test_recipe_not_built_is_a_clear_error(tmp_path):
    with imported_package(tmp_path, "spec.py", LINEAR, "fp8_current_only", fp8=("current",)) as pkg:
        module = pkg.Linear()
        with pkg.autocast(recipe=pkg.DelayedScaling()):
            with pytest.raises(RuntimeError, match=r'generated for the FP8 recipes \[.current.\], not '
                                                   r'DelayedScaling: add "delayed" to fp8 in \[tool.fusegen\]'):
                module(torch.randn(4, 64))


def test_fewer_rows_than_fp8_min_rows_run_in_high_precision(package):
    """Below the module's fp8_min_rows ([tool.fusegen] fp8_min_rows) a call inside autocast runs
    the high-precision path, and records nothing; from it on, FP8."""
    module = package.Linear()
    module.fp8_min_rows = 16
    x, _ = inputs(24)
    high = module(x)
    with package.autocast(recipe=package.DelayedScaling()):
        assert torch.equal(module(x[:15]), high[:15])
        assert not module._modules["0"].fp8.modes  # no state made, no amax recorded
        assert not torch.equal(module(x[:16]), high[:16])
    assert package.Linear.fp8_min_rows == 0  # as the test package was built


def test_calibrating_runs_high_precision_and_records(package):
    module = package.Linear()
    x, _ = inputs()
    with package.autocast(enabled=False, calibrating=True, recipe=package.DelayedScaling()):
        y = module(x)
    assert torch.allclose(y, x @ module._modules["0"].weight.t() + module._modules["0"].bias, atol=1e-5)
    # the forward update ran on the recorded amax: scale = 448 / amax(x)
    want = f32(448.0 / f32(x.abs().max().item()))
    assert module._modules["0"].fp8.modes["forward"][0][0].item() == want


def _needs_fp8_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need a GPU of compute capability 8.9 or later")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_kernels_match_their_reference(fp8, dtype):
    """The quantize family's casts against the runtime's reference of the same math, bit for bit:
    fp8_amax over one block and many, with a NaN; fp8_cast_e4m3/e5m2 with a given scale (delayed)
    and from an amax (current: epsilon, power of 2), saturating, transposed with rows that are no
    multiple of 16 or 32 and columns no multiple of 256, recording the amax; the row-wise recipe's
    fp8_cast_rows_*, fp8_amax_cols and fp8_cast_cols_* (a row of zeros, with and without the power
    of 2)."""
    _needs_fp8_gpu()
    import generated

    kernels = generated._kernels
    generator = torch.Generator().manual_seed(9)
    for shape in ((8, 16), (77, 200), (1024, 4096), (33, 1032)):
        x = (torch.randn(shape, generator=generator) * 50).to(dtype)
        x[shape[0] // 2, 3] = 700.0  # beyond E4M3's 448 at scale 1: saturates
        gpu = x.cuda()
        assert torch.equal(kernels.fp8_amax(gpu).cpu(), fp8.fp8_reference_amax(x)), shape
        for cast, fp8_dtype in ((kernels.fp8_cast_e4m3, E4M3), (kernels.fp8_cast_e5m2, E5M2)):
            eps = struct.unpack("<i", struct.pack("<f", 2.5))[0]
            for scale, amax, eps_bits, power_2 in ((torch.tensor(1.0), None, 0, 0), (torch.tensor(0.37), None, 0, 0),
                                                   (None, fp8.fp8_reference_amax(x), 0, 0),
                                                   (None, torch.tensor(1.5), eps, 1)):
                for transpose in (0, 1):
                    # the amax max-ed into a given float: one below x's (it rises to it), one above (kept)
                    for start in (1.0, 1e6):
                        want_amax, got_amax = torch.tensor(start), torch.tensor(start).cuda()
                        want = fp8.fp8_reference_cast(x, scale, amax, eps_bits, power_2, transpose, want_amax,
                                                      fp8_dtype)
                        got = cast(gpu, None if scale is None else scale.cuda(), None if amax is None else amax.cuda(),
                                   eps_bits, power_2, transpose, got_amax)
                        assert torch.equal(got_amax.cpu(), want_amax), (shape, start)
                        assert want_amax.item() == (start if start > 1e5 else float(x.abs().max()))
                    for g, w in zip(got, want):
                        g = g.cpu()
                        assert g.dtype == w.dtype and g.shape == w.shape, (shape, g.shape, w.shape)
                        as_bits = (lambda t: t.view(torch.uint8)) if w.dtype in (E4M3, E5M2) else (lambda t: t)
                        assert torch.equal(as_bits(g), as_bits(w)), (shape, fp8_dtype, scale, amax, transpose)
    nan = torch.ones(4096, 8, dtype=dtype)
    nan[1000, 5] = float("nan")
    assert kernels.fp8_amax(nan.cuda()).isnan().item()
    # the row-wise recipe's: per row, per column (amax pass, then the transposing cast)
    for shape in ((8, 16), (77, 200), (600, 1032), (33, 4096)):
        x = (torch.randn(shape, generator=generator) * 30).to(dtype)
        x[0] = 0.0  # a row of zeros: the scale from the 1e-12 floor
        gpu = x.cuda()
        want_amax = fp8.fp8_reference_amax_cols(x)
        assert torch.equal(kernels.fp8_amax_cols(gpu).cpu(), want_amax), shape
        for fmt, fp8_dtype in (("e4m3", E4M3), ("e5m2", E5M2)):
            for power_2 in (0, 1):
                pairs = [(getattr(kernels, f"fp8_cast_rows_{fmt}")(gpu, power_2),
                          fp8.fp8_reference_cast_rows(x, power_2, fp8_dtype)),
                         (getattr(kernels, f"fp8_cast_cols_{fmt}")(gpu, want_amax.cuda(), power_2),
                          fp8.fp8_reference_cast_cols(x, want_amax, power_2, fp8_dtype))]
                for got, want in pairs:
                    for g, w in zip(got, want):
                        g = g.cpu()
                        assert g.dtype == w.dtype and g.shape == w.shape, (shape, g.shape, w.shape)
                        as_bits = (lambda t: t.view(torch.uint8)) if w.dtype in (E4M3, E5M2) else (lambda t: t)
                        assert torch.equal(as_bits(g), as_bits(w)), (shape, fmt, power_2)


# The FP8 emission's kernels that keep their output's amax for its cast (the producers of an FP8
# GEMM's x, and of its output's grad): (kernel, its inputs' widths), each the plain kernel's
# variant named <kernel>_amax.
# (generated.fp8_narrow_mlp's SwiGLU is no multiple of the FP8 variants' 256 columns: fp8_tile.cuh)
AMAX_VARIANTS = [("swiglu_fwd_n320", (640,)), ("swiglu_bwd_n320", (320, 640)), ("bias_swiglu_bwd_n512", (512, 1024))]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kernel,widths", AMAX_VARIANTS, ids=[k for k, _ in AMAX_VARIANTS])
def test_amax_variants_match_their_kernels(kernel, widths, dtype):
    """A kernel's amax variant (templates/cuda/amax.cuh) writes what the plain kernel writes, bit for
    bit, and max-es its first output's amax into the given float: bit for bit the quantize family's
    amax pass over that output (a NaN wins; a larger float is kept); None keeps none. Rows: one, a
    few, more than a grid's row splits (65,535) at the narrow width."""
    _needs_fp8_gpu()
    import generated

    kernels = generated._kernels
    plain, variant = getattr(kernels, kernel), getattr(kernels, kernel + "_amax")
    generator = torch.Generator().manual_seed(11)
    for rows in (1, 3, 513, 70001 if widths[-1] <= 1024 else 2049):
        inputs = [(torch.randn(rows, width, generator=generator) * 4).to(dtype).cuda() for width in widths]
        want = plain(*inputs)
        want = want if isinstance(want, tuple) else (want,)
        want_amax = kernels.fp8_amax(want[0])
        for start in (0.0, 1e30):
            amax = torch.tensor(start, device="cuda")
            got = variant(*inputs, amax)
            got = got if isinstance(got, tuple) else (got,)
            for g, w in zip(got, want):
                assert torch.equal(g, w), (kernel, rows)
            kept = torch.tensor(start).item()  # (start in float32)
            assert amax.item() == (kept if start else want_amax.item()), (kernel, rows, start)
        none = variant(*inputs, None)
        assert torch.equal(none if not isinstance(none, tuple) else none[0], want[0])
    inputs[0][rows // 2, 7] = float("nan")
    amax = torch.zeros((), device="cuda")
    variant(*inputs, amax)
    assert amax.isnan().item(), kernel


# the norm forwards whose output an FP8 GEMM casts: (kernel, hidden, whether it adds a residual)
NORM_AMAX_VARIANTS = [("rmsnorm_fwd_h128", 128, False), ("rmsnorm_fwd_h256", 256, False),
                      ("rmsnorm_fwd_h4096", 4096, False), ("add_rmsnorm_fwd_h4096", 4096, True)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kernel,hidden,residual", NORM_AMAX_VARIANTS, ids=[k for k, _, _ in NORM_AMAX_VARIANTS])
def test_norm_amax_variants_match_their_kernels(kernel, hidden, residual, dtype):
    """A norm forward's amax variant (norm.cuh with amax.cuh) writes what the plain kernel writes
    (y, the sum, the statistics), bit for bit, with and without autograd, and max-es y's amax into
    the given float: bit for bit the quantize family's amax pass over y (a larger float is kept, a
    NaN wins); None keeps none."""
    _needs_fp8_gpu()
    import generated

    kernels = generated._kernels
    plain, variant = getattr(kernels, kernel), getattr(kernels, kernel + "_amax")
    generator = torch.Generator().manual_seed(12)
    for rows in (1, 3, 513, 4099):
        x = (torch.randn(rows, hidden, generator=generator) * 4).to(dtype).cuda()
        inputs = [x, *([torch.randn(rows, hidden, generator=generator).to(dtype).cuda()] if residual else []),
                  (torch.rand(hidden, generator=generator) + 0.5).to(dtype).cuda()]
        want = plain(*inputs)
        want_amax = kernels.fp8_amax(want[0])
        for start in (0.0, 1e30):
            amax = torch.tensor(start, device="cuda")
            got = variant(*inputs, amax)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (kernel, rows)
            assert amax.item() == (torch.tensor(start).item() if start else want_amax.item()), (kernel, rows, start)
        amax = torch.zeros((), device="cuda")
        no_grad = getattr(kernels, kernel + "_amax_no_grad")(*inputs, amax, *([True] if residual else []))
        no_grad = no_grad if isinstance(no_grad, tuple) else (no_grad,)
        assert all(torch.equal(g, w) for g, w in zip(no_grad, want)) and amax.item() == want_amax.item()
        assert torch.equal(variant(*inputs, None)[0], want[0])
    x[rows // 2, 7] = float("nan")
    amax = torch.zeros((), device="cuda")
    variant(*inputs, amax)
    assert amax.isnan().item(), kernel


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [40, 100])
def test_fp8_variants_write_what_the_cast_of_the_plain_kernel_writes(dtype, rows):
    """A kernel's FP8 variant (templates/cuda/fp8_tile.cuh: SwiGLU forward and backward at 14336,
    generated.llama_mlp's) writes, bit for bit, what its plain kernel followed by fp8_cast writes:
    the FP8 tensor, its transpose (zeros past the rows, padded to 16) and the scale's inverse, with
    a given scale (delayed) or TE's from the amax its stores-off launch keeps (current), in either
    format; the amax it keeps is fp8_amax's of the plain output. Rows that fill no whole tile."""
    _needs_fp8_gpu()
    import generated

    kernels = generated._kernels
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 28672, generator=generator) * 3).to(dtype).cuda()
    dy = (torch.randn(rows, 14336, generator=generator) * 3).to(dtype).cuda()
    runs = [(kernels.swiglu_fwd_n14336_fp8, kernels.swiglu_fwd_n14336(x), (x,)),
            (kernels.swiglu_bwd_n14336_fp8, kernels.swiglu_bwd_n14336(dy, x), (dy, x))]
    for variant, plain, inputs in runs:
        want_amax = kernels.fp8_amax(plain)
        for e5m2 in (0, 1):
            cast = kernels.fp8_cast_e5m2 if e5m2 else kernels.fp8_cast_e4m3
            # delayed: the given scale, the amax max-ed into a slot
            scale, kept = torch.tensor(0.37, device="cuda"), torch.zeros((), device="cuda")
            got = variant(*inputs, scale, None, kept, e5m2, 0, 0, 1, 1)
            want = cast(plain, scale, None, 0, 0, 1, None)
            assert torch.equal(kept, want_amax)
            # current: the amax alone (nothing stored), then the stores with TE's scale from it
            amax = torch.zeros((), device="cuda")
            empty = variant(*inputs, None, None, amax, e5m2, 0, 0, 0, 0)
            assert torch.equal(amax, want_amax) and empty[0].numel() == 0 and empty[1].numel() == 0
            got_current = variant(*inputs, None, amax, None, e5m2, 0, 1, 1, 1)
            want_current = cast(plain, None, amax, 0, 1, 1, None)
            for a, b in ((got, want), (got_current, want_current)):
                assert a[0].dtype == b[0].dtype and a[1].shape == b[1].shape == (plain.shape[1], -(-rows // 16) * 16)
                for t, u in zip(a, b):
                    assert torch.equal(t.view(torch.uint8) if t.dtype != torch.float32 else t,
                                       u.view(torch.uint8) if u.dtype != torch.float32 else u), (variant.__name__, e5m2)
            assert variant(*inputs, scale, None, None, e5m2, 0, 0, 0, 1)[1].numel() == 0  # no transpose asked


@pytest.mark.cuda
def test_delayed_update_kernel_matches_its_reference(fp8):
    """fp8_delayed_update against its torch reference, bit for bit: histories of 1, 2, 16, 300 (two
    passes of a block's rows, the second partial) and 1,024 rows (TE's default) with zeros (no
    roll), inf and NaN amaxes, a reduced amax given or not (0 where given: the history's own), "max"
    and "most_recent", and a scaled max that overflows a tiny amax."""
    _needs_fp8_gpu()
    import generated

    generator = torch.Generator().manual_seed(11)
    for length in (1, 2, 16, 300, 1024):
        history = torch.rand(length, 37, generator=generator) * 100
        history[length - 1, 9] = 1e4  # the window's max in its last row (the first a block's last pass reads)
        history[:, 3] = 0.0
        history[0, 5], history[0, 6], history[0, 7] = float("inf"), float("nan"), 1e-38
        history[2 % length, 8] = float("nan")
        scale = torch.rand(37, generator=generator) + 0.5
        for amax in (None, torch.where(torch.rand(37, generator=generator) < 0.3, 0.0,
                                       torch.rand(37, generator=generator) * 200)):
            for most_recent in (0, 1):
                bits = int(torch.tensor(448.0 * 2 ** -2).view(torch.int32))
                want = fp8.fp8_reference_delayed_update(history.clone(), scale.clone(), amax, most_recent, bits)
                got = generated._kernels.fp8_delayed_update(history.cuda(), scale.cuda(),
                                                            None if amax is None else amax.cuda(), most_recent, bits)
                for g, w in zip(got, want):
                    assert torch.equal(g.cpu().nan_to_num(nan=-1.0), w.nan_to_num(nan=-1.0)), (length, most_recent)


@pytest.mark.cuda
@pytest.mark.parametrize("a_dtype, b_dtype", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_on_the_gpu(fp8, a_dtype, b_dtype, rowwise):
    """torch._scaled_mm of FP8 operands and their scales against the float64 product of the same
    FP8 values: within the FP8 tensor cores' accumulation (Hopper's adds in fewer bits than fp32:
    2**-10 of the sum of |products|), in fp32, bf16 (one more rounding) and with a bias."""
    _needs_fp8_gpu()
    generator = torch.Generator().manual_seed(5)
    a = (torch.randn(40, 256, generator=generator) * 3).to(a_dtype).cuda()
    b = (torch.randn(96, 256, generator=generator) * 3).to(b_dtype).cuda()
    if rowwise:
        sa, sb = torch.rand(40, 1, generator=generator).cuda() + 0.5, torch.rand(96, 1, generator=generator).cuda() + 0.5
    else:
        sa, sb = torch.tensor(0.75).cuda(), torch.tensor(1.5).cuda()
    bias = torch.randn(96, generator=generator).cuda()
    exact = (a.double() * sa.double()) @ (b.double() * (sb.double() if not rowwise else sb.double())).t()
    bound = (a.double().abs() * sa.double()) @ (b.double().abs() * sb.double()).t()
    for out_dtype, rounding in ((torch.float32, 0.0), (torch.bfloat16, 2.0 ** -8)):
        got = fp8.scaled_mm(fp8._Quantized(a, sa), fp8._Quantized(b, sb), out_dtype, bias.to(out_dtype))
        want = exact + bias.to(out_dtype).double()
        err = (got.double() - want).abs()
        assert (err <= 2.0 ** -10 * bound + rounding * want.abs() + 1e-6).all(), err.max()


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
@pytest.mark.parametrize("name, width", [("Fp8LayernormMlp", 256), ("Fp8NarrowMlp", 128)])
def test_generated_mlp_on_the_gpu_matches_its_emulation(recipe, name, width):
    """generated.Fp8LayernormMlp (TE's LayerNormMLP: RMSNorm, two GEMMs, SwiGLU; its SwiGLU writes
    its FP8 operand) and Fp8NarrowMlp (te.ops; its SwiGLU keeps its outputs' amaxes for the casts)
    in bf16 under each recipe on the GPU (their kernels, torch._scaled_mm) against the same module
    on the CPU (the reference math, the FP8 GEMMs emulated): output, x's grad and every
    parameter's, within TE's FP8 tolerances of the largest value, over two steps (delayed
    scaling's second casts with the scales the first's updates made, which both compute alike)."""
    _needs_fp8_gpu()
    import generated

    made = {"current": generated.Float8CurrentScaling(), "delayed": generated.DelayedScaling(),
            "rowwise": generated.Float8RowwiseScaling()}[recipe]
    torch.manual_seed(6)
    cpu = getattr(generated, name)(dtype=torch.bfloat16)
    cpu.fp8_min_rows = 0  # FP8 at this size too (the package's default runs it in bf16)
    for parameter in cpu.parameters():
        torch.nn.init.normal_(parameter, 0.3, 0.2)
    gpu = copy.deepcopy(cpu).cuda()
    for step in range(2):
        x = torch.randn(48, width, dtype=torch.bfloat16) * 2
        dy = torch.randn(48, width, dtype=torch.bfloat16)
        results = []
        for module, device in ((cpu, "cpu"), (gpu, "cuda")):
            xd = x.to(device).requires_grad_(True) if device == "cuda" else x.clone().requires_grad_(True)
            with generated.autocast(recipe=made):
                y = module(xd)
            y.backward(dy.to(device))
            results.append([y, xd.grad, *(p.grad for p in module.parameters())])
            module.zero_grad()
        for got, want in zip(results[1], results[0]):
            scale = want.double().abs().max()
            assert torch.allclose(got.cpu().double() / scale, want.double() / scale, **FP8_TOLS[E5M2]), step
        if recipe == "delayed":
            for a, b in zip(cpu.modules(), gpu.modules()):
                if isinstance(a.__dict__.get("fp8"), generated._runtime.Fp8State):
                    torch.testing.assert_close(b.fp8.modes["forward"][0].cpu(), a.fp8.modes["forward"][0],
                                               rtol=2e-2, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_training_steps_captured_in_a_cuda_graph_replay_as_steps(recipe):
    """A user's CUDA graph of a whole training step (autocast, forward, backward) of
    generated.Fp8LayernormMlp, replayed with its weights changed in place between replays (as an
    optimizer does), against the same steps run eagerly by a copy: each replay casts the weights as
    they then are (the capture casts them, caching nothing) and updates delayed scaling's forward
    and backward scales and histories as a step does (both updates are captured). Output, every
    parameter's grad and the scaling state after each of four replays."""
    _needs_fp8_gpu()
    import generated

    made = {"current": generated.Float8CurrentScaling(), "delayed": generated.DelayedScaling(amax_history_len=4),
            "block": generated.Float8BlockScaling()}[recipe]
    torch.manual_seed(8)
    eager = generated.Fp8LayernormMlp(device="cuda", dtype=torch.bfloat16)
    eager.fp8_min_rows = 0
    for parameter in eager.parameters():
        torch.nn.init.normal_(parameter, 0.0, 0.05)
    graphed = copy.deepcopy(eager)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step(module):
        with generated.autocast(recipe=made):
            y = module(x)
        y.backward(dy)
        return y

    def state_of(module):
        holder = module._modules["0"].fp8
        return [t.clone() for mode in sorted(holder.modes) for t in holder.modes[mode]]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up steps, as torch.cuda.graph asks; the copy runs them too
        for _ in range(3):
            step(graphed)
            graphed.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    for _ in range(3):
        step(eager)
        eager.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(graphed)
    generator = torch.Generator(device="cuda").manual_seed(3)
    for replay in range(4):
        with torch.no_grad():  # an optimizer's in-place change, the same to both
            for a, b in zip(eager.parameters(), graphed.parameters()):
                change = torch.randn(a.shape, device="cuda", generator=generator, dtype=a.dtype) * 0.01
                a.add_(change)
                b.add_(change)
        want_y = step(eager)
        graph.replay()
        torch.cuda.synchronize()
        # the same kernels on the same values: equal but where cuBLAS picks another algorithm for a
        # captured GEMM, within two bf16 roundings (a stale FP8 weight is off by the 20% change,
        # a missed update by a whole history row)
        pairs = [(static_y, want_y), *((b.grad, a.grad) for a, b in zip(eager.parameters(), graphed.parameters())),
                 *zip(state_of(graphed), state_of(eager))]
        for got, want in pairs:
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.abs().max().item())
        eager.zero_grad(set_to_none=True)


@pytest.mark.cuda
def test_fp8_calls_under_torch_compile_on_the_gpu():
    """generated.Fp8LayernormMlp compiled with inductor on the GPU, called inside autocast (current
    scaling) between the caller's compiled ops: its FP8 call runs outside the graph, so output,
    x's grad and every parameter's equal the uncompiled module's bit for bit over three steps."""
    _needs_fp8_gpu()
    import generated

    torch._dynamo.reset()
    torch.manual_seed(9)
    eager = generated.Fp8LayernormMlp(device="cuda", dtype=torch.bfloat16)
    eager.fp8_min_rows = 0
    module = copy.deepcopy(eager)

    def caller(mlp, x):
        return mlp(x * 2) * 0.5  # (exact in bf16: compiled or not, the same values)

    compiled = torch.compile(lambda x: caller(module, x))
    for step in range(3):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        results = []
        for run, owner in ((compiled, module), (lambda t: caller(eager, t), eager)):
            xi = x.clone().requires_grad_(True)
            with generated.autocast(recipe=generated.Float8CurrentScaling()):
                y = run(xi)
            y.sum().backward()
            results.append([y, xi.grad, *(p.grad for p in owner.parameters())])
            owner.zero_grad(set_to_none=True)
        for got, want in zip(*results):
            assert torch.equal(got, want), step


def _gpu_package(tmp_path, spec, name, **options):
    """``spec`` built in bf16 for every recipe with binaries for this GPU (the cuda tests' own build:
    the checked-in package holds no Quantize and no user module)."""
    major, minor = torch.cuda.get_device_capability()
    return imported_package(tmp_path, "spec.py", spec, name, dtypes=("bfloat16",), fp8=("delayed", "current", "rowwise"),
                            archs=(f"sm_{major}{minor}",), **options)


GPU_RECIPES = {"current": lambda pkg: pkg.Float8CurrentScaling(), "rowwise": lambda pkg: pkg.Float8RowwiseScaling(),
               "delayed": lambda pkg: pkg.DelayedScaling(amax_history_len=1)}


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
def test_quantize_pipelines_on_the_gpu(tmp_path, recipe):
    """te.ops.Quantize on the GPU (its casts through the package's kernels, torch._scaled_mm): next
    to a Linear, y, x's grad and W's equal the plain Linear's bit for bit at each step, as on
    the CPU; at the pipeline's ends (current and delayed scaling), y and x's grad are the plain
    Linear's cast with their own amax's scale and back, within a bf16 rounding of that float64
    value (delayed, a history of one step: the last of three steps on the same inputs, whose
    scales are the amaxes of the one before); and each module matches its CPU emulation within
    TE's FP8 tolerances of the largest value, over five steps."""
    _needs_fp8_gpu()
    with _gpu_package(tmp_path, LINEAR, "fp8_quantize_gpu_pkg") as pkg:
        torch.manual_seed(4)
        cpu = {"quantized": pkg.Quantized(dtype=torch.bfloat16), "plain": pkg.Plain(dtype=torch.bfloat16),
               "ends": pkg.Ends(dtype=torch.bfloat16)}
        with torch.no_grad():
            cpu["plain"]._modules["0"].weight.copy_(cpu["quantized"]._modules["1"].weight)
            cpu["ends"]._modules["1"].weight.copy_(cpu["quantized"]._modules["1"].weight)
        gpu = {name: copy.deepcopy(module).cuda() for name, module in cpu.items()}
        names = ["quantized", "plain"] + (["ends"] if recipe != "rowwise" else [])
        # the last three steps on the same inputs: delayed scaling's last scales are its amaxes (the
        # second of them settles x's and dy's scales, so the third's y and dx are the second's)
        for step, seed in enumerate((40, 41, 42, 42, 42)):
            x, dy = (t.to(torch.bfloat16) for t in inputs(seed=seed))
            results = {}
            for device, modules in (("cpu", cpu), ("cuda", gpu)):
                for name in names:
                    xi = x.to(device, copy=True).requires_grad_(True)
                    with pkg.autocast(recipe=GPU_RECIPES[recipe](pkg)):
                        y = modules[name](xi)
                    y.backward(dy.to(device))
                    weight = modules[name]._modules["0" if name == "plain" else "1"].weight
                    results[device, name] = (y.detach(), xi.grad, weight.grad.clone())
                    weight.grad = None
            for got, want in zip(results["cuda", "quantized"], results["cuda", "plain"]):
                assert torch.equal(got, want), (recipe, step)
            for name in names:
                for got, want in zip(results["cuda", name], results["cpu", name]):
                    scale = want.double().abs().max()
                    assert torch.allclose(got.cpu().double() / scale, want.double() / scale, **FP8_TOLS[E5M2]), (name, step)
        if recipe == "rowwise":
            return
        (y_ends, dx_ends, _), (y_plain, dx_plain, _) = results["cuda", "ends"], results["cuda", "plain"]
        for got, plain, fmt, fp8_max in ((y_ends, y_plain, E4M3, 448.0), (dx_ends, dx_plain, E5M2, 57344.0)):
            want = reference_current(plain.float().cpu(), fmt, fp8_max)
            torch.testing.assert_close(got.cpu().double(), want, rtol=2 ** -8, atol=0)
            assert not torch.equal(got, plain)  # (cast: not as it was)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
def test_fp8_around_a_users_module_on_the_gpu(tmp_path, recipe):
    """A pipeline running a module of the user's code, built for FP8, on the GPU: its FP8
    Functions around the module compute what the two pipelines around it and the module between
    them compute, bit for bit (output, x's grad, every parameter's) over three steps, and match the
    same module's CPU emulation within TE's FP8 tolerances of the largest value."""
    _needs_fp8_gpu()
    with _gpu_package(tmp_path, USER_SPEC, "user_fp8_gpu_pkg", files={"fp8_user_layers.py": USER_LAYERS}) as pkg:
        torch.manual_seed(5)
        cpu = pkg.Mixed(dtype=torch.bfloat16)
        cpu.fp8_min_rows = 0
        mixed = copy.deepcopy(cpu).cuda()
        first, mixer, second = split_like(pkg, mixed, dtype=torch.bfloat16, device="cuda")
        for step in range(3):
            x, dy = torch.randn(3, 16, 64, dtype=torch.bfloat16), torch.randn(3, 16, 48, dtype=torch.bfloat16)
            xa, xb, xc = (x.cuda().requires_grad_(True), x.cuda().requires_grad_(True), x.clone().requires_grad_(True))
            ys = []
            for run, xi, d in ((mixed, xa, dy.cuda()), (lambda t: second(mixer(first(t))), xb, dy.cuda()), (cpu, xc, dy)):
                with pkg.autocast(recipe=GPU_RECIPES[recipe](pkg)):  # one each: its own scaling update
                    ys.append(run(xi))
                ys[-1].backward(d)
            ya, yb, yc = ys
            split = [first._modules["0"].weight, first._modules["0"].bias, mixer.gate, second._modules["0"].weight]
            for got, want in zip([ya, xa.grad, *(p.grad for p in mixed.parameters())], [yb, xb.grad, *(p.grad for p in split)]):
                assert torch.equal(got, want), (recipe, step)
            for got, want in zip([ya, xa.grad, *(p.grad for p in mixed.parameters())], [yc, xc.grad, *(p.grad for p in cpu.parameters())]):
                scale = want.double().abs().max()
                assert torch.allclose(got.cpu().double() / scale, want.double() / scale, **FP8_TOLS[E5M2]), (recipe, step)
            for module in (mixed, first, second, mixer, cpu):
                module.zero_grad(set_to_none=True)


# --- delayed scaling under torch.distributed --------------------------------------------------------

def _delayed_step(module, x):
    """One training step of ``module`` on ``x`` under delayed scaling; its holder's scales after it
    (forward, backward)."""
    import generated

    with generated.autocast(recipe=generated.DelayedScaling(amax_history_len=4)):
        y = module(x)
    y.square().sum().backward()
    state = module.module._modules["0"].fp8 if hasattr(module, "module") else module._modules["0"].fp8
    return state.modes["forward"][0].clone(), state.modes["backward"][0].clone()


def _fp8_module():
    import generated

    torch.manual_seed(0)
    module = generated.Fp8LayernormMlp()  # fp32 on the CPU: the recipe emulated
    module.fp8_min_rows = 0
    return module


def _fp8_ddp_worker(rank, world, port, batch, result):
    from test_training import _process_group

    with _process_group(rank, world, port):
        ddp = torch.nn.parallel.DistributedDataParallel(_fp8_module())
        result[rank] = _delayed_step(ddp, batch.chunk(world)[rank])


def test_delayed_scaling_reduces_amaxes_across_ddp_ranks():
    """Under DDP (two gloo processes) delayed scaling's amaxes are reduced (max) over the default
    group before each update, as TE's reduce_amax: both ranks end the step with the same scales,
    the smaller of what each rank's shard alone gives (scale = max / amax), forward and backward."""
    from test_training import _on_two_ranks

    batch = torch.randn(32, 256) * torch.cat([torch.ones(16, 1), 3 * torch.ones(16, 1)])  # rank 1's larger
    ranks = _on_two_ranks(_fp8_ddp_worker, batch)
    alone = [_delayed_step(_fp8_module(), shard) for shard in batch.chunk(2)]
    for mode in range(2):
        assert torch.equal(ranks[0][mode], ranks[1][mode])
        assert torch.equal(ranks[0][mode], torch.minimum(alone[0][mode], alone[1][mode]))
        assert not torch.equal(alone[0][mode], alone[1][mode])  # (the shards' amaxes differ)


def training_losses(package, recipe, width, steps=60):
    """The losses of package.Mlp (``width`` features) fitted with Adam to a fixed target, each step
    inside autocast with ``recipe`` (None: high precision)."""
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(256, width, generator=generator)
    target = torch.tanh(x @ torch.randn(width, width, generator=generator) / 8)
    torch.manual_seed(13)
    module = package.Mlp()
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    curve = []
    for _ in range(steps):
        with package.autocast(enabled=recipe is not None, recipe=recipe or package.Float8CurrentScaling()):
            loss = (module(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append(loss.item())
    return curve


@pytest.mark.parametrize("recipe", ["current", "delayed", "rowwise"])
def test_training_under_fp8_follows_high_precision(package, recipe):
    """A small MLP (RMSNorm, Linear, SwiGLU, Linear) fitted to a fixed target for 60 Adam steps
    under each recipe tracks the same training in high precision: the loss falls by more than 3x
    in both, and at every step from the 10th on the FP8 loss is within 10% of the high-precision
    one (FP8's operands carry 3 mantissa bits: TE's FP8 loss curves overlay bf16's, their gap a few
    percent)."""
    made = {"current": package.Float8CurrentScaling(), "delayed": package.DelayedScaling(amax_history_len=16),
            "rowwise": package.Float8RowwiseScaling()}[recipe]
    high, low = (training_losses(package, None, 64), training_losses(package, made, 64))
    assert high[-1] < high[0] / 3 and low[-1] < low[0] / 3, (high[-1], low[-1])
    for step in range(10, 60):
        assert abs(low[step] - high[step]) <= 0.1 * high[step], (step, low[step], high[step])


USER_LAYERS = """import torch


class Mixer(torch.nn.Module):
    def __init__(self, features, scale=0.5):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.linspace(-1, 1, features))
        self.scale = scale

    def forward(self, x):
        return x + torch.tanh(x.cumsum(dim=-2) * self.scale) * self.gate
"""
USER_SPEC = """import transformer_engine.pytorch as te
from fp8_user_layers import Mixer

mixed = te.ops.Sequential(te.ops.Linear(64, 64), te.ops.GELU(), Mixer(64, scale=0.25), te.ops.Linear(64, 48, bias=False))
first = te.ops.Sequential(te.ops.Linear(64, 64), te.ops.GELU())
second = te.ops.Sequential(te.ops.Linear(64, 48, bias=False))
"""


def split_like(pkg, mixed, **options):
    """USER_SPEC's two pipelines around the user's module and a copy of the module, holding the
    parameters of ``mixed`` (FP8 at any size)."""
    first, second = pkg.First(**options), pkg.Second(**options)
    for module in (first, second):
        module.fp8_min_rows = 0
    with torch.no_grad():
        first._modules["0"].weight.copy_(mixed._modules["0"].weight)
        first._modules["0"].bias.copy_(mixed._modules["0"].bias)
        second._modules["0"].weight.copy_(mixed._modules["3"].weight)
    return first, copy.deepcopy(mixed._modules["2"]), second


def test_fp8_around_a_module_of_the_users_code(tmp_path):
    """A pipeline that runs a module of the user's code, built for FP8 ([tool.fusegen] fp8 builds
    it too): its FP8 Functions around the module compute what the two pipelines around it, built
    for FP8, and the module between them compute, bit for bit: output, x's grad, every parameter's
    (the module's too), over three steps of each recipe; delayed scaling's state follows alike (one
    update a call, after the backward of its first Function), and the no-grad forward as well."""
    with imported_package(tmp_path, "spec.py", USER_SPEC, "user_fp8_pkg", fp8=("delayed", "current", "rowwise"),
                          files={"fp8_user_layers.py": USER_LAYERS}) as pkg:
        torch.manual_seed(0)
        mixed = pkg.Mixed()
        mixed.fp8_min_rows = 0
        first, mixer, second = split_like(pkg, mixed)
        x, dy = torch.randn(3, 8, 64), torch.randn(3, 8, 48)
        recipes = {"current": pkg.Float8CurrentScaling, "rowwise": pkg.Float8RowwiseScaling,
                   "delayed": lambda: pkg.DelayedScaling(amax_history_len=2)}
        for recipe, make in recipes.items():
            for step in range(3):
                xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
                with pkg.autocast(recipe=make()):
                    ya = mixed(xa)
                ya.backward(dy)
                with pkg.autocast(recipe=make()):
                    yb = second(mixer(first(xb)))
                yb.backward(dy)
                pairs = [(ya, yb), (xa.grad, xb.grad), (mixed._modules["0"].weight.grad, first._modules["0"].weight.grad),
                         (mixed._modules["0"].bias.grad, first._modules["0"].bias.grad),
                         (mixed._modules["3"].weight.grad, second._modules["0"].weight.grad),
                         (mixed._modules["2"].gate.grad, mixer.gate.grad)]
                for got, want in pairs:
                    assert torch.equal(got, want), (recipe, step)
                for module in (mixed, first, second, mixer):
                    module.zero_grad(set_to_none=True)
            if recipe == "delayed":
                for (a, b) in ((mixed._modules["0"].fp8, first._modules["0"].fp8),
                               (mixed._modules["3"].fp8, second._modules["0"].fp8)):
                    for mode in ("forward", "backward"):
                        for got, want in zip(a.modes[mode], b.modes[mode]):
                            assert torch.equal(got, want), mode
        with torch.no_grad(), pkg.autocast(recipe=pkg.Float8CurrentScaling()):
            assert torch.equal(mixed(x), second(mixer(first(x))))


# --- build configuration ---------------------------------------------------------------------------

FP8_PROJECT = """import transformer_engine.pytorch as te

mlp = te.ops.Sequential(te.ops.Linear(64, 96), te.ops.GELU(), te.ops.Linear(96, 64))
act = te.ops.Sequential(te.ops.GELU())
"""


@pytest.mark.parametrize("table, spec, message", [
    ('fp8 = ["fast"]', FP8_PROJECT, "fp8 must be a list of FP8 recipes from ['delayed', 'current', 'rowwise', 'block']"),
    ("fp8_min_rows = -1", FP8_PROJECT, "fp8_min_rows must be an integer"),
    ('[tool.fusegen.pipelines.act]\nfp8 = ["current"]', FP8_PROJECT,
     "pipeline 'act' (spec.py:4:7) has no Linear, so nothing of it runs in FP8; remove the setting"),
    ('[tool.fusegen.pipelines.mpl]\nfp8 = ["current"]', FP8_PROJECT, "names no pipeline of the specs; did you mean 'mlp'?"),
    ('fp8 = ["current"]', FP8_PROJECT.replace("96", "90"),
     "BasicLinear(64, 90): out_features=90 is not a multiple of 16, which FP8 GEMMs need (TE's rule)"),
    ('fp8 = ["current"]', FP8_PROJECT.replace("te.ops.GELU(), te.ops.Linear", "te.ops.Quantize(), te.ops.GELU(), te.ops.Linear"),
     "Quantize(forward=True) in pipeline 'mlp', built for FP8 ([tool.fusegen] fp8), is generated where it casts a "
     "Linear's input (TE's use: the Linear right after it takes the FP8 tensor) or at the pipeline's end; the op "
     "after it is GELU: put it next to a Linear"),
    ('fp8 = ["current"]', FP8_PROJECT.replace("te.ops.GELU()", "te.ops.Quantize(forward=False, backward=True), te.ops.GELU()"),
     "the op before it is Bias (of Linear(64, 96))"),
])
def test_fp8_settings_are_checked(tmp_path, monkeypatch, capsys, table, spec, message):
    """A bad fp8 setting, or a GEMM FP8 cannot run, is a clear error (exit 2) naming what to do."""
    from fusegen import cli

    (tmp_path / "spec.py").write_text(spec)
    (tmp_path / "pyproject.toml").write_text(f'[tool.fusegen]\nspecs = ["spec.py"]\n{table}\n')
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan"]) == 2
    assert message in capsys.readouterr().err


def test_a_package_of_16_bit_activations_builds_delayed_scalings_update_for_its_fp32_state(tmp_path):
    """The update kernel reads and writes the fp32 scales and histories alone: a package built for
    bf16 activations only has its fp32 entry point (which the launcher launches) and no other."""
    from fusegen import build

    (tmp_path / "spec.py").write_text(FP8_PROJECT)
    config = build.Config((tmp_path / "spec.py",), tmp_path / "out", archs=(), dtypes=("bfloat16",), root=tmp_path,
                          fp8=("delayed",))
    files = build.build_package(config)
    source = files["kernels/fp8_delayed_update.cu"].decode()
    assert "void __launch_bounds__(256) fp8_delayed_update_fp32(" in source and "_bf16(" not in source
    assert "fp8_amax_bf16(" in files["kernels/fp8_amax.cu"].decode()  # (the casts read the activations)
    assert "_FP8_DELAYED_UPDATE.launch(\n            torch.float32," in files["_kernels.py"].decode()


def test_quantize_at_an_end_of_a_pipeline_with_a_user_module_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Its FP8 round trip is not generated for a pipeline that runs a module of the user's code: an
    error at the Quantize naming what to do (exit 2)."""
    from fusegen import cli

    (tmp_path / "fp8_user_layers.py").write_text(USER_LAYERS)  # (a name of its own: sys.modules)
    (tmp_path / "spec.py").write_text(USER_SPEC.replace("te.ops.Linear(64, 48, bias=False))\nfirst",
                                                        "te.ops.Linear(64, 48, bias=False), te.ops.Quantize())\nfirst"))
    (tmp_path / "pyproject.toml").write_text('[tool.fusegen]\nspecs = ["spec.py"]\nfp8 = ["current"]\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["plan"]) == 2
    assert "Quantize(forward=True) at the end of pipeline 'mixed', built for FP8 ([tool.fusegen] fp8), which runs a " \
           "module of your code: the FP8 round trip there is not generated yet" in capsys.readouterr().err


def test_fp8_builds_only_pipelines_with_a_gemm(tmp_path, monkeypatch):
    """[tool.fusegen] fp8 builds every pipeline with a Linear for FP8; the others as before."""
    from fusegen import build
    from fusegen.config import load_config

    (tmp_path / "spec.py").write_text(FP8_PROJECT)
    (tmp_path / "pyproject.toml").write_text('[tool.fusegen]\nspecs = ["spec.py"]\nfp8 = ["rowwise", "delayed"]\n'
                                             'fp8_min_rows = 512\n')
    config = load_config([], None, None, None, None, supported_archs=None, cwd=tmp_path)
    plans = {plan.pipeline.name: plan.pipeline.fp8 for plan in build.load_plans(config)}
    assert plans["act"] is None
    assert (plans["mlp"].recipes, plans["mlp"].min_rows) == (("delayed", "rowwise"), 512)


def test_te_checkpoint_state_loads_without_te(package):
    """TE's _extra_state pickles TE's recipe objects (transformer_engine.common.recipe): a payload
    made with classes of those names loads where TE is not installed, its recipe read as the
    package's mirror (a field only TE has, backward_override, dropped), its scales and history kept."""
    import collections
    import dataclasses
    import enum
    import pickle
    import sys
    import types

    name = "transformer_engine.common.recipe"
    te = types.ModuleType(name)
    helper = collections.namedtuple("_FormatHelper", ["max_fwd", "max_bwd"])  # TE's Format values
    helper.__module__ = name
    te._FormatHelper = helper
    te.Format = enum.Enum("Format", [("E4M3", helper(448, 448)), ("E5M2", helper(57344, 57344)),
                                     ("HYBRID", helper(448, 57344))], module=name, qualname="Format")

    @dataclasses.dataclass
    class DelayedScaling:  # TE's fields, in its order
        margin: int = 0
        fp8_format: object = te.Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: object = "max"
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False
        backward_override: object = None

    DelayedScaling.__module__, DelayedScaling.__qualname__ = name, "DelayedScaling"
    te.DelayedScaling = DelayedScaling
    modules = {"transformer_engine": types.ModuleType("transformer_engine"),
               "transformer_engine.common": types.ModuleType("transformer_engine.common"), name: te}
    recipe = DelayedScaling(margin=2, fp8_format=te.Format.E4M3, amax_history_len=8)
    payload = {mode: {"recipe": recipe, f"scale_{tag}": torch.full((n,), 3.0), f"amax_history_{tag}": torch.ones(8, n),
                      "extra_fp8_variables": {}} for mode, tag, n in (("forward", "fwd", 2), ("backward", "bwd", 1))}
    saved = {key: sys.modules.get(key) for key in modules}
    sys.modules.update(modules)
    try:
        raw = pickle.dumps(payload)
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key)
            else:
                sys.modules[key] = module
    assert "transformer_engine" not in sys.modules or saved["transformer_engine"] is not None
    module = package.Linear()
    state = module.state_dict()
    state["0._extra_state"] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    module.load_state_dict(state)
    holder = module._modules["0"].fp8
    assert holder.recipe == package.DelayedScaling(margin=2, fp8_format=package.Format.E4M3, amax_history_len=8)
    assert torch.equal(holder.modes["forward"][0], torch.full((2,), 3.0))
    assert torch.equal(holder.modes["backward"][1], torch.ones(8, 1))
