"""Size-generic pipelines (specs/size_generic.py: no op fixes the width) at widths 1, 7, 64, 1003,
4096 and 8192, one row and many, against float64 references: on CPU (the reference launchers)
and, marked cuda, through the kernels on a GPU, on their 16-byte vector path (aligned rows), their
scalar path (odd widths, or rows that start off a 16-byte boundary) and the fixed-size kernels
their launchers hand a width to (swiglu_any at 8192, pyproject.toml's features)."""

import pytest
import torch

import generated
from generated import _kernels
from references import GENERIC_PIPELINES, randomize_, run_and_compare

WIDTHS = [1, 7, 64, 1003, 4096, 8192]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def on_gpu(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


def _run(name, width, dtype, device, lead=(3,), make_input=None, seed=0):
    cls, reference, halves = GENERIC_PIPELINES[name]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    n = 2 * width if halves else width  # a GLU's input is twice its output
    run_and_compare(module, name, (*lead, n), dtype, device, make_input=make_input, seed=seed,
                    ref_device=device, reference=reference, gemm=False)


@pytest.mark.parametrize("width", WIDTHS[:5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(GENERIC_PIPELINES))
def test_cpu(name, dtype, width):
    _run(name, width, dtype, "cpu", lead=(2, 3), seed=width)


def test_one_module_serves_several_widths_and_rejects_what_it_cannot_take():
    module = generated.SwigluAny(dtype=torch.float32)
    assert module(torch.randn(2, 6)).shape == (2, 3) and module(torch.randn(4, 10)).shape == (4, 5)
    assert module.in_features is None and generated.ResidualAny.extra_input_features == ("n",)
    with pytest.raises(ValueError, match=r"SwigluAny: x must have shape \[\.\.\., n\] with n a multiple of 2 "
                                         r"\(the pipeline's GLUs split each row\), got \[2, 7\]"):
        module(torch.randn(2, 7))
    residual = generated.ResidualAny()
    with pytest.raises(ValueError, match=r"ResidualAny: extra_input0 must have x's shape, \[2, 5\], got \[2, 4\]"):
        residual(torch.randn(2, 5), torch.randn(2, 4))
    with pytest.raises(TypeError, match="ResidualAny: extra_input0 has dtype torch.float64 but x is torch.float32"):
        residual(torch.randn(2, 5), torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="ResidualAny: x must be a torch.Tensor, got list"):
        residual([1.0], torch.randn(2, 5))


def test_the_specialised_width_is_dispatched_to_its_fixed_size_kernel():
    """pyproject.toml builds swiglu_any at 8192 input features: 4096 out, the fixed-size kernels'
    width; every other width runs the size-generic kernels."""
    assert _kernels._SWIGLU_FWD_ANY_FIXED[4096] is _kernels.swiglu_fwd_n4096
    assert _kernels._SWIGLU_BWD_ANY_FIXED[4096] is _kernels.swiglu_bwd_n4096
    assert not hasattr(_kernels, "_RESIDUAL_ANY_FIXED")
    # only when every operand starts on a 16-byte boundary; an operand not passed (a Dropout key in
    # eval mode) does not count
    buffer = torch.zeros(17)
    assert _kernels.aligned(buffer[:16], None) and not _kernels.aligned(buffer[1:], None)


# --- on a GPU -------------------------------------------------------------------------------

def _misaligned(t):
    """The same values, contiguous, starting one element past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buffer[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@on_gpu
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", sorted(GENERIC_PIPELINES))
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 row", "185 rows"])
def test_gpu(name, dtype, width, lead):
    _run(name, width, dtype, "cuda", lead=lead, seed=width)


@on_gpu
@pytest.mark.parametrize("width", [64, 4096])
@pytest.mark.parametrize("name", sorted(GENERIC_PIPELINES))
def test_gpu_rows_off_a_16_byte_boundary_take_the_scalar_path(name, width):
    _run(name, width, torch.bfloat16, "cuda", lead=(7,), make_input=_misaligned, seed=3)


@on_gpu
def test_gpu_fixed_and_generic_kernels_agree_bit_for_bit():
    """Same math, same order: the fixed-size kernel and the generic one (reached with rows off a
    16-byte boundary for the scalar path, or a width no fixed kernel has) give identical bits."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(33, 8192, generator=gen).to("cuda", torch.bfloat16)
    fixed = _kernels.swiglu_fwd_n4096(x)
    generic = _kernels._SWIGLU_FWD_ANY.launch  # the generic kernel on the vector path, directly
    y = torch.empty_like(fixed)
    generic(x.dtype, (4, 33, 1), (128, 1, 1), (x.data_ptr(), y.data_ptr(), 33, 4096), x.get_device())
    assert torch.equal(fixed, y)
    assert torch.equal(fixed, _kernels.swiglu_fwd_any(_misaligned(x)))  # scalar path


def _scalar_and_vector(name, device, shape):
    """A 0-D or 1-D x (and extra input) through a pipeline that takes any shape (TE's elementwise
    ops do), against its float64 reference: outputs keep x's shape, and so do the grads."""
    cls, reference, _ = GENERIC_PIPELINES[name]
    module = getattr(generated, cls)(device=device)
    gen = torch.Generator().manual_seed(9)
    inputs = [torch.randn(shape, generator=gen).to(device).requires_grad_()
              for _ in range(1 + len(module.extra_input_features))]
    outputs = module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn(shape, generator=gen).to(device) for _ in outputs]
    torch.autograd.backward(outputs, grads)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    outputs64 = reference({}, *inputs64)
    torch.autograd.backward(outputs64, [g.double() for g in grads])
    for got, want in [*zip(outputs, outputs64), *((t.grad, t64.grad) for t, t64 in zip(inputs, inputs64))]:
        assert got.shape == shape
        torch.testing.assert_close(got.double(), want.detach(), rtol=1.3e-6, atol=1e-5)  # TE's fp32 tolerances


@pytest.mark.parametrize("shape", [(), (5,)], ids=["0-D", "1-D"])
@pytest.mark.parametrize("name", ["gelu_any", "residual_any"])
def test_cpu_scalar_and_vector_inputs(name, shape):
    _scalar_and_vector(name, "cpu", shape)


@on_gpu
@pytest.mark.parametrize("shape", [(), (5,)], ids=["0-D", "1-D"])
@pytest.mark.parametrize("name", ["gelu_any", "residual_any"])
def test_gpu_scalar_and_vector_inputs(name, shape):
    _scalar_and_vector(name, "cuda", shape)
