"""TE's Identity as a whole pipeline (specs/te_reshape.py's identity_only): the module returns its
input, a view of it as TE's fuser returns (an autograd Function's output that is its input), with
the same values, shape and dtype; the grad passes through unchanged; no parameters. On CPU and,
marked cuda, on a GPU."""

import pytest
import torch

import generated
from fusegen import eager


def check(device, dtype, shape):
    module = generated.IdentityOnly(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(device, dtype)
    y = module(x)
    assert y is not x and y.shape == x.shape and y.dtype == dtype
    assert y.data_ptr() == x.data_ptr() and y._is_view() and y.grad_fn is not None  # a view of x, in the graph
    assert torch.equal(y, x)
    y.backward(dy)
    assert torch.equal(x.grad, dy)  # the grad passes through as it is
    with torch.no_grad():
        y = module(x)
    assert torch.equal(y, x) and y.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("shape", [(5, 3), (2, 3, 8), (1, 1)], ids=["2-D", "3-D", "1 value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_cpu(dtype, shape):
    check("cpu", dtype, shape)


def test_it_has_no_parameters_and_the_spec_s_children():
    module = generated.IdentityOnly()
    assert module.state_dict() == {} and list(module.parameters()) == []
    assert module.state_dict().keys() == eager.Sequential(eager.Identity(), eager.Identity()).state_dict().keys()
    assert [repr(child) for child in module.children()] == ["Identity()", "Identity()"]
    assert generated.IdentityOnly.in_features is None and generated.IdentityOnly.out_features is None


def test_the_eager_oracle_agrees():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(12))
    assert torch.equal(generated.IdentityOnly()(x), eager.Sequential(eager.Identity(), eager.Identity())(x))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(5, 3), (2, 37, 64)], ids=["2-D", "3-D"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_gpu(dtype, shape):
    check("cuda", dtype, shape)
