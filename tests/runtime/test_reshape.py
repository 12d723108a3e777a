"""TE's Reshape (specs/te_reshape.py): outputs with the leading dims the reshapes make, every grad,
against float64 references that reshape the N-D tensors as TE does; clear errors for shapes that
cannot work, in the spec and at run time. On CPU and, marked cuda, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import generated
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from references import randomize_, rms_norm, run_and_compare


def head_norm(p, x):
    h = F.linear(x, p["0.weight"], p["0.bias"]).reshape(-1, 4, 64)
    return (F.gelu(rms_norm(h, p["2.weight"]).reshape(-1, 256), approximate="tanh"),)


def rows_of_64(p, x):
    h = F.silu(x).reshape(-1, 64)
    return h + p["3.bias"], h


# class -> (reference, input width, whether a GEMM runs)
CASES = {"HeadNorm": (head_norm, 256, True), "RowsOf64": (rows_of_64, 128, False)}


def check(cls, dtype, device, lead):
    reference, width, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    run_and_compare(module, cls, (*lead, width), dtype, device, seed=3, ref_device=device, reference=reference, gemm=gemm)


@pytest.mark.parametrize("lead", [(1,), (2, 3)], ids=["1 row", "2x3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype, lead):
    check(cls, dtype, "cpu", lead)


def test_outputs_take_the_leading_dims_the_reshapes_make():
    assert generated.HeadNorm()(torch.randn(2, 3, 256)).shape == (6, 256)
    y, tee = generated.RowsOf64()(torch.randn(2, 3, 192))  # any width whose rows fill rows of 64
    assert y.shape == (18, 64) and tee.shape == (18, 64)
    assert generated.RowsOf64.out_features == 64 and generated.RowsOf64.in_features is None


def test_an_input_the_reshape_cannot_take_is_a_clear_error():
    with pytest.raises(ValueError, match=r"RowsOf64: Reshape\(\(-1, 64\)\) \(op 1 at specs/te_reshape.py:17:\d+\) cannot reshape the 90 elements "
                                         r"it receives to \[-1, 64\]; give an input whose size fits the shape"):
        generated.RowsOf64()(torch.randn(3, 30))


@pytest.mark.parametrize("call, message", [
    ("Reshape((-1, -1, 64))", "argument 'shape' of Reshape may hold -1 at most once"),
    ("Reshape((8, -1))", "argument 'shape' of Reshape must give its last dim (the feature size the ops after it see)"),
    ("Reshape((0, 8))", "must hold positive sizes"),
    ("Reshape(())", "must be a non-empty tuple of ints"),
    ("Reshape((2.0, 8))", "must be a non-empty tuple of ints"),
])
def test_shapes_that_cannot_work_are_spec_errors(call, message):
    with pytest.raises(SpecError) as info:
        parse_spec(f"import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.{call})\n", "spec.py")
    assert message in info.value.message


def test_sizes_do_not_flow_back_through_a_reshape():
    from fusegen.pipeline import build_pipeline

    (spec,) = parse_spec("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.GELU(), "
                         "te.ops.Reshape([-1, 8]), te.ops.Linear(8, 4))\n", "spec.py")
    p = build_pipeline(spec)
    assert p.generic and [str(p.width(i)) for i in range(5)] == ["n", "n", "8", "4", "4"]


# --- the eager model (fusegen.eager, the oracle users and tests compare against) ------------------

@pytest.mark.parametrize("x_shape, shape", [
    ((2, 3, 256), (-1, 4, 64)), ((2, 3, 256), (6, 4, 64)), ((2, 3, 256), (2, -1, 64)), ((24, 64), (2, 3, 4, 64)),
    ((5, 12), (-1, 3)), ((2, 3, 4, 16), (-1, 16)), ((7, 8), (7, 8)),
])
def test_eager_reshape_is_torch_reshape(x_shape, shape):
    """fusegen.eager.Reshape was the identity (issue 36): it returns x.reshape(shape), a view of x
    where torch.reshape gives one, as TE's Reshape does, and its grad comes back in x's shape."""
    from fusegen.eager import Reshape, Sequential

    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    y = Sequential(Reshape(shape))(x)
    want = torch.reshape(x.detach(), shape)
    assert y.shape == want.shape and torch.equal(y, want)
    assert y.data_ptr() == x.data_ptr()  # a view: x is contiguous
    dy = torch.randn(want.shape, dtype=torch.float64)
    y.backward(dy)
    assert torch.equal(x.grad, dy.reshape(x_shape))


def test_eager_pipeline_with_reshapes_matches_a_float64_reference():
    """Ops on either side of reshapes see the rows the reshapes make: outputs, the input's grad and
    every parameter grad against torch's own ops in float64."""
    from fusegen.eager import Bias, Linear, Reshape, RMSNorm, Sequential

    torch.manual_seed(0)
    model = Sequential(Linear(256, 256), Reshape((-1, 4, 64)), RMSNorm(64), Reshape((2, -1, 256)), Bias(256)).double()
    randomize_(model, torch.Generator().manual_seed(2))
    params = {k: v.detach().clone().requires_grad_() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 256, dtype=torch.float64)
    x_model, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()

    y = model(x_model)
    h = F.linear(x_ref, params["0.weight"], params["0.bias"]).reshape(-1, 4, 64)
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5) * params["2.weight"]
    want = h.reshape(2, -1, 256) + params["4.bias"]
    assert y.shape == want.shape == (2, 3, 256)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn(want.shape, dtype=torch.float64)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x_model.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    for key, p in model.named_parameters():
        torch.testing.assert_close(p.grad, params[key].grad, rtol=1e-12, atol=1e-12, msg=key)


def test_eager_and_generated_modules_give_the_same_shapes():
    """The eager model of specs/te_reshape.py's HeadNorm, with the generated module's parameters,
    returns what the generated module returns (shape and values)."""
    from fusegen.eager import Linear, Reshape, RMSNorm, Sequential, GELU

    fused = generated.HeadNorm(dtype=torch.float64)
    randomize_(fused, torch.Generator().manual_seed(1))
    eager_model = Sequential(Linear(256, 256), Reshape((-1, 4, 64)), RMSNorm(64), Reshape((-1, 256)), GELU())
    eager_model = eager_model.double()
    eager_model.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, 256, dtype=torch.float64)
    y_fused, y_eager = fused(x), eager_model(x)
    assert y_eager.shape == y_fused.shape == (6, 256)
    torch.testing.assert_close(y_eager, y_fused, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 row", "185 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)
