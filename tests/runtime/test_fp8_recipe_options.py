"""FP8 recipe options as TE reads them (issue 40): each GEMM's accumulation from the recipe's
MMParams (TE's use_split_accumulator; DelayedScaling's module constants), each cast's scale
options from the QParams of its role (input, weight, grad: TE's modules copy them onto their
quantizers), and ``backward_override`` (the backward's GEMMs in high precision, on the forward's
operands as they were or on their FP8 values dequantized), against float64 references."""

import copy

import pytest
import torch

from tests.runtime.test_fp8 import E4M3, E5M2, FP8_TOLS, _needs_fp8_gpu, close_to_float64, quantized, te_current_scale
from tests.runtime.test_fp8_blocks import SPEC, block_quantized
from tests.spec_packages import imported_package


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8_options")
    with imported_package(folder, "spec.py", SPEC, "fp8_options_pkg", fp8=("delayed", "current", "block")) as pkg:
        yield pkg


def current(t, dtype, power_2=False):
    """t quantized with current scaling (one scale from t's amax), float64."""
    return quantized(t, te_current_scale(t.abs().max().item(), torch.finfo(dtype).max, power_2=power_2), dtype)


def step(package, recipe, rows=200, seed=1):
    """One training step of package.Linear (128 -> 256) under ``recipe``: (module, x, dy, y, x's grad)."""
    torch.manual_seed(seed)
    module = package.Linear()
    x = (torch.randn(rows, 128) * torch.exp(torch.randn(rows, 1))).requires_grad_(True)
    dy = torch.randn(rows, 256) * torch.exp(torch.randn(1, 256))
    with package.autocast(recipe=recipe):
        y = module(x)
    y.backward(dy)
    return module, x, dy, y, x.grad


def fast_flags(package, recipe, monkeypatch):
    """{"fprop", "dgrad", "wgrad": the use_fast_accum each of a Linear's GEMMs was called with}."""
    runtime = package._runtime.fp8
    calls = {}
    shapes = {(200, 256): "fprop", (200, 128): "dgrad", (256, 128): "wgrad"}

    def scaled_mm(a, b, out_dtype, bias=None, fast_accum=False):
        calls[shapes[(a.data.shape[0], b.data.shape[0])]] = fast_accum
        return original(a, b, out_dtype, bias, fast_accum)

    original = runtime.scaled_mm
    monkeypatch.setattr(runtime, "scaled_mm", scaled_mm)
    step(package, recipe)
    return calls


def test_mmparams_choose_each_gemms_accumulation(package, monkeypatch):
    """TE's defaults (the forward fast, the grads' GEMMs split), a Float8CurrentScaling whose
    MMParams turn them round, and block scaling, split everywhere."""
    MMParams = package.MMParams  # (the package exports TE's option classes)
    default = {"fprop": True, "dgrad": False, "wgrad": False}
    assert fast_flags(package, package.DelayedScaling(), monkeypatch) == default
    assert fast_flags(package, package.Float8CurrentScaling(), monkeypatch) == default
    turned = package.Float8CurrentScaling(fp8_gemm_fprop=MMParams(True), fp8_gemm_dgrad=MMParams(False),
                                          fp8_gemm_wgrad=MMParams(False))
    assert fast_flags(package, turned, monkeypatch) == {"fprop": False, "dgrad": True, "wgrad": True}
    assert fast_flags(package, package.Float8BlockScaling(), monkeypatch) == dict.fromkeys(default, False)


def test_each_role_casts_with_its_qparams(package):
    """A grad QParams with power-of-2 scales: dy's casts floor its scale to a power of 2, x's and
    the weight's keep theirs (y as with the defaults); ``use_power_2_scales`` given to the recipe
    does not reach a Linear's casts (TE's modules read the QParams, made when the class was)."""
    QParams = package.QParams
    recipe = package.Float8CurrentScaling()
    recipe.fp8_quant_bwd_grad = QParams(power_2_scale=True)
    module, x, dy, y, dx = step(package, recipe)
    w = module._modules["0"].weight.detach()
    qx, qw, qdy = current(x.detach(), E4M3), current(w, E4M3), current(dy, E5M2, power_2=True)
    close_to_float64(y.detach(), qx @ qw.t() + module._modules["0"].bias.double(), 128)
    close_to_float64(dx, qdy @ qw, 256)
    close_to_float64(module._modules["0"].weight.grad, qdy.t() @ qx, 200)
    assert package.Float8CurrentScaling().fp8_quant_bwd_grad.power_2_scale is False  # (a copy was changed)
    _, _, _, y_default, dx_default = step(package, package.Float8CurrentScaling())
    _, _, _, y_given, dx_given = step(package, package.Float8CurrentScaling(use_power_2_scales=True))
    assert torch.equal(y_given, y_default) and torch.equal(dx_given, dx_default)


@pytest.mark.parametrize("recipe", ["current", "block"])
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override(package, recipe, override):
    """TE's backward_override: the forward as without it (bit for bit); the backward's GEMMs in
    high precision on dy as it is and on x and W as they were ("high_precision") or as their FP8
    values ("dequantized")."""
    made = {"current": package.Float8CurrentScaling, "block": package.Float8BlockScaling}[recipe]
    module, x, dy, y, dx = step(package, made(backward_override=override))
    _, _, _, y_fp8, _ = step(package, made())
    assert torch.equal(y, y_fp8)
    w = module._modules["0"].weight.detach()
    if override == "high_precision":
        xs, ws = x.detach().double(), w.double()
    elif recipe == "current":
        xs, ws = current(x.detach(), E4M3), current(w, E4M3)
    else:
        xs, ws = block_quantized(x.detach(), E4M3, False), block_quantized(w, E4M3, True)
    close_to_float64(dx, dy.double() @ ws, 256)
    close_to_float64(module._modules["0"].weight.grad, dy.double().t() @ xs, 200)


def test_recipe_options_are_checked_and_read_from_te(package):
    recipes = package._runtime.fp8_recipes
    with pytest.raises(ValueError, match="backward_override='high_precision'.*give None"):
        package.DelayedScaling(backward_override="high_precision")
    with pytest.raises(ValueError, match="backward_override='fast'"):
        package.Float8CurrentScaling(backward_override="fast")

    class MMParams:  # TE's, by attribute
        use_split_accumulator = False

    class QParams:
        power_2_scale, amax_epsilon = True, 0.5

    class Float8CurrentScaling:  # TE's dataclass: fields by name, QParams class attributes
        fp8_format, backward_override = package.Format.E4M3, "dequantized"
        fp8_gemm_dgrad = MMParams()
        fp8_quant_fwd_weight = QParams()

    made = recipes.as_recipe(Float8CurrentScaling())
    assert made.backward_override == "dequantized" and made.fp8_gemm_dgrad.use_split_accumulator is False
    assert made.fp8_gemm_fprop.use_split_accumulator is False and made.fp8_gemm_wgrad.use_split_accumulator
    assert recipes.scale_options(made, "w") == (recipes.float_bits(0.5), 1)
    assert recipes.scale_options(made, "x") == (0, 0)


@pytest.mark.cuda
@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_backward_override_on_the_gpu_matches_its_emulation(override):
    """generated.LlamaMlp in bf16 under Float8CurrentScaling(backward_override=...) on the GPU
    against the same module on the CPU (the FP8 forward emulated, the backward in high precision
    on both): output, x's grad and every parameter's within TE's FP8 tolerances."""
    _needs_fp8_gpu()
    import generated

    torch.manual_seed(6)
    cpu = generated.LlamaMlp(dtype=torch.bfloat16)
    cpu.fp8_min_rows = 0
    # signed weights: the forward GEMMs accumulate fast (TE's default), which loses much of a sum
    # over 14,336 products of one sign (23% of the output with weights of mean 0.3, on an H100)
    for parameter in cpu.parameters():
        torch.nn.init.normal_(parameter, 0.0 if parameter.dim() == 2 else 1.0, 0.05)
    gpu = copy.deepcopy(cpu).cuda()
    x = torch.randn(136, 4096, dtype=torch.bfloat16) * 2
    dy = torch.randn(136, 4096, dtype=torch.bfloat16)
    results = []
    for module, device in ((cpu, "cpu"), (gpu, "cuda")):
        xd = x.detach().clone().to(device).requires_grad_(True)
        with generated.autocast(recipe=generated.Float8CurrentScaling(backward_override=override)):
            y = module(xd)
        y.backward(dy.to(device))
        results.append([y, xd.grad, *(p.grad for p in module.parameters())])
    for got, want in zip(results[1], results[0]):
        scale = want.double().abs().max()
        assert torch.allclose(got.cpu().double() / scale, want.double() / scale, **FP8_TOLS[E4M3])
