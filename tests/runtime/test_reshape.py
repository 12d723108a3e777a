"""TE's Reshape (specs/te_reshape.py): outputs with the leading dims the reshapes make, every grad,
against float64 references that reshape the N-D tensors as TE does; clear errors for shapes that
cannot work, in the spec and at run time. On CPU and, marked cuda, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import generated
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.pipeline import build_pipeline
from references import as64, assert_close_to_reference, randomize_, rms_norm, run_and_compare


def head_norm(p, x):
    h = F.linear(x, p["0.weight"], p["0.bias"]).reshape(-1, 4, 64)
    return (F.gelu(rms_norm(h, p["2.weight"]).reshape(-1, 256), approximate="tanh"),)


def rows_of_64(p, x):
    h = F.silu(x).reshape(-1, 64)
    return h + p["3.bias"], h


def split_norm(p, x):
    """GELU, Reshape((2, 3, -1)) whose last dim the RMSNorm(64) after it fixes."""
    return (rms_norm(F.gelu(x, approximate="tanh").reshape(2, 3, -1), p["2.weight"]),)


# class -> (reference, input width, whether a GEMM runs)
CASES = {"HeadNorm": (head_norm, 256, True), "RowsOf64": (rows_of_64, 128, False)}
# inputs of 6 x 64 elements: the only ones Reshape((2, 3, -1)) followed by RMSNorm(64) takes
SPLIT_NORM_SHAPES = {"1 row of 384": (1, 384), "2x3 rows of 64": (2, 3, 64), "4 rows of 96": (4, 96)}


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


@pytest.mark.parametrize("shape", list(SPLIT_NORM_SHAPES.values()), ids=list(SPLIT_NORM_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_last_dim_of_minus_one_fixed_by_the_op_after_it_cpu(dtype, shape):
    check_split_norm(dtype, "cpu", shape)


def check_split_norm(dtype, device, shape):
    module = generated.SplitNorm(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    run_and_compare(module, "SplitNorm", shape, dtype, device, seed=3, ref_device=device, reference=split_norm,
                    gemm=False)


def split_rows(x, r):
    """Reshape((2, 3, -1)) to whatever width the input makes, SwiGLU, AddExtraInput."""
    a, b = x.reshape(2, 3, -1).chunk(2, dim=-1)
    return F.silu(a) * b + r


def check_split_rows(dtype, device, shape):
    """A -1 last dim no op after it fixes: the width comes from the input at run time, and the
    extra input has the shape the reshape and the GLU make; every output and grad against float64."""
    gen = torch.Generator().manual_seed(5)
    width = shape[-1] * (shape[0] if len(shape) > 1 else 1) // 6
    x, r = torch.randn(shape, generator=gen), torch.randn(2, 3, width // 2, generator=gen)
    dy = torch.randn(2, 3, width // 2, generator=gen)
    x_ref, r_ref = as64(x, device, True), as64(r, device, True)
    y_ref = split_rows(x_ref, r_ref)
    y_ref.backward(dy.to(device, torch.float64))
    x_got, r_got = (t.to(device, dtype).requires_grad_() for t in (x, r))
    y = generated.SplitRows()(x_got, r_got)
    assert y.shape == (2, 3, width // 2)
    y.backward(dy.to(device, dtype))
    for name, got, want in [("y", y, y_ref), ("dx", x_got.grad, x_ref.grad), ("dr", r_got.grad, r_ref.grad)]:
        assert_close_to_reference(f"SplitRows {name}", got, want, dtype, gemm=False)


SPLIT_ROWS_SHAPES = {"1 row of 12": (1, 12), "4 rows of 24": (4, 24), "3 rows of 256": (3, 256)}


@pytest.mark.parametrize("shape", list(SPLIT_ROWS_SHAPES.values()), ids=list(SPLIT_ROWS_SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_last_dim_of_minus_one_known_at_run_time_cpu(dtype, shape):
    check_split_rows(dtype, "cpu", shape)


def test_a_run_time_last_dim_has_no_fixed_size_and_checks_what_the_ops_after_it_need():
    assert generated.SplitRows.out_features is None and generated.SplitRows.extra_input_features == (None,)
    assert generated.SplitNorm.out_features == 64
    with pytest.raises(ValueError, match=r"SplitRows: Reshape\(\(2, 3, -1\)\) \(op 0 at specs/te_reshape.py:20:\d+\) reshapes "
                                         r"the 18 elements it receives to \[2, 3, 3\], but the ops after it split each "
                                         r"row into halves \(GLUs\), so its last dim must be a multiple of 2"):
        generated.SplitRows()(torch.randn(3, 6), torch.randn(2, 3, 1))
    with pytest.raises(ValueError, match=r"SplitRows: Reshape\(\(2, 3, -1\)\) \(op 0 at specs/te_reshape.py:20:\d+\) cannot "
                                         r"reshape the 20 elements it receives to \[2, 3, -1\]"):
        generated.SplitRows()(torch.randn(4, 5), torch.randn(2, 3, 1))
    with pytest.raises(ValueError, match=r"SplitRows: extra_input0 must have shape \[\.\.\., 2\]"):
        generated.SplitRows()(torch.randn(2, 12), torch.randn(2, 3, 3))
    with pytest.raises(ValueError, match=r"SplitNorm: Reshape\(\(2, 3, -1\)\) \(op 1 at specs/te_reshape.py:21:\d+\) reshapes "
                                         r"the 768 elements it receives to \[2, 3, 128\], but the ops after it take 64 "
                                         r"features; give an input of 384 elements"):
        generated.SplitNorm()(torch.randn(6, 128))


def _pipeline(ops):
    (spec,) = parse_spec(f"import transformer_engine.pytorch as te\nm = te.ops.Sequential({ops})\n", "spec.py")
    return build_pipeline(spec)


def test_a_last_dim_of_minus_one_is_the_width_the_ops_after_it_fix_or_a_run_time_one():
    p = _pipeline("te.ops.Linear(8, 8), te.ops.Reshape((4, -1)), te.ops.SwiGLU(), te.ops.Bias(16)")
    assert [p.width(i) for i in range(6)] == [8, 8, 8, 32, 16, 16]  # BasicLinear, Bias, Reshape, SwiGLU, Bias
    p = _pipeline("te.ops.Linear(8, 8), te.ops.Reshape((4, -1)), te.ops.SwiGLU(), te.ops.GELU()")
    assert [str(p.width(i)) for i in range(6)] == ["8", "8", "8", "reshape1_width", "reshape1_width / 2",
                                                    "reshape1_width / 2"]
    assert not p.generic and p.divisor == 1 and p.divisor_of("reshape1_width") == 2


@pytest.mark.parametrize("ops, message", [
    ("te.ops.Linear(10, 10), te.ops.Reshape((2, 3, -1)), te.ops.LayerNorm(8)",
     "Reshape((2, 3, -1)) makes [2, 3, 8] (48 elements; 8, the features the ops after it take, as its last dim), "
     "which no number of its input's rows of 10 features gives; make the sizes agree"),
    ("te.ops.Reshape((2, -1)), te.ops.GELU(), te.ops.Reshape((-1, 4))",
     "Reshape() reshapes reshape0_width features, the width an earlier Reshape with a -1 last dim makes at run "
     "time, which fusegen does not support yet; give one of the two Reshapes its last dim"),
    ("te.ops.Reshape((2, -1)), " + "te.ops.SwiGLU(), " * 24 + "te.ops.Bias(4)",
     "Bias() expects 4 input features, so the Reshape before it with a -1 last dim would make 67108864, more than "
     "fusegen's bound of 16777216 (2**24); give the pipeline fewer GLUs or smaller sizes"),
])
def test_sizes_a_last_dim_of_minus_one_cannot_take_are_spec_errors(ops, message):
    with pytest.raises(SpecError) as info:
        _pipeline(ops)
    assert info.value.message == message


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
    ("Reshape((0, 8))", "must hold positive sizes"),
    ("Reshape(())", "must be a non-empty tuple of ints"),
    ("Reshape((2.0, 8))", "must be a non-empty tuple of ints"),
])
def test_shapes_that_cannot_work_are_spec_errors(call, message):
    with pytest.raises(SpecError) as info:
        parse_spec(f"import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.{call})\n", "spec.py")
    assert message in info.value.message


def test_sizes_do_not_flow_back_through_a_reshape():
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_a_last_dim_of_minus_one_gpu(dtype):
    for shape in SPLIT_NORM_SHAPES.values():
        check_split_norm(dtype, "cuda", shape)
    for shape in SPLIT_ROWS_SHAPES.values():
        check_split_rows(dtype, "cuda", shape)
