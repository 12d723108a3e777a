"""FP8 block scaling (issue 40, TE's Float8BlockScaling): the casts against an independent
implementation of TE's rules (a scale per 1x128 or 128x128 block: compute_scale_from_amax with the
input dtype's largest value for an overflowing scale, power-of-2 scales by default; the row-wise and
the transposed copy each cast from the tensor), generated modules against float64 references of the
block-quantized computation, and on the GPU the cast kernel and torch._scaled_mm's block-scaled
GEMMs against their CPU emulation."""

import copy
import math
import struct

import pytest
import torch

from tests.runtime.test_fp8 import E4M3, E5M2, FP8_TOLS, _needs_fp8_gpu, close_to_float64, f32, training_losses
from tests.spec_packages import imported_package

SPEC = """import transformer_engine.pytorch as te

linear = te.ops.Sequential(te.ops.Linear(128, 256))
mlp = te.ops.Sequential(te.ops.RMSNorm(128), te.ops.Linear(128, 512, bias=False), te.ops.SwiGLU(),
                        te.ops.Linear(256, 128))
# TE's cast points around a GEMM, the same GEMM without them, and at the pipeline's ends
quantized = te.ops.Sequential(te.ops.Quantize(), te.ops.BasicLinear(128, 256),
                              te.ops.Quantize(forward=False, backward=True))
plain = te.ops.Sequential(te.ops.BasicLinear(128, 256))
ends = te.ops.Sequential(te.ops.Quantize(backward=True), te.ops.BasicLinear(128, 256), te.ops.Quantize(backward=True))
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8_blocks")
    with imported_package(folder, "spec.py", SPEC, "fp8_block_pkg", fp8=("current", "block")) as pkg:
        yield pkg


# --- an independent implementation of TE's block quantization ----------------------------------------

def te_block_scale(amax, fp8_max, overflow, epsilon=0.0, power_2=True):
    """compute_scale_from_amax (common/recipe/recipe_common.cuh) with value_for_inf = the input
    dtype's largest (compute_scale_from_types), one float at a time."""
    amax = max(f32(amax), f32(epsilon))
    if math.isinf(amax) or amax == 0.0 or math.isnan(amax):
        return 1.0
    scale = f32(fp8_max / amax) if fp8_max / amax <= 3.4028234663852886e38 else math.inf
    if math.isinf(scale):
        scale = overflow
    if power_2:
        scale = struct.unpack("f", struct.pack("I", struct.unpack("I", struct.pack("f", scale))[0] & 0xFF800000))[0]
    return scale


def te_blocks(x, dtype, square, epsilon=0.0, power_2=True):
    """TE's blockwise_quantizer_reference: x [rows, cols] (rows and cols any) quantized in blocks of
    1x128 (each row of the row-wise copy, each column of the transposed one) or 128x128: the FP8
    values of both copies and the inverse scale of each element's block, per element."""
    fp8_max, overflow = torch.finfo(dtype).max, torch.finfo(x.dtype).max
    values = x.to(torch.float32)
    rows, cols = x.shape

    def cast_in(spans):  # spans: (row slice, col slice) blocks
        q = torch.empty(rows, cols, dtype=dtype)
        scale_inv = torch.empty(rows, cols, dtype=torch.float32)
        for r, c in spans:
            block = values[r, c]
            scale = te_block_scale(block.abs().max().item(), fp8_max, overflow, epsilon, power_2)
            q[r, c] = (block * scale).clamp(-fp8_max, fp8_max).to(dtype)
            scale_inv[r, c] = 1.0 / torch.tensor(scale, dtype=torch.float32)
        return q, scale_inv

    starts = [(i, j) for i in range(0, rows, 128) for j in range(0, cols, 128)]
    if square:
        both = cast_in([(slice(i, i + 128), slice(j, j + 128)) for i, j in starts])
        return both, both
    row_wise = cast_in([(slice(r, r + 1), slice(j, j + 128)) for r in range(rows) for j in range(0, cols, 128)])
    transposed = cast_in([(slice(i, i + 128), slice(c, c + 1)) for i in range(0, rows, 128) for c in range(cols)])
    return row_wise, transposed


def block_quantized(x, dtype, square, along_rows=True):
    """x's value as its block-quantized copy holds it, float64: the row-wise copy (1D: blocks along
    each row) or, ``along_rows`` False, the transposed one's, transposed back (1D: along columns)."""
    row_wise, transposed = te_blocks(x, dtype, square)
    q, scale_inv = row_wise if along_rows else transposed
    return q.to(torch.float64) * scale_inv.to(torch.float64)


def spread(s, rows, cols, square):
    """A cast's inverse scales ([cols / 128, rows] 1D, [row blocks, col blocks] 2D) per element."""
    if square:
        return s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return s.t().repeat_interleave(128, 1)[:, :cols]


def awkward(rows, cols, dtype, seed):
    """Signed values whose rows and blocks differ in size by orders of magnitude, a zero block and a
    block of values so small that the scale overflows fp32."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=generator) * torch.exp(torch.randn(rows, 1, generator=generator) * 3)
    x[:, :128] *= torch.exp(torch.randn(1, 128, generator=generator) * 2)
    x[:128, 128:256] = 0.0
    if rows > 128 and dtype != torch.float16:
        x[128:256, :128] = 1e-38  # fp32/bf16 subnormal-range: 448 / amax overflows
    return x.to(dtype)


# --- the rules -----------------------------------------------------------------------------------

@pytest.mark.parametrize("square", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_block_casts_follow_te(package, square, dtype, fp8_dtype):
    """The block cast (its CPU path) against TE's rules element by element: the FP8 bytes and the
    inverse scales of the row-wise copy and the transposed one (zeros past the rows), 200 rows (a
    partial last block)."""
    rows, cols = 200, 384
    x = awkward(rows, cols, dtype, seed=1)
    cast = package._kernels.fp8_cast_blocks_e4m3 if fp8_dtype == E4M3 else package._kernels.fp8_cast_blocks_e5m2
    y, s, y_t, s_t = cast(x, int(square), 0, 1, 1, 1)
    (want_q, want_s), (want_qt, want_st) = te_blocks(x, fp8_dtype, square)
    assert y.dtype == fp8_dtype and y_t.shape == (cols, 256)
    assert torch.equal(y.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(spread(s, rows, cols, square), want_s)
    assert torch.equal(y_t[:, :rows].view(torch.uint8), want_qt.t().contiguous().view(torch.uint8))
    assert not y_t[:, rows:].view(torch.uint8).any()
    if square:
        assert torch.equal(s_t, s.t())
    else:  # [row blocks, cols]: a column's scale per block of 128 rows
        assert torch.equal(s_t.repeat_interleave(128, 0)[:rows], want_st)
    assert (torch.frexp(s).mantissa == 0.5).all()  # power-of-2 scales (TE's default)


def test_block_cast_options(package):
    """Without power-of-2 scales, with an amax epsilon, and one copy at a time."""
    x = awkward(130, 256, torch.bfloat16, seed=2)
    cast = package._kernels.fp8_cast_blocks_e4m3
    epsilon = 0.25
    eps_bits = struct.unpack("<i", struct.pack("<f", epsilon))[0]
    y, s, y_t, s_t = cast(x, 0, eps_bits, 0, 1, 0)
    (want_q, want_s), _ = te_blocks(x, E4M3, False, epsilon=epsilon, power_2=False)
    assert torch.equal(y.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(spread(s, 130, 256, False), want_s)
    assert y_t.numel() == 0 and s_t.numel() == 0
    _, _, y_t, s_t = cast(x, 0, eps_bits, 0, 0, 1)
    _, (want_qt, _) = te_blocks(x, E4M3, False, epsilon=epsilon, power_2=False)
    assert torch.equal(y_t[:, :130].view(torch.uint8), want_qt.t().contiguous().view(torch.uint8))


def test_block_recipe_mirrors_te(package):
    recipe = package.Float8BlockScaling()
    assert (recipe.fp8_format, recipe.x_block_scaling_dim, recipe.w_block_scaling_dim,
            recipe.grad_block_scaling_dim, recipe.use_f32_scales) == (package.Format.E4M3, 1, 2, 1, False)
    for role in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        assert (getattr(recipe, role).power_2_scale, getattr(recipe, role).amax_epsilon) == (True, 0.0)
    with pytest.raises(ValueError, match="takes 128x128 blocks for a GEMM's second operand only"):
        package.Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="FP8 attention is not supported"):
        package.Float8BlockScaling(fp8_mha=True)
    with pytest.raises(ValueError, match="backward_override"):
        package.Float8BlockScaling(backward_override="low_precision")
    with pytest.raises(ValueError, match="split accumulation in every GEMM"):
        package.Float8BlockScaling(fp8_gemm_fprop=package._runtime.fp8_recipes.MMParams(False))
    with pytest.raises(ValueError, match="pure E5M2"):
        package.Float8BlockScaling(fp8_format=package.Format.E5M2)

    class QParams:  # TE's, by attribute
        def __init__(self, power_2_scale, amax_epsilon):
            self.power_2_scale, self.amax_epsilon = power_2_scale, amax_epsilon

    class Float8BlockScaling:  # TE's dataclass: fields by name, its roles' QParams class attributes
        use_f32_scales, fp8_format, x_block_scaling_dim, w_block_scaling_dim = True, package.Format.HYBRID, 1, 1
        fp8_quant_fwd_inp = fp8_quant_fwd_weight = fp8_quant_bwd_grad = QParams(False, 1e-6)

    made = package._runtime.fp8_recipes.as_recipe(Float8BlockScaling())
    assert isinstance(made, package.Float8BlockScaling) and made.w_block_scaling_dim == 1
    assert made.fp8_format is package.Format.HYBRID and made.fp8_quant_bwd_grad.amax_epsilon == 1e-6
    assert made.fp8_quant_fwd_inp.power_2_scale is False


# --- generated modules ---------------------------------------------------------------------------

def test_linear_computes_the_block_quantized_gemms(package):
    """One Linear under Float8BlockScaling: y, dx, dW and db against float64 GEMMs of the operands
    quantized as TE does (x and dy in 1x128 blocks along each GEMM's reduction dim, W in 128x128
    blocks; dy's and x's copies for the weight grad in blocks along the tokens), 200 rows."""
    torch.manual_seed(1)
    module = package.Linear()
    x = (torch.randn(200, 128) * torch.exp(torch.randn(200, 1))).requires_grad_(True)
    dy = torch.randn(200, 256) * torch.exp(torch.randn(1, 256))
    with package.autocast(recipe=package.Float8BlockScaling()):
        y = module(x)
    y.backward(dy)
    w, b = module._modules["0"].weight.detach(), module._modules["0"].bias.detach()
    qx, qw = block_quantized(x.detach(), E4M3, False), block_quantized(w, E4M3, True)
    qdy = block_quantized(dy, E4M3, False)  # E4M3 grads: the recipe's Format.E4M3
    want_dw = block_quantized(dy, E4M3, False, along_rows=False).t() @ block_quantized(x.detach(), E4M3, False,
                                                                                        along_rows=False)
    close_to_float64(y.detach(), qx @ qw.t() + b.double(), 128)
    close_to_float64(x.grad, qdy @ qw, 256)
    close_to_float64(module._modules["0"].weight.grad, want_dw, 200)
    close_to_float64(module._modules["0"].bias.grad, dy.double().sum(0), 200)  # in high precision


def test_mlp_against_the_block_quantized_reference(package):
    """RMSNorm, Linear, SwiGLU, Linear under Float8BlockScaling with HYBRID grads: output and every
    grad within TE's FP8 tolerances of the same ops in float64 with each GEMM's operands quantized
    as the recipe does."""
    torch.manual_seed(2)
    module = package.Mlp()
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, 0.5, 0.2)
    x = (torch.randn(160, 128) * 3).requires_grad_(True)
    dy = torch.randn(160, 128)
    with package.autocast(recipe=package.Float8BlockScaling(fp8_format=package.Format.HYBRID)):
        y = module(x)
    y.backward(dy)
    params = [p.detach().double().requires_grad_(True) for p in module.parameters()]

    class QuantizedLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return block_quantized(a.float(), E4M3, False) @ block_quantized(w.float(), E4M3, True).t()

        @staticmethod
        def backward(ctx, g):
            a, w = ctx.saved_tensors
            g = g.float()
            dx = block_quantized(g, E5M2, False) @ block_quantized(w.float(), E4M3, True)
            dw = block_quantized(g, E5M2, False, along_rows=False).t() @ block_quantized(a.float(), E4M3, False,
                                                                                         along_rows=False)
            return dx, dw

    xd = x.detach().double().requires_grad_(True)
    norm_w, w1, w2, b2 = params
    h = QuantizedLinear.apply(xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w, w1)
    a, g = h.chunk(2, dim=-1)
    want = QuantizedLinear.apply(torch.nn.functional.silu(a) * g, w2) + b2
    want.backward(dy.double())
    for got, ref, tols in [(y, want, FP8_TOLS[E4M3]), (x.grad, xd.grad, FP8_TOLS[E5M2]),
                           *((p.grad, r.grad, FP8_TOLS[E5M2]) for p, r in zip(module.parameters(), params))]:
        scale = ref.abs().max()
        assert torch.allclose(got.double() / scale, ref.detach() / scale, **tols), (got.shape, (got - ref).abs().max())


def test_training_under_block_scaling_follows_high_precision(package):
    """The MLP fitted for 60 Adam steps in high precision, under Float8CurrentScaling and under
    Float8BlockScaling: the loss falls by more than 3x in each; up to the 40th step (from the 10th)
    block scaling's loss is within 10% of the high-precision one (past it this model's loss nears
    FP8's noise floor, about 0.005, where every recipe's curve flattens: a relative gap says nothing
    there), and over all 60 its mean gap is no larger than current scaling's (TE's block scaling is
    the finer-grained of the two)."""
    losses = {name: training_losses(package, recipe, 128) for name, recipe in (
        ("high", None), ("current", package.Float8CurrentScaling()), ("block", package.Float8BlockScaling()))}
    high, block = losses["high"], losses["block"]
    assert all(curve[-1] < curve[0] / 3 for curve in losses.values()), {k: v[-1] for k, v in losses.items()}
    for step in range(10, 40):
        assert abs(block[step] - high[step]) <= 0.1 * high[step], (step, block[step], high[step])
    gap = {name: sum(abs(a - b) for a, b in zip(losses[name], high)) / 60 for name in ("current", "block")}
    assert gap["block"] <= gap["current"], gap


def test_quantize_ops_under_block_scaling(package):
    """te.ops.Quantize under Float8BlockScaling: next to a Linear the Linear takes its FP8 tensor,
    so y, dx and dW are those of the Linear alone, bit for bit; at the ends the output and x's
    grad come out as their 1x128-block FP8 values (E4M3: the recipe's format)."""
    quantized, plain, ends = package.Quantized(), package.Plain(), package.Ends()
    with torch.no_grad():
        for module, name in ((plain, "0"), (ends, "1")):
            module._modules[name].weight.copy_(quantized._modules["1"].weight)
    x = awkward(200, 128, torch.float32, seed=3)
    dy = torch.randn(200, 256, generator=torch.Generator().manual_seed(4))
    results = {}
    for name, module in (("quantized", quantized), ("plain", plain), ("ends", ends)):
        xi = x.clone().requires_grad_(True)
        with package.autocast(recipe=package.Float8BlockScaling()):
            y = module(xi)
        y.backward(dy)
        results[name] = (y.detach(), xi.grad)
    assert all(torch.equal(got, want) for got, want in zip(results["quantized"], results["plain"]))
    y_plain, dx_plain = results["plain"]
    y_ends, dx_ends = results["ends"]
    close_to_float64(y_ends, block_quantized(y_plain, E4M3, False), 1)
    close_to_float64(dx_ends, block_quantized(dx_plain, E4M3, False), 1)
    assert not torch.equal(y_ends, y_plain)


def test_sizes_block_scaling_cannot_take_are_a_clear_error(tmp_path, monkeypatch, capsys):
    from fusegen import cli

    (tmp_path / "spec.py").write_text("import transformer_engine.pytorch as te\n\n"
                                      "mlp = te.ops.Sequential(te.ops.Linear(128, 192))\n")
    (tmp_path / "pyproject.toml").write_text('[tool.fusegen]\nspecs = ["spec.py"]\nfp8 = ["current", "block"]\n')
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan"]) == 2
    assert ("BasicLinear(128, 192): out_features=192 is not a multiple of 128, which Float8BlockScaling's 1x128 "
            "and 128x128 blocks need") in capsys.readouterr().err


# --- on the GPU ----------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [200, 384])
def test_block_cast_kernel_matches_its_reference(dtype, rows):
    """fp8_cast_blocks_* on the GPU against its CPU path bit for bit: both copies and their scales,
    1D and 2D, both formats, with and without power-of-2 scales and an epsilon."""
    import generated

    x = awkward(rows, 512, dtype, seed=rows)
    for cast in (generated._kernels.fp8_cast_blocks_e4m3, generated._kernels.fp8_cast_blocks_e5m2):
        for square, eps_bits, power_2 in ((0, 0, 1), (1, 0, 1), (0, 1048576000, 0), (1, 0, 0)):
            want = cast(x, square, eps_bits, power_2, 1, 1)
            got = cast(x.cuda(), square, eps_bits, power_2, 1, 1)
            for g, w in zip(got, want):
                assert g.shape == w.shape and torch.equal(g.cpu().view(torch.uint8), w.view(torch.uint8))
            rows_only = cast(x.cuda(), square, eps_bits, power_2, 1, 0)
            assert torch.equal(rows_only[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
            assert rows_only[2].numel() == 0


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [256, 202])
@pytest.mark.parametrize("b_block", [1, 2])
@pytest.mark.parametrize("a_format", ["e4m3", "e5m2"])
def test_block_scaled_mm_on_the_gpu(rows, b_block, a_format, monkeypatch):
    """torch._scaled_mm of block-scaled operands (1x128 by 128x128: the forward and dgrad; 1x128 by
    1x128: the weight grad; the first in E5M2 as HYBRID's grads are) against the float64 product
    of the same FP8 values times their block scales, within the FP8 tensor cores' accumulation and
    bf16's rounding. cuBLAS reads the scales with a leading dimension rounded up to 4, which torch
    does not pad: 202 rows run emulated."""
    _needs_fp8_gpu()
    import generated

    fp8 = generated._runtime.fp8_casts
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kw: calls.append(1) or scaled_mm(*args, **kw))
    cast = generated._kernels.fp8_cast_blocks_e4m3
    cast_a = getattr(generated._kernels, f"fp8_cast_blocks_{a_format}")
    a = fp8._Quantized(*cast_a(awkward(rows, 512, torch.bfloat16, seed=7).cuda(), 0, 0, 1, 1, 0)[:2], 1)
    b = fp8._Quantized(*cast(awkward(256, 512, torch.bfloat16, seed=8).cuda(), b_block - 1, 0, 1, 1, 0)[:2], b_block)
    got = fp8.scaled_mm(a, b, torch.bfloat16)
    assert len(calls) == (1 if rows % 4 == 0 else 0)
    da, db = fp8.dequantized(a).double(), fp8.dequantized(b).double()
    want, bound = da @ db.t(), da.abs() @ db.abs().t()
    err = (got.double() - want).abs()
    assert (err <= 2.0 ** -10 * bound + 2.0 ** -8 * want.abs() + 1e-30).all(), err.max()


@pytest.mark.cuda
@pytest.mark.parametrize("name, width", [("Fp8LayernormMlp", 256), ("LlamaMlp", 4096)])
@pytest.mark.parametrize("fp8_format", ["E4M3", "HYBRID"])
def test_generated_mlps_under_block_scaling_match_their_emulation(name, width, fp8_format):
    """generated.Fp8LayernormMlp and LlamaMlp in bf16 under Float8BlockScaling (E4M3, TE's default,
    and HYBRID: E5M2 grads) on the GPU (the block cast kernel, torch._scaled_mm's block-scaled
    GEMMs) against the same module on the CPU (the reference math, the GEMMs emulated): output, x's
    grad and every parameter's within TE's FP8 tolerances of the largest value (the grads' those
    of their format), over two steps (the weight cache's second)."""
    _needs_fp8_gpu()
    import generated

    torch.manual_seed(6)
    cpu = getattr(generated, name)(dtype=torch.bfloat16)
    cpu.fp8_min_rows = 0
    for parameter in cpu.parameters():
        torch.nn.init.normal_(parameter, 0.3, 0.2)
    gpu = copy.deepcopy(cpu).cuda()
    rows = 40 if name == "Fp8LayernormMlp" else 136
    for step in range(2):
        x = torch.randn(rows, width, dtype=torch.bfloat16) * 2
        dy = torch.randn(rows, width, dtype=torch.bfloat16)
        results = []
        for module, device in ((cpu, "cpu"), (gpu, "cuda")):
            xd = x.detach().clone().to(device).requires_grad_(True)
            with generated.autocast(recipe=generated.Float8BlockScaling(fp8_format=generated.Format[fp8_format])):
                y = module(xd)
            y.backward(dy.to(device))
            results.append([y, xd.grad, *(p.grad for p in module.parameters())])
            module.zero_grad()
        grads = FP8_TOLS[E5M2 if fp8_format == "HYBRID" else E4M3]
        for i, (got, want) in enumerate(zip(results[1], results[0])):
            scale = want.double().abs().max()
            tols = FP8_TOLS[E4M3] if i == 0 else grads
            assert torch.allclose(got.cpu().double() / scale, want.double() / scale, **tols), (step, i)
