"""GPU tests (`make test-gpu` on a CUDA machine): every generated kernel and every shipped pipeline
against float64 references, for float32, float16 and bfloat16, with odd row counts, 3-D and
non-contiguous inputs; outputs are poisoned (NaN-filled memory) before each run; CUDA-graph
capture and replay of a whole forward + backward. Needs only torch and cuda-bindings."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import references as R

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# TE's single-op tolerances (rtol, atol)
TOLS = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
KERNELS_DIR = Path(__file__).resolve().parents[2] / "generated"


@pytest.fixture(autouse=True)
def poison_memory():
    """Fill the caching allocator's free memory with NaN so an unwritten output shows up."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    block = torch.full((int(min(free * 0.5, 8 << 30)) // 4,), float("nan"), device="cuda")
    del block
    yield


def K():
    from generated import _kernels

    return _kernels


def randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(device="cuda", dtype=dtype)


def assert_close(name, got, ref, dtype):
    rtol, atol = TOLS[dtype]
    assert torch.isfinite(got.float()).all(), f"{name}: non-finite values (unwritten output?)"
    torch.testing.assert_close(got.double(), ref.to(got.device, torch.float64), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# --- single kernels ---------------------------------------------------------------------------

WIDE_NORMS = Path(__file__).resolve().parents[1] / "fixtures" / "wide_norms"


def wide_kernels():
    """The launchers of tests/fixtures/wide_norms' package (norms wider than the shipped specs')."""
    import importlib
    import sys

    if "generated_wide" not in sys.modules:
        sys.path.insert(0, str(WIDE_NORMS))
        try:
            importlib.import_module("generated_wide")
        finally:
            sys.path.remove(str(WIDE_NORMS))
    return sys.modules["generated_wide._kernels"]


# The backward's partials: shared memory (H=1024, 4096; 12288: 96 KB, past the 48 KB a block gets
# without the runtime's opt-in; RMS 16384: 64 KB; 98: 2-float chunks) or registers (L 16384).
NORMS = [  # fwd kernel, bwd kernel, LayerNorm?, H, residual-grad add in bwd, package's launchers
    ("layernorm_fwd_h4096", "layernorm_bwd_h4096", True, 4096, False, K),
    ("layernorm_fwd_h1024", "layernorm_bwd_h1024", True, 1024, False, K),
    ("rmsnorm_fwd_h4096", "rmsnorm_bwd_h4096_add_dresidual", False, 4096, True, K),
    ("rmsnorm_fwd_h1024", "rmsnorm_bwd_h1024", False, 1024, False, K),
    ("layernorm_fwd_h12288", "layernorm_bwd_h12288", True, 12288, False, wide_kernels),
    ("layernorm_fwd_h16384", "layernorm_bwd_h16384", True, 16384, False, wide_kernels),
    ("rmsnorm_fwd_h16384", "rmsnorm_bwd_h16384", False, 16384, False, wide_kernels),
    ("rmsnorm_fwd_h98", "rmsnorm_bwd_h98", False, 98, False, wide_kernels),
    # LayerNorm((7, 2)) (specs/te_norms.py): a multi-dim norm's kernel normalises rows of prod(shape)
    ("layernorm_fwd_h14", "layernorm_bwd_h14", True, 14, False, K),
]


def one_wave_and(extra, kernel, dtype, kernels=K):
    """Rows for a looping backward: the kernel's one-wave grid's blocks plus ``extra`` (so the
    first ``extra`` blocks take two rows, the rest one)."""
    launcher = getattr(kernels(), "_" + kernel.upper())
    threads = getattr(kernels(), "_" + kernel.upper() + "_THREADS")[dtype]
    return launcher.resident_blocks(dtype, torch.cuda.current_device(), threads) + extra


# The backward's grid is one wave of resident blocks (264 at H=4096, 1320 at H=1024 in bf16 on an
# H100): "wave+7" rows make its first 7 blocks take two rows. (Far more rows is not a kernel test:
# fp32 parameter grads summed over thousands of rows exceed TE's single-op fp32 tolerance in any
# fp32 accumulation; the 256-split kernel before this one did too, by 1.7e-5 at 5003 rows.)
@pytest.mark.parametrize("rows", [1, 3, 1000, "wave+7"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fwd,bwd,layernorm,hidden,dres,kernels", NORMS, ids=[n[0] for n in NORMS])
def test_norm_kernels(fwd, bwd, layernorm, hidden, dres, kernels, dtype, rows):
    if rows == "wave+7":
        rows = one_wave_and(7, bwd, dtype, kernels)
    gen = torch.Generator().manual_seed(rows)
    x = randn(rows, hidden, dtype=dtype, gen=gen, scale=2.0) + 0.5
    w = randn(hidden, dtype=dtype, gen=gen)
    b = randn(hidden, dtype=dtype, gen=gen)
    dy = randn(rows, hidden, dtype=dtype, gen=gen)
    d_res = randn(rows, hidden, dtype=dtype, gen=gen)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    if layernorm:
        y, mean, rstd = getattr(kernels(), fwd)(x, w, b)
        ref = F.layer_norm(x64, (hidden,), w64, b64, 1e-5)
        mu = x64.mean(-1)
        assert_close("mean", mean, mu, torch.float32)
        var = ((x64 - mu[:, None]) ** 2).mean(-1)
        stats = (mean, rstd)
    else:
        y, rstd = getattr(kernels(), fwd)(x, w)
        ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
        var = x64.pow(2).mean(-1)
        stats = (rstd,)
    assert_close("rstd", rstd, torch.rsqrt(var + 1e-5), torch.float32)
    assert_close("y", y, ref, dtype)
    # the launcher for a forward without autograd: the same y, no statistics written
    assert torch.equal(getattr(kernels(), fwd + "_no_grad")(x, w, *((b,) if layernorm else ())), y)
    ref.backward(dy.double())
    grads = getattr(kernels(), bwd)(dy, x, *stats, w, *((d_res,) if dres else ()))
    assert_close("dx", grads[0], x64.grad + (d_res.double() if dres else 0), dtype)
    assert_close("dgamma", grads[1], w64.grad, dtype)
    if layernorm:
        assert_close("dbeta", grads[2], b64.grad, dtype)
    again = getattr(kernels(), bwd)(dy, x, *stats, w, *((d_res,) if dres else ()))
    for g, h in zip(grads[1:], again[1:]):
        assert torch.equal(g, h), "parameter grads must be deterministic run to run"


# Norm forwards whose kernel has a _few_rows entry in some dtype (stages/norm/tuning.py: norm_fwd_few_rows): one
# whose parameters the other entry loads after the reduction, or that writes the residual sum.
FEW_ROWS_NORMS = [  # fwd kernel, H, residual added (zero-centred gamma), LayerNorm?, package's launchers
    ("layernorm_fwd_h4096", 4096, False, True, K),
    ("add_layernorm_zc_eps1em06_fwd_h768", 768, True, True, K),
    ("layernorm_fwd_h12288", 12288, False, True, wide_kernels),
    ("rmsnorm_fwd_h16384", 16384, False, False, wide_kernels),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fwd,hidden,residual,layernorm,kernels", FEW_ROWS_NORMS, ids=[n[0] for n in FEW_ROWS_NORMS])
def test_norm_forward_runs_its_few_rows_entry_up_to_one_wave(fwd, hidden, residual, layernorm, kernels, dtype,
                                                              monkeypatch):
    """Up to one wave of its blocks a norm forward runs its _few_rows entry, past it the other;
    both compute the same bits (only when loads are issued differs), checked against float64."""
    launcher = getattr(kernels(), "_" + fwd.upper())
    threads = getattr(kernels(), "_" + fwd.upper() + "_THREADS")[dtype]
    entries = []  # the entry each launch ran ("" the kernel's own)
    launch = type(launcher)._launch
    monkeypatch.setattr(type(launcher), "_launch",
                        staticmethod(lambda ready, *a: entries.append(ready.key[1]) or launch(ready, *a)))
    has_entry = dtype in launcher.few_rows_dtypes
    wave = launcher.few_rows.resident_blocks(dtype, torch.cuda.current_device(), threads) if has_entry else 1
    eps = 1e-6 if residual else 1e-5
    for rows in (1, wave, wave + 1):
        gen = torch.Generator().manual_seed(rows)
        x, r = (randn(rows, hidden, dtype=dtype, gen=gen, scale=2.0) + 0.5 for _ in range(2))
        w, b = randn(hidden, dtype=dtype, gen=gen), randn(hidden, dtype=dtype, gen=gen)
        args = (x, r, w, b) if residual else (x, w, b) if layernorm else (x, w)
        entries.clear()
        y, *rest = getattr(kernels(), fwd)(*args)
        assert entries == ["few_rows" if has_entry and rows <= wave else ""], f"{rows} rows ran {entries}"
        h64 = (x.double() + r.double()).to(dtype).double() if residual else x.double()
        gamma = w.double() + 1.0 if residual else w.double()  # the residual case's gamma is zero-centred
        if layernorm:
            ref = F.layer_norm(h64, (hidden,), gamma, b.double(), eps)
        else:
            ref = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * gamma
        assert_close("y", y, ref, dtype)
        if has_entry and rows <= wave:  # the other entry on the same rows: the same bits
            monkeypatch.setattr(launcher, "few_rows_dtypes", frozenset())
            again = getattr(kernels(), fwd)(*args)
            monkeypatch.setattr(launcher, "few_rows_dtypes", frozenset({dtype}))
            assert entries[-1] == "" and all(torch.equal(a, b) for a, b in zip((y, *rest), again))


def test_resident_blocks_is_one_wave_of_the_device():
    """The grid a looping backward launches: the device's SMs times the blocks one SM holds with
    that kernel (the driver's occupancy query), asked once per kernel, device and block size."""
    kernel = K()._RMSNORM_BWD_H1024
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    threads = K()._RMSNORM_BWD_H1024_THREADS[torch.bfloat16]
    blocks = kernel.resident_blocks(torch.bfloat16, 0, threads)
    assert blocks % sms == 0 and 1 <= blocks // sms <= 2048 // threads
    ready = kernel._ready[torch.bfloat16, 0]
    assert ready.resident == {threads: blocks}
    assert kernel.resident_blocks(torch.bfloat16, 0, threads) == blocks
    # a bigger block: no more resident blocks per SM than the SM has threads for
    assert kernel.resident_blocks(torch.bfloat16, 0, 2 * threads) // sms <= 2048 // (2 * threads)


@pytest.mark.parametrize("splits", [1, 31, 32, 33, 2500])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_column_sum_over_many_splits(splits, dtype):
    """The finaliser of every parameter grad: 32 lanes a column, compensated, fixed order. Values
    of mixed sign and size, so a plain fp32 sum of 2500 would be off by many roundings."""
    gen = torch.Generator().manual_seed(splits)
    partials = (torch.randn(splits, 4096, generator=gen, dtype=torch.float64)
                * torch.logspace(-3, 3, splits, dtype=torch.float64)[torch.randperm(splits, generator=gen), None])
    got = K().column_sum_n4096(partials.float().cuda(), dtype)
    ref = partials.float().double().sum(0)
    assert got.dtype == dtype and got.shape == (4096,)
    # at most a rounding to dtype plus a few fp32 roundings of the columns' magnitude
    # (rounding to dtype: half a unit in the last place, of the subnormal spacing where fp16 has one)
    finfo = torch.finfo(dtype)
    bound = partials.abs().sum(0) * 4 * 2.0 ** -24 + ref.abs() * finfo.eps / 2 + finfo.tiny * finfo.eps / 2
    assert ((got.double().cpu() - ref).abs() <= bound).all()
    assert torch.equal(got, K().column_sum_n4096(partials.float().cuda(), dtype)), "deterministic"


def _swiglu(t):
    a, b = t.chunk(2, -1)
    return F.silu(a) * b


ELEMENTWISE = [  # fwd kernel, bwd kernel, activation (float64), output width, gated (input 2x wide)
    ("swiglu_fwd_n14336", "bias_swiglu_bwd_n14336", _swiglu, 14336, True),
    ("gelu_fwd_n4096", "bias_gelu_bwd_n4096", lambda t: F.gelu(t, approximate="tanh"), 4096, False),
    # Inputs of scale 3 cross the clamps at 6 (about 5% of them): the zero grads there are checked.
    ("clamped_swiglu_l6p0_a1p5_o0p5_fwd_n2048", "bias_clamped_swiglu_l6p0_a1p5_o0p5_bwd_n2048",
     lambda t: R.clamped_swiglu(t, limit=6.0, alpha=1.5, offset=0.5), 2048, True),
    ("srelu_fwd_n2048", "bias_srelu_bwd_n2048", R.srelu, 2048, False),
    ("qgelu_fwd_n512", "bias_qgelu_bwd_n512", R.qgelu, 512, False),
    *((f"{name}_fwd_n512", f"bias_{name}_bwd_n512", lambda t, g=gate: R.gated(t, g), 512, True)
      for name, gate in R.GLU_GATES.items()),
    ("situglu_b2p0_c8p0_fwd_n512", "bias_situglu_b2p0_c8p0_bwd_n512",
     lambda t: R.situglu(t, beta1=2.0, beta2=8.0), 512, True),
]


def elementwise_wave_and(extra, kernel, dtype, width, in_width):
    """Rows for a looping bias-grad backward: its one-wave grid's row splits (resident blocks over
    the blocks along a row, known once a launch has asked the driver) plus ``extra``. The launch
    here takes more rows than the column-tiled path does, so it is the one that asks, whatever
    ran before (the column-tiled path never does)."""
    launcher = getattr(K(), "_" + kernel.upper())
    rows = K().COLUMN_TILED_ROWS + 1
    getattr(K(), kernel)(torch.zeros(rows, width, device="cuda", dtype=dtype),
                         torch.zeros(rows, in_width, device="cuda", dtype=dtype))
    (blocks,) = launcher._ready[dtype, torch.cuda.current_device()].resident.values()
    return blocks // getattr(K(), "_" + kernel.upper() + "_GRID_X")[dtype] + extra


# "wave+7": the one-wave grid's row splits plus 7 (see test_norm_kernels).
@pytest.mark.parametrize("rows", [1, 3, 513, "wave+7"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fwd,bwd,act,width,gated", ELEMENTWISE, ids=[e[0] for e in ELEMENTWISE])
def test_activation_kernels(fwd, bwd, act, width, gated, dtype, rows):
    """Forward act(h); backward of Bias + act from the saved h: dx and dbias (TE's tolerances)."""
    in_width = width * 2 if gated else width
    if rows == "wave+7":
        rows = elementwise_wave_and(7, bwd, dtype, width, in_width)
    gen = torch.Generator().manual_seed(rows)
    h = randn(rows, in_width, dtype=dtype, gen=gen, scale=3.0)
    # Kinks hit exactly: zeros (ReLU's) and the clamp limits +-6 (ClampedSwiGLU's), exact in every dtype.
    h[:, ::7], h[:, 3::11], h[:, 5::13] = 0.0, 6.0, -6.0
    dy = randn(rows, width, dtype=dtype, gen=gen)
    h64 = h.double().requires_grad_()
    ref = act(h64)
    assert_close("y", getattr(K(), fwd)(h), ref, dtype)
    ref.backward(dy.double())
    dx, dbias = getattr(K(), bwd)(dy, h)
    assert_close("dx", dx, h64.grad, dtype)
    # dbias is Bias's backward (a column sum) of the activation grads. In fp32 the kernel's dx
    # holds exactly the terms it summed (checked just above), so the sum is checked against their
    # exact float64 sum within the bound every fp32 sum of n terms meets, n * 2**-24 * sum(|terms|)
    # (no rtol on the result holds where the terms cancel); in 16-bit dtypes against the float64
    # reference grads with TE's tolerance.
    if dtype == torch.float32:
        terms = dx.double()
        bound = rows * 2.0**-24 * terms.abs().sum(0)
        assert ((dbias.double() - terms.sum(0)).abs() <= bound).all(), "dbias: beyond the fp32 summation bound"
    else:
        assert_close("dbias", dbias, h64.grad.sum(0), dtype)
    assert torch.equal(dbias, getattr(K(), bwd)(dy, h)[1]), "dbias must be deterministic"


# A norm backward of at most SUMS_IN_KERNEL_SPLITS rows adds its parameter grads itself after a
# barrier across its grid (one cooperative launch); one row more, and the column_sum kernel adds them.
@pytest.mark.parametrize("in_kernel", [True, False], ids=["one launch", "column_sum"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_norm_parameter_grads_summed_in_the_backward_kernel_or_by_column_sum(dtype, in_kernel, monkeypatch):
    kernels = K()
    rows = kernels.SUMS_IN_KERNEL_SPLITS + (0 if in_kernel else 1)
    launched = []  # the column_sum launchers that run
    for name in ("column_sum_n2048", "column_sum_n4096", "column_sum_n28672"):
        monkeypatch.setattr(kernels, name, lambda *a, f=getattr(kernels, name), n=name: launched.append(n) or f(*a))
    gen = torch.Generator().manual_seed(rows)

    # LayerNorm(1024): dgamma and dbeta, 2048 columns (registers, 128 threads a block)
    x = randn(rows, 1024, dtype=dtype, gen=gen, scale=2.0) + 0.5
    w, b = randn(1024, dtype=dtype, gen=gen), randn(1024, dtype=dtype, gen=gen)
    dy = randn(rows, 1024, dtype=dtype, gen=gen)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    F.layer_norm(x64, (1024,), w64, b64, 1e-5).backward(dy.double())
    _, mean, rstd = kernels.layernorm_fwd_h1024(x, w, b)
    dx, dgamma, dbeta = kernels.layernorm_bwd_h1024(dy, x, mean, rstd, w)
    assert_close("LayerNorm dx", dx, x64.grad, dtype)
    assert_close("LayerNorm dgamma", dgamma, w64.grad, dtype)
    assert_close("LayerNorm dbeta", dbeta, b64.grad, dtype)
    again = kernels.layernorm_bwd_h1024(dy, x, mean, rstd, w)
    assert torch.equal(again[1], dgamma) and torch.equal(again[2], dbeta), "deterministic run to run"

    # RMSNorm(4096) with the residual's grad added: 4096 columns (shared-memory partials)
    x, w = randn(rows, 4096, dtype=dtype, gen=gen), randn(4096, dtype=dtype, gen=gen)
    dy, d_res = randn(rows, 4096, dtype=dtype, gen=gen), randn(rows, 4096, dtype=dtype, gen=gen)
    x64, w64 = (t.double().requires_grad_() for t in (x, w))
    (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64).backward(dy.double())
    _, rstd = kernels.rmsnorm_fwd_h4096(x, w)
    dx, dgamma = kernels.rmsnorm_bwd_h4096_add_dresidual(dy, x, rstd, w, d_res)
    assert_close("RMSNorm dx", dx, x64.grad + d_res.double(), dtype)
    assert_close("RMSNorm dgamma", dgamma, w64.grad, dtype)
    assert torch.equal(kernels.rmsnorm_bwd_h4096_add_dresidual(dy, x, rstd, w, d_res)[1], dgamma)

    expected = [] if in_kernel else ["column_sum_n2048", "column_sum_n4096"]
    assert launched == [n for n in expected for _ in range(2)]  # each backward ran twice


# An elementwise forward, and a backward without parameter grads, run one block a row over grid y
# rows, at most ELEMENTWISE_SPLITS of them; past that each block's (rolled) row loop takes a second
# row, row y and y + ELEMENTWISE_SPLITS. Fixed-width and size-generic kernels (SwiGLU at 256
# features has no fixed-width kernel).
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fwd,bwd,act,width,gated", [
    ("swiglu_fwd_n384", "swiglu_bwd_n384", _swiglu, 384, True),
    ("swiglu_fwd_any", "swiglu_bwd_any", _swiglu, 256, True),
    ("gelu_fwd_n256", "gelu_bwd_n256", lambda t: F.gelu(t, approximate="tanh"), 256, False),
])
def test_elementwise_kernels_past_one_row_a_block(fwd, bwd, act, width, gated, dtype):
    rows = K().ELEMENTWISE_SPLITS + 7
    gen = torch.Generator().manual_seed(7)
    h = randn(rows, width * 2 if gated else width, dtype=dtype, gen=gen, scale=3.0)
    dy = randn(rows, width, dtype=dtype, gen=gen)
    h64 = h.double().requires_grad_()
    ref = act(h64)
    assert_close("y", getattr(K(), fwd)(h), ref, dtype)
    ref.backward(dy.double())
    assert_close("dx", getattr(K(), bwd)(dy, h), h64.grad, dtype)


# An elementwise backward of at most COLUMN_TILED_ROWS rows sums its Bias grad itself, column-tiled
# (16 row lanes up to 16 rows, 32 above: blocks of 8 or 4 vectors' columns); one row more, and it
# writes row-split partials that the column_sum kernel adds.
@pytest.mark.parametrize("rows", ["0", "1", "16", "17", "most tiled", "one more"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_elementwise_parameter_grads_column_tiled_or_by_column_sum(dtype, rows, monkeypatch):
    kernels = K()
    rows = {"most tiled": kernels.COLUMN_TILED_ROWS, "one more": kernels.COLUMN_TILED_ROWS + 1}.get(rows) or int(rows)
    launched, blocks = [], []  # the column_sum launches; the backward kernel's block shapes
    monkeypatch.setattr(kernels, "column_sum_n28672", lambda *a, f=kernels.column_sum_n28672: launched.append(a) or f(*a))
    kernel = kernels._BIAS_SWIGLU_BWD_N14336
    monkeypatch.setattr(kernel, "launch", lambda dtype, grid, block, *a, f=kernel.launch, **kw: blocks.append(block)
                        or f(dtype, grid, block, *a, **kw))
    gen = torch.Generator().manual_seed(rows)

    # Bias + SwiGLU: 28672 bias columns, several blocks along a row
    h = randn(rows, 28672, dtype=dtype, gen=gen, scale=3.0)
    dy = randn(rows, 14336, dtype=dtype, gen=gen)
    h64 = h.double().requires_grad_()
    _swiglu(h64).backward(dy.double())
    dx, dbias = kernels.bias_swiglu_bwd_n14336(dy, h)
    assert_close("SwiGLU dx", dx, h64.grad, dtype)
    if not rows:
        assert torch.equal(dbias, torch.zeros_like(dbias)), "no rows: a zero grad"
    elif dtype == torch.float32:  # the fp32 summation bound, as in test_activation_kernels
        terms = dx.double()
        assert ((dbias.double() - terms.sum(0)).abs() <= rows * 2.0**-24 * terms.abs().sum(0)).all()
    else:
        assert_close("SwiGLU dbias", dbias, h64.grad.sum(0), dtype)
    assert torch.equal(kernels.bias_swiglu_bwd_n14336(dy, h)[1], dbias), "deterministic run to run"

    tiled = rows <= kernels.COLUMN_TILED_ROWS
    block = (8, 16, 1) if rows <= 16 else (4, 32, 1) if tiled else (128, 1, 1)
    assert blocks == [block, block] and len(launched) == (0 if tiled else 2)


@pytest.mark.parametrize("rows", [1, 3, 513])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_residual_and_bias_kernels(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x, r, dy = (randn(rows, 4096, dtype=dtype, gen=gen) for _ in range(3))
    assert_close("add", K().add_fwd_n4096(x, r), x.double() + r.double(), dtype)
    assert_close("dbias (Bias, AddExtraInput)", K().bias_add_bwd_n4096(dy), dy.double().sum(0), dtype)
    assert_close("dbias 4096", K().bias_bwd_n4096(dy), dy.double().sum(0), dtype)
    dy1 = randn(rows, 1024, dtype=dtype, gen=gen)
    assert_close("dbias 1024", K().bias_bwd_n1024(dy1), dy1.double().sum(0), dtype)
    dy2 = randn(rows, 256, dtype=dtype, gen=gen)
    assert_close("dbias 256", K().bias_bwd_n256(dy2), dy2.double().sum(0), dtype)


def test_gelu_keeps_its_relative_accuracy_where_tanh_saturates():
    """fg::Gelu forms (1 + tanh u) / 2 and 1 - tanh^2 u without cancellation, so down to x = -5
    (GELU(-5) ~ -1.5e-6) each value and derivative is within what fp32 can do of its own size:
    a few ulps times the conditioning of exp(-2|u|), 1 + 2|u|. (With 1 + tanhf(u), the error at
    x = -5 is one ulp of 1, about 4% of the value.)"""
    x = torch.linspace(-5, 5, 256 * 64, dtype=torch.float64).reshape(64, 256)
    u = x * (0.79788456 + 0.03567741 * x * x)  # the kernel's constants (TE's)
    e = torch.exp(-2 * u.abs())  # float64, from the same cancellation-free parts
    half = torch.where(u >= 0, 1 / (1 + e), e / (1 + e))
    want_y = x * half
    want_dx = 0.5 * x * (4 * e / (1 + e) ** 2) * (0.79788456 + 0.1070322243 * x * x) + half
    xf = x.float().cuda()
    y = K().gelu_fwd_n256(xf).double().cpu()
    dx = K().gelu_bwd_n256(torch.ones_like(xf), xf).double().cpu()
    tolerance = 8 * 2.0**-24 * (1 + 2 * u.abs())  # relative to each value
    assert ((y - want_y).abs() <= tolerance * want_y.abs()).all()
    away = (x <= -2) | (x >= 0)  # GELU's derivative crosses zero near x = -0.75: no relative bound there
    assert ((dx - want_dx).abs() <= tolerance * want_dx.abs())[away].all()


def test_every_kernel_has_a_test():
    tested = {n for row in NORMS if row[-1] is K for n in row[:2]} | {n for row in ELEMENTWISE for n in row[:2]}
    tested |= {"add_fwd_n4096", "bias_add_bwd_n4096", "bias_bwd_n4096", "bias_bwd_n1024", "bias_bwd_n256"}
    # the elementwise_chain spec's kernels, checked through its pipeline test (every dtype, shape)
    tested |= {"relu_fwd_n768", "relu_bwd_n768", "add_layernorm_zc_eps1em06_fwd_h768",
               "layernorm_zc_bwd_h768_add_dresidual", "rmsnorm_zc_fwd_h768", "rmsnorm_zc_bwd_h768",
               "bias_scale0p5_gelu_tee_add_x27ef9c64_fwd_n384",  # names cut with a hash (kernels.kernel_name)
               "bias_scale0p5_gelu_x3d12017c_bwd_n384_from_bias",
               "swiglu_fwd_n384", "swiglu_bwd_n384"}
    # specs/size_generic.py's kernels, checked through test_size_generic.py (every dtype and width,
    # both paths, the fixed-size kernels its SwiGLU is specialised to)
    tested |= {"gelu_fwd_any", "gelu_bwd_any", "swiglu_fwd_any", "swiglu_bwd_any", "swiglu_fwd_n4096",
               "swiglu_bwd_n4096", "add_scale0p5_tee_qgelu_fwd_any", "add_scale0p5_tee_qgelu_bwd_any_from_add",
               "swiglu_tee_scale0p5_fwd_any", "swiglu_tee_scale0p5_bwd_any", "swiglu_tee_gelu_fwd_any",
               "swiglu_tee_gelu_bwd_any"}
    # specs/te_dropout.py's, checked through test_dropout.py
    tested |= {"bias_dropout0p1_add_bwd_n256", "bias_dropout0p2_swiglu_bwd_n512_from_dropout0p2",
               "bias_gelu_dropout0p1_bwd_n512", "dropout0p1_add_fwd_n256", "dropout0p25_bwd_any", "dropout0p25_fwd_any",
               "dropout0p2_swiglu_fwd_n512", "gelu_dropout0p1_fwd_n512",
               "bias_bwd_n512", "bias_dropout0p1_add_layernorm_fwd_h256", "bias_dropout0p1_bwd_n256",
               "dropout0p3_bwd_n256", "layernorm_bwd_h256_add_dresidual", "rmsnorm_bwd_h256",
               "rmsnorm_dropout0p3_fwd_h256",
               "dropout0p1_fwd_n512"}  # DropoutMlp's no-grad forward (test_gpu_no_grad there)
    # specs/te_norms.py's L2Normalization, checked through its pipeline test (l2norm_block)
    tested |= {"l2norm_eps1em05_fwd_h256", "l2norm_bwd_h256"}
    # specs/te_row_scaled.py's, checked through test_row_scaled.py
    tested |= {"bias_srelu_rowscale_bwd_n512", "clamped_swiglu_l5p0_rowscale_bwd_any", "clamped_swiglu_l5p0_rowscale_fwd_any",
               "situglu_b2p0_i32_rowscale_bwd_any", "situglu_b2p0_i32_rowscale_fwd_any", "srelu_rowscale_fwd_n512",
               "swiglu_rowscale_bwd_any", "swiglu_rowscale_fwd_any"}
    # specs/te_gemm_epilogues.py's, checked through test_gemm_epilogues.py
    tested |= {"add_tee_bwd_n256", "bias_scale2p0_gelu_bwd_n256", "bias_relu_bwd_n512_from_output"}
    # specs/te_interleaved_glu.py's, checked through test_interleaved_glu.py
    tested |= {"bias_swiglu_i32_bwd_n512", "clamped_swiglu_l3p0_i16_bwd_any", "clamped_swiglu_l3p0_i16_fwd_any",
               "swiglu_i32_fwd_n512"}
    # specs/te_reshape.py's, checked through test_reshape.py
    tested |= {"gelu_bwd_n256", "gelu_fwd_n256", "rmsnorm_bwd_h64", "rmsnorm_fwd_h64", "silu_bwd_any", "silu_fwd_any",
               "tee_bias_bwd_n64", "tee_bias_fwd_n64", "swiglu_add_bwd_any", "swiglu_add_fwd_any"}
    # specs/te_norms.py's norms over several trailing dims, checked through test_norm_shapes.py (and
    # LayerNorm((7, 2))'s kernels in NORMS above)
    tested |= {"rmsnorm_zc_fwd_h256", "rmsnorm_zc_bwd_h256", "bias_bwd_n64", "bias_bwd_n32"}
    # specs/te_in_place.py's, checked through test_in_place.py
    tested |= {"add_rmsnorm_fwd_h256", "add_tee_fwd_n256", "bias_add_tee_bwd_n256", "bias_add_tee_gelu_bwd_n256_from_bias",
               "bias_add_tee_gelu_fwd_n256", "rmsnorm_bwd_h256_add_dresidual"}
    # specs/residual_blocks.py's (a Residual's add fused into the next norm or elementwise kernel, its
    # tee's grad into a norm's dx), checked through its pipeline tests (test_pipeline, ...) and test_residual_modules.py
    tested |= {"add_gelu_fwd_n1024", "add_layernorm_fwd_h1024", "add_rmsnorm_fwd_h1024",
               "bias_add_gelu_bwd_n1024_from_add", "layernorm_bwd_h1024_add_dresidual",
               "rmsnorm_bwd_h1024_add_dresidual"}
    # specs/attention_block.py's and specs/llama_layer.py's, checked through test_attention_pipelines.py
    # (bf16 on the GPU: the layers against float64, every parameter's grad)
    tested |= {"add_fwd_n256", "add_rmsnorm_fwd_h4096", "bias_add_bwd_n256", "bias_bwd_n768", "layernorm_fwd_h256",
               "rmsnorm_fwd_h256", "swiglu_bwd_n14336", "swiglu_bwd_n512", "swiglu_fwd_n512"}
    # their attention prep kernels (stages/attention/), checked through test_attention_prep.py (every
    # dtype against float64, positions of lengths 1, 2, odd, long and 0, up to 16,384 rows)
    tested |= {"qkv_prep_rope10000_fwd_h4_kv2_d64", "qkv_prep_rope10000_bwd_h4_kv2_d64",
               "qkv_prep_rope10000_fwd_h4_kv1_d64", "qkv_prep_rope10000_bwd_h4_kv1_d64",
               "qkv_prep_rope500000_fwd_h32_kv8_d128", "qkv_prep_rope500000_bwd_h32_kv8_d128",
               "qkv_prep_bwd_h4_kv4_d64"}
    # specs/te_modules.py's (TE's LayerNormMLP and LayerNormLinear as macros), checked through
    # test_te_modules.py (bf16 on the GPU against float64, every parameter's grad)
    tested |= {"layernorm_zc_fwd_h1024", "layernorm_zc_bwd_h1024", "bias_bwd_n3072"}
    # specs/te_attention.py's (te.MultiheadAttention as a macro), checked through test_te_attention.py
    # (bf16 on the GPU against float64, every parameter's grad)
    tested |= {"layernorm_bwd_h256", "qkv_prep_bwd_h8_kv2_d32"}
    # specs/te_transformer_layer.py's (te.TransformerLayer as a macro), checked through
    # test_te_transformer_layer.py (bf16 on the GPU against float64, every parameter's grad)
    tested |= {"bias_gelu_bwd_n1024", "gelu_fwd_n1024"}
    # specs/te_models.py's (stacks of te.TransformerLayer and their hand-written Sequentials), checked
    # through test_te_models.py (bf16 on the GPU against float64, every parameter's grad, and trained)
    tested |= {"bias_dropout0p1_add_layernorm_x7749ae2f_fwd_h256", "bias_qgelu_bwd_n1024",
               "layernorm_zc_bwd_h256_add_dresidual", "qgelu_fwd_n1024", "qkv_prep_bwd_h8_kv1_d32"}
    # specs/tensor_parallel.py's (its other kernels are shared with the specs above), checked through
    # test_tensor_parallel.py on 2 GPUs (NCCL, fp32 against float64): TE's AllGather and a Linear with
    # a bias, whose GEMM takes the all-gather (so the Bias is a kernel of its own)
    tested |= {"bias_fwd_n256"}
    # and its decoder layer (tp_layer), checked the same way on 2 GPUs, packed sequences across the ranks
    tested |= {"add_fwd_n512", "add_rmsnorm_fwd_h512", "rmsnorm_bwd_h512_add_dresidual", "rmsnorm_fwd_h512"}
    # and its TE modules' spelling (tp_te_modules: LayerNormMLP's fc1 bias and SwiGLU), the same way
    tested |= {"bias_swiglu_fwd_n512", "bias_swiglu_bwd_n512_from_bias"}
    # and TE's TransformerLayer split (tp_te_layer: its local heads' prep kernels, fc1's bias and SwiGLU,
    # the output projections' bias before the residual add), the same way over packed sequences
    tested |= {"bias_add_fwd_n256", "bias_swiglu_bwd_n256_from_bias", "bias_swiglu_fwd_n256",
               "qkv_prep_bwd_h2_kv1_d64", "qkv_prep_table_bwd_h2_kv1_d64", "qkv_prep_table_fwd_h2_kv1_d64"}
    # specs/llama_layer.py's te.TransformerLayer spelling, checked through test_te_llama_layer.py (bf16
    # on the GPU against float64, every parameter's grad)
    tested |= {"qkv_prep_bwd_h32_kv8_d128", "qkv_prep_table_fwd_h32_kv8_d128", "qkv_prep_table_bwd_h32_kv8_d128"}
    # the prep kernels' table variant of the TE attention specs (TE's forward(rotary_pos_emb=...)),
    # checked through test_attention_prep_table.py (every dtype against float64, a general table) and
    # test_te_rotary.py (the modules in bf16 against float64)
    tested |= {f"qkv_prep_table_{way}_{shape}" for way in ("fwd", "bwd") for shape in ("h4_kv4_d64", "h8_kv2_d32",
                                                                                       "h8_kv1_d32")}
    # the quantize family's FP8 casts, checked through test_fp8.py (every dtype against their reference,
    # bit for bit), and specs/fp8_mlp.py's TE LayerNormMLP (bias, 512 wide), through its GPU tests there
    tested |= {"fp8_amax", "fp8_cast_e4m3", "fp8_cast_e5m2", "fp8_delayed_update", "fp8_cast_rows_e4m3",
               "fp8_cast_rows_e5m2", "fp8_amax_cols", "fp8_cast_cols_e4m3", "fp8_cast_cols_e5m2", "bias_swiglu_bwd_n512",
               "fp8_cast_blocks_e4m3", "fp8_cast_blocks_e5m2",  # (and test_fp8_blocks.py)
               # the norm forwards that keep their output's amax, against the plain kernels in test_fp8.py
               "rmsnorm_fwd_h128_amax", "rmsnorm_fwd_h256_amax", "rmsnorm_fwd_h4096_amax", "add_rmsnorm_fwd_h4096_amax"}
    # the FP8 emission's kernels that keep their output's amax, against the plain kernels there, and
    # fp8_narrow_mlp's (whose SwiGLU has them), through its GPU test there against its emulation
    tested |= {"swiglu_fwd_n320_amax", "swiglu_bwd_n320_amax", "bias_swiglu_bwd_n512_amax", "swiglu_fwd_n320",
               "swiglu_bwd_n320", "rmsnorm_fwd_h128", "rmsnorm_bwd_h128"}
    # the FP8 variants (templates/cuda/fp8_tile.cuh), against their plain kernel and cast there, and
    # through the modules' GPU tests
    tested |= {"swiglu_fwd_n14336_fp8", "swiglu_bwd_n14336_fp8", "swiglu_fwd_n512_fp8"}
    manifest = json.loads((KERNELS_DIR / "MANIFEST.json").read_text())
    names = set(manifest["kernels"])
    column_sums = {n for n in names if n.startswith("column_sum_")}  # exercised by every backward above
    assert names - column_sums == tested


# --- whole pipelines ----------------------------------------------------------------------------

def _module(name, dtype):
    import generated

    module = getattr(generated, R.PIPELINES[name][0])(device="cuda", dtype=dtype)
    R.randomize_(module, torch.Generator().manual_seed(7))
    return module


def _non_contiguous(t):
    """The same values with transposed leading strides (3-D) or column-major strides (2-D)."""
    if t.dim() == 3:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t.t().contiguous().t()


SHAPES = {"1 row": (1,), "3 rows": (3,), "3-D 2x37": (2, 37), "3-D 4x250": (4, 250)}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(R.PIPELINES))
def test_pipeline(name, dtype, shape):
    module = _module(name, dtype)
    R.run_and_compare(module, name, (*shape, module.in_features), dtype, "cuda", seed=len(shape), ref_device="cuda")


@pytest.mark.parametrize("shape", [(3,), (2, 37)], ids=["3 rows", "3-D 2x37"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(R.PIPELINES))
def test_pipeline_no_grad(name, dtype, shape):
    """The no-grad forward against float64 (gpt2_mlp's GELU runs in cuBLASLt's epilogue there,
    which must be TE's tanh approximation)."""
    module = _module(name, dtype)
    R.run_and_compare(module, name, (*shape, module.in_features), dtype, "cuda", seed=len(shape), ref_device="cuda",
                      no_grad=torch.no_grad)


@pytest.mark.parametrize("lead", [(3, 5), (7,)], ids=["3-D", "2-D"])
@pytest.mark.parametrize("name", sorted(R.PIPELINES))
def test_pipeline_non_contiguous_input(name, lead):
    module = _module(name, torch.bfloat16)
    R.run_and_compare(module, name, (*lead, module.in_features), torch.bfloat16, "cuda",
                      make_input=_non_contiguous, seed=11, ref_device="cuda")


def test_cuda_graph_capture_and_replay_forward_backward():
    """A captured forward + backward replays on new inputs: the results match the float64
    reference, and two replays are bit-identical (our kernels are deterministic). cuBLAS may pick
    other GEMM algorithms under capture, so the eager run is not a bitwise oracle."""

    module = _module("prenorm_block", torch.bfloat16)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy, ge = (torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up loads the kernels outside the capture
        for _ in range(2):
            torch.autograd.backward(module(x, r), (gy, ge))
    torch.cuda.current_stream().wait_stream(s)
    x.grad = r.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static, extra_static = module(x, r)
        torch.autograd.backward((y_static, extra_static), (gy, ge))

    def replay():
        for p in module.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        # detach: extra_static aliases the static input x, which copy_ refreshes between replays
        return [t.detach().clone() for t in (y_static, extra_static, x.grad, r.grad, *(p.grad for p in module.parameters()))]

    with torch.no_grad():  # new inputs, then replay
        x.copy_(torch.randn_like(x))
        r.copy_(torch.randn_like(r))
    first, second = replay(), replay()
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two replays must be bit-identical"
    params64 = {k: v.detach().double().requires_grad_() for k, v in module.state_dict().items()}
    x64, r64 = (t.detach().double().requires_grad_() for t in (x, r))
    ref = R.prenorm_block(params64, x64, r64)
    torch.autograd.backward(ref, (gy.double(), ge.double()))
    want = [*ref, x64.grad, r64.grad, *(params64[k].grad for k, _ in module.named_parameters())]
    for i, (got, expected) in enumerate(zip(first, want)):
        R.assert_close_to_reference(f"replayed tensor {i}", got, expected, torch.bfloat16)


@pytest.mark.parametrize("name", sorted(R.PIPELINES))
def test_double_backward_on_cuda_raises(name):
    """The first-order guard of every shipped pipeline on its CUDA path: a first derivative with
    create_graph=True still equals the plain one, and differentiating it again raises."""
    module = _module(name, torch.float32)
    x = torch.randn(5, module.in_features, device="cuda", requires_grad=True)
    extra = [torch.randn(5, n, device="cuda") for n in module.extra_input_features]
    outputs = module(x, *extra)
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    (plain,) = torch.autograd.grad(first.square().sum(), x, retain_graph=True)
    (grad,) = torch.autograd.grad(first.square().sum(), x, create_graph=True)
    torch.testing.assert_close(grad, plain, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second derivatives .* are not supported"):
        torch.autograd.grad(grad.sum(), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_norm_without_autograd_writes_the_sum_only_when_kept(dtype):
    """add_rmsnorm_fwd_h256_no_grad: y equal to the whole launcher's; the sum h returned with
    keep_sum, and never written without it (a null pointer the kernel must not store through)."""
    gen = torch.Generator().manual_seed(5)
    x, r = randn(77, 256, dtype=dtype, gen=gen), randn(77, 256, dtype=dtype, gen=gen)
    w = randn(256, dtype=dtype, gen=gen)
    y, h, rstd = K().add_rmsnorm_fwd_h256(x, r, w)
    assert torch.equal(K().add_rmsnorm_fwd_h256_no_grad(x, r, w, keep_sum=False), y)
    y_kept, h_kept = K().add_rmsnorm_fwd_h256_no_grad(x, r, w, keep_sum=True)
    assert torch.equal(y_kept, y) and torch.equal(h_kept, h)
    torch.cuda.synchronize()  # a store through the null pointer would fail here
