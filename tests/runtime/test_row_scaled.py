"""TE's row-scaled activations (specs/te_row_scaled.py): y = f(x) * s[row] and every grad, ds
summed over each row, against float64 references written from the catalog (2.6), at several widths
(vector and scalar paths), on CPU and, marked cuda, on a GPU; clear errors for scales of the wrong
shape and for TE's grouped-MLP-only flag."""

import pytest
import torch
import torch.nn.functional as F

import generated
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from references import as64, assert_close_to_reference, randomize_


def blocks(t, k):
    b = t.reshape(*t.shape[:-1], t.shape[-1] // (2 * k), 2, k)
    return b[..., 0, :].flatten(-2), b[..., 1, :].flatten(-2)


def situ(t):
    a, b = blocks(t, 32)
    return 2.0 * torch.tanh(a / 2.0) * torch.sigmoid(a) * (25.0 * torch.tanh(b / 25.0))


def clamped(t):
    a, b = t.chunk(2, dim=-1)
    a = a.clamp(max=5.0)
    return a * torch.sigmoid(1.702 * a) * (b.clamp(-5.0, 5.0) + 1.0)


def swiglu(t):
    a, b = t.chunk(2, dim=-1)
    return F.silu(a) * b


# class -> (activation f, input widths, whether a GEMM runs)
CASES = {
    "MoeSrelu": (None, (256,), True),
    "MoeSwiglu": (swiglu, (2, 14, 128, 2006, 8192), False),
    "MoeSituglu": (situ, (64, 4096), False),
    "MoeGeglu": (clamped, (2, 1002, 4096), False),
}


def reference(cls, p, x, s):
    f = CASES[cls][0]
    if cls == "MoeSrelu":
        h = F.relu(F.linear(x, p["0.weight"], p["0.bias"])).square() * s[..., None]
        return F.linear(h, p["2.weight"], p["2.bias"])
    return f(x) * s[..., None]


def check(cls, dtype, device, lead):
    _, widths, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    for width in widths:
        gen = torch.Generator().manual_seed(width)
        x = torch.randn((*lead, width), generator=gen).to(device, dtype).requires_grad_()
        s = torch.rand(lead, generator=gen).to(device, dtype).requires_grad_()  # routing weights
        module.zero_grad(set_to_none=True)
        y = module(x, s)
        gy = torch.randn(y.shape, generator=gen).to(device, dtype)
        y.backward(gy)
        params = {k: as64(v, device, True) for k, v in module.state_dict().items()}
        x64, s64 = as64(x, device, True), as64(s, device, True)
        y64 = reference(cls, params, x64, s64)
        y64.backward(gy.double())
        name = f"{cls} width {width}"
        assert_close_to_reference(f"{name} output", y, y64, dtype, gemm)
        assert_close_to_reference(f"{name} input grad", x.grad, x64.grad, dtype, gemm)
        assert_close_to_reference(f"{name} scales grad", s.grad, s64.grad, dtype, gemm)
        for key, param in module.named_parameters():
            assert_close_to_reference(f"{name} grad {key}", param.grad, params[key].grad, dtype, gemm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype):
    check(cls, dtype, "cpu", (2, 3))


def test_scales_of_the_wrong_shape_are_a_clear_error():
    module = generated.MoeSwiglu()
    with pytest.raises(ValueError, match=r"MoeSwiglu: extra_input0 holds one scale per row: it must have shape "
                                         r"\[2, 3\], got \[2, 3, 1\]"):
        module(torch.randn(2, 3, 8), torch.rand(2, 3, 1))
    assert generated.MoeSwiglu.extra_input_features == ("rows",)


def test_the_grouped_mlp_flag_is_not_supported_yet():
    with pytest.raises(SpecError, match="argument 'activation_recompute_in_mlp' of ScaledSReLU must be False"):
        parse_spec("import transformer_engine.pytorch as te\n"
                   "m = te.ops.Sequential(te.ops.ScaledSReLU(activation_recompute_in_mlp=True))\n", "spec.py")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 row", "185 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)
