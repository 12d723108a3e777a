"""TE's AddExtraInput(in_place=True) (specs/te_in_place.py): the output, every grad and the
caller's residual tensor, which becomes the sum (catalog 2.10), against float64 references from
the residual's values before the call; on CPU and, marked cuda, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import generated
from references import as64, assert_close_to_reference, randomize_, rms_norm

H = 256


def residual_in_place(p, x, r):
    s = F.linear(x, p["0.weight"], p["0.bias"]) + r
    return s, s


def prenorm_in_place(p, x, r):
    s = x + r
    return rms_norm(s, p["1.weight"]), s


def in_place_mid(p, x, r):
    s = x + p["0.bias"] + r
    return F.gelu(s, approximate="tanh"), s


# class -> (reference returning (y, the residual's new value), whether a GEMM runs)
CASES = {"ResidualInPlace": (residual_in_place, True), "PrenormInPlace": (prenorm_in_place, False),
         "InPlaceMid": (in_place_mid, False)}


def check(cls, dtype, device, lead):
    reference, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    x, r, gy = (torch.randn((*lead, H), generator=gen).to(device, dtype) for _ in range(3))
    r_before = r.clone()
    x.requires_grad_()
    r.requires_grad_()  # a leaf the module changes in place, as TE's op does (it detaches it)
    y = module(x, r)
    assert y.shape == (*lead, H)
    y.backward(gy)

    params = {k: as64(v, device, True) for k, v in module.state_dict().items()}
    x64, r64 = as64(x, device, True), as64(r_before, device, True)
    y64, new_r64 = reference(params, x64, r64)
    y64.backward(gy.to(torch.float64))
    assert_close_to_reference(f"{cls} output", y, y64, dtype, gemm)
    assert_close_to_reference(f"{cls} residual after the call", r, new_r64, dtype, gemm)
    assert not torch.equal(r, r_before)
    assert_close_to_reference(f"{cls} input grad", x.grad, x64.grad, dtype, gemm)
    assert_close_to_reference(f"{cls} residual grad", r.grad, r64.grad, dtype, gemm)
    for key, p in module.named_parameters():
        assert_close_to_reference(f"{cls} grad {key}", p.grad, params[key].grad, dtype, gemm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype):
    check(cls, dtype, "cpu", (2, 3))


def test_a_non_contiguous_residual_is_updated_through_its_own_strides():
    module = generated.PrenormInPlace(dtype=torch.float64)
    x = torch.randn(4, H, dtype=torch.float64)
    r = torch.randn(H, 4, dtype=torch.float64).t()  # column-major
    want = x + r
    module(x, r)
    assert torch.equal(r, want) and r.stride() == (1, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (4, 37)], ids=["1 row", "148 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)
