"""Dropout (specs/te_dropout.py): in training, outputs and every grad against float64 references
that apply the documented draws (tests/references.py: dropout_keep, written from the definition);
in eval mode, the pipeline without dropout; reproducible under torch.manual_seed and fresh per
call; the keep rate by a statistical test; the backward's mask equal to the forward's. On CPU
and, marked cuda, on a GPU (where the kernels must draw exactly the CPU reference's masks)."""

import pytest
import torch
import torch.nn.functional as F

import generated
from generated import _kernels
from references import dropout_keep, next_keys, randomize_, run_and_compare, swiglu

SEED = 1234


def keep_mask(key, t, p):
    return dropout_keep(key, tuple(t.shape), p).to(t.device)


def dropout_mlp(training, device):
    def reference(p, x, r):
        shape = (-1, x.shape[-1])
        h = F.gelu(F.linear(x.reshape(shape), p["0.weight"], p["0.bias"]), approximate="tanh")
        if training:
            torch.manual_seed(SEED)
            k1, k2 = next_keys(2, device)
            h = h * keep_mask(k1, h, 0.1) / 0.9
        o = F.linear(h, p["3.weight"], p["3.bias"])
        if training:
            o = o * keep_mask(k2, o, 0.1) / 0.9
        return (o.reshape(r.shape) + r,)
    return reference


def dropout_glu(training, device):
    def reference(p, x):
        h = F.linear(x.reshape(-1, x.shape[-1]), p["0.weight"], p["0.bias"])
        if training:
            torch.manual_seed(SEED)
            (k,) = next_keys(1, device)
            h = h * keep_mask(k, h, 0.2) / 0.8
        return (swiglu(h).reshape(*x.shape[:-1], -1),)
    return reference


def dropout_any(training, device):
    def reference(p, x):
        if not training:
            return (x * 1,)
        torch.manual_seed(SEED)
        (k,) = next_keys(1, device)
        flat = x.reshape(-1, x.shape[-1])
        return ((flat * keep_mask(k, flat, 0.25) / 0.75).reshape(x.shape),)
    return reference


def post_attention(training, device):
    """Linear, Dropout, AddExtraInput, MakeExtraOutput, LayerNorm: the bias and dropout run in the
    norm kernel (fusion_rules/dropout_norm.py)."""
    def reference(p, x, r):
        shape = (-1, x.shape[-1])
        o = F.linear(x.reshape(shape), p["0.weight"], p["0.bias"])
        if training:
            torch.manual_seed(SEED)
            (k,) = next_keys(1, device)
            o = o * keep_mask(k, o, 0.1) / 0.9
        h = o + r.reshape(shape)
        y = F.layer_norm(h, (h.shape[-1],), p["4.weight"], p["4.bias"], eps=1e-5)
        return y.reshape(x.shape), h.reshape(x.shape)
    return reference


def norm_dropout(training, device):
    """RMSNorm, Dropout, Linear: the dropout runs in the norm kernel."""
    def reference(p, x):
        flat = x.reshape(-1, x.shape[-1])
        n = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-5) * p["0.weight"]
        if training:
            torch.manual_seed(SEED)
            (k,) = next_keys(1, device)
            n = n * keep_mask(k, n, 0.3) / 0.7
        return (F.linear(n, p["2.weight"], p["2.bias"]).reshape(*x.shape[:-1], -1),)
    return reference


def tee_norm_dropout(training, device):
    """Linear, MakeExtraOutput, RMSNorm, Dropout: the extra output is the norm's input, the dropout
    runs in the norm kernel."""
    def reference(p, x):
        h = F.linear(x.reshape(-1, x.shape[-1]), p["0.weight"], p["0.bias"])
        n = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5) * p["2.weight"]
        if training:
            torch.manual_seed(SEED)
            (k,) = next_keys(1, device)
            n = n * keep_mask(k, n, 0.3) / 0.7
        return n.reshape(x.shape), h.reshape(x.shape)
    return reference


# class -> (reference factory, input width, whether a GEMM runs)
CASES = {"DropoutMlp": (dropout_mlp, 256, True), "DropoutGlu": (dropout_glu, 256, True),
         "DropoutAny": (dropout_any, 100, False), "PostAttention": (post_attention, 256, True),
         "NormDropout": (norm_dropout, 256, True), "TeeNormDropout": (tee_norm_dropout, 256, True)}


def check(cls, dtype, device, training, lead, no_grad=None):
    factory, width, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    module.train(training)
    torch.manual_seed(SEED)  # the module's keys: the first draws after this
    run_and_compare(module, cls, (*lead, width), dtype, device, seed=5, ref_device=device,
                    reference=factory(training, device), gemm=gemm, no_grad=no_grad)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype, training):
    check(cls, dtype, "cpu", training, (2, 3))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu_no_grad(cls, training):
    """Without grad, in training mode too (the masks still drawn): the no-grad forward, whose
    plan differs for DropoutMlp (its GELU in the GEMM's epilogue, the dropout a kernel alone)."""
    check(cls, torch.float32, "cpu", training, (2, 3), no_grad=torch.no_grad)


def _keep_rate_and_mask_agreement(device):
    module = generated.DropoutAny(device=device, dtype=torch.float32)
    rows, n, p = 1000, 1003, 0.25  # an odd width: the scalar path on a GPU
    x = (torch.rand(rows, n, device=device) + 0.5).requires_grad_()  # no zeros: a zero output is a drop
    gy = torch.rand(rows, n, device=device) + 0.5
    y = module(x)
    y.backward(gy)
    kept = y != 0
    # keep rate: 1 - p within 6 standard deviations of a binomial over rows * n draws
    rate = kept.double().mean().item()
    sigma = (p * (1 - p) / (rows * n)) ** 0.5
    assert abs(rate - (1 - p)) < 6 * sigma, f"keep rate {rate} vs {1 - p}"
    # kept values scaled by 1 / (1 - p), within float32 rounding (the kernels multiply by a float32 1 / (1 - p))
    torch.testing.assert_close(y[kept], x[kept] / 0.75, rtol=2**-22, atol=0)
    torch.testing.assert_close(x.grad[kept], gy[kept] / 0.75, rtol=2**-22, atol=0)
    assert torch.equal(x.grad != 0, kept)  # the backward drops exactly what the forward dropped
    # columns and rows are not correlated: every column and row keeps some and drops some
    assert kept.any(0).all() and (~kept).any(0).all() and kept.any(1).all() and (~kept).any(1).all()


def _reproducible_and_fresh(device):
    module = generated.DropoutMlp(device=device, dtype=torch.float32)
    x, r = torch.randn(4, 256, device=device), torch.randn(4, 256, device=device)
    torch.manual_seed(7)
    first, second = module(x, r), module(x, r)
    torch.manual_seed(7)
    assert torch.equal(module(x, r), first) and not torch.equal(first, second)
    module.eval()
    assert torch.equal(module(x, r), module(x, r))


def test_cpu_keep_rate_and_mask_agreement():
    _keep_rate_and_mask_agreement("cpu")


def test_cpu_reproducible_under_manual_seed_and_fresh_per_call():
    _reproducible_and_fresh("cpu")


def test_nn_dropout_maps_to_dropout():
    from fusegen.frontend import parse_spec
    from fusegen.pipeline import build_pipeline

    (spec,) = parse_spec("import torch\nm = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(p=0.3))\n",
                         "spec.py")
    assert [op.describe() for op in build_pipeline(spec).ops] == ["BasicLinear(4, 4)", "Bias(4)", "Dropout(0.3)"]


def test_eager_dropout_draws_the_same_masks_and_is_identity_in_eval():
    from fusegen.eager import Dropout, Sequential

    seq = Sequential(Dropout(0.25))
    x = torch.rand(3, 50, dtype=torch.float64) + 0.5
    torch.manual_seed(SEED)
    y = seq(x)
    torch.manual_seed(SEED)
    (k,) = next_keys(1, "cpu")
    keep = keep_mask(k, x, 0.25)
    assert torch.equal(y != 0, keep)
    torch.testing.assert_close(y, x * keep / 0.75, rtol=1e-15, atol=0)
    assert torch.equal(seq.eval()(x), x)


# --- on a GPU -------------------------------------------------------------------------------

def on_gpu(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@on_gpu
@pytest.mark.parametrize("lead", [(1,), (4, 37)], ids=["1 row", "148 rows"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, training, lead):
    check(cls, dtype, "cuda", training, lead)


@on_gpu
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu_no_grad(cls, dtype, training):
    check(cls, dtype, "cuda", training, (4, 37), no_grad=torch.no_grad)


@on_gpu
def test_gpu_keep_rate_and_mask_agreement():
    _keep_rate_and_mask_agreement("cuda")


@on_gpu
def test_gpu_reproducible_under_manual_seed_and_fresh_per_call():
    _reproducible_and_fresh("cuda")


@on_gpu
@pytest.mark.parametrize("width", [64, 1003])
def test_gpu_kernels_draw_the_cpu_reference_masks(width):
    """The same key gives the same mask on the GPU (vector and scalar paths) and on CPU."""
    x = torch.rand(37, width) + 0.5
    key = torch.tensor([-(2**62) - 12345], dtype=torch.int64)
    cpu = _kernels.dropout0p25_fwd_any(x, key)
    gpu = _kernels.dropout0p25_fwd_any(x.cuda(), key.cuda()).cpu()
    assert torch.equal(cpu != 0, gpu != 0)  # the same elements kept, bit for bit
    # the values within rounding: the kernel scales by a float32 1 / (1 - p), the reference in float64
    torch.testing.assert_close(gpu, cpu, rtol=2**-22, atol=0)
