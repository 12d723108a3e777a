"""The generated modules' run-time input checks (CPU; no GPU needed)."""

import math
import textwrap

import pytest
import torch

from references import randomize_
from spec_packages import imported_package

# templates/runtime/ is the package each output copies as its _runtime/: tested here as the template
from fusegen.templates import runtime


def test_check_input_errors_say_what_to_do():
    like = torch.zeros(4, dtype=torch.float32)
    runtime.check_input("M", "x", torch.zeros(2, 3, 4), 4, like)
    with pytest.raises(ValueError, match=r"M: x must have shape \[\.\.\., 4\], got \[2, 5\]"):
        runtime.check_input("M", "x", torch.zeros(2, 5), 4, like)
    with pytest.raises(TypeError, match="dtype torch.float16 but the module's parameters are torch.float32"):
        runtime.check_input("M", "x", torch.zeros(2, 4, dtype=torch.float16), 4, like)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        runtime.check_input("M", "x", [1, 2, 3, 4], 4, like)
    with pytest.raises(ValueError, match="same leading shape as x"):
        runtime.check_input("M", "r", torch.zeros(3, 4), 4, like, torch.Size([2]))
    with pytest.raises(ValueError, match="is on meta but the module's parameters are on cpu"):
        runtime.check_input("M", "x", torch.zeros(2, 4, device="meta"), 4, like)



def test_a_generated_modules_repr_names_each_op_as_the_spec_does():
    """Every op of the spec's Sequential, in order, as the spec writes it (the parameter-free ones
    too; Linear as Linear, not as its BasicLinear and Bias); state_dict keys stay the Sequential's.
    On the meta device: neither needs values (TeMlp's 176M parameters would take a second to fill)."""
    import generated

    te_mlp = generated.TeMlp(device="meta")
    assert repr(te_mlp) == (
        "TeMlp(\n"
        "  (0): LayerNorm(4096)\n"
        "  (1): Linear(4096, 28672)\n"
        "  (2): SwiGLU()\n"
        "  (3): Linear(14336, 4096)\n"
        ")")
    assert "(1): Dropout(0.1)" in repr(generated.PostAttention(device="meta"))
    assert sorted(te_mlp.state_dict()) == ["0.bias", "0.weight", "1.bias", "1.weight", "3.bias", "3.weight"]


# --- inputs of every shape, dtype and device, checked at run time (CPU packages, no binaries) ----

EDGE_SPEC = textwrap.dedent("""\
    from fusegen.eager import (Sequential, AddExtraInput, Bias, ConstantScale, GELU, LayerNorm, Linear,
                               MakeExtraOutput, SwiGLU)
    scale3 = Sequential(ConstantScale(3.0))
    gelu_any = Sequential(GELU())
    residual_gelu = Sequential(AddExtraInput(), MakeExtraOutput(), GELU())
    swiglu_any = Sequential(SwiGLU())
    norm_linear = Sequential(LayerNorm(4), Linear(4, 6))
    bias_gelu = Sequential(Bias(4), GELU())
""")


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    with imported_package(tmp_path_factory.mktemp("edges"), "edge_spec.py", EDGE_SPEC, "edge_pkg") as pkg:
        yield pkg


def gelu64(t):
    """GELU's tanh form (TE's), written out in float64."""
    return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))


def leaf(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def as_ref(t):
    return t.detach().double().requires_grad_()


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)], ids=["0-D", "1-D", "3-D"])
@pytest.mark.parametrize("name, reference", [("Scale3", lambda t: 3 * t), ("GeluAny", gelu64)])
def test_an_elementwise_pipeline_takes_any_shape_as_te_does(edges, name, reference, shape):
    x, gy = leaf(shape, 0), torch.randn(shape, generator=torch.Generator().manual_seed(1))
    y = getattr(edges, name)()(x)
    assert y.shape == shape  # 0-D stays 0-D, as TE's ConstantScale(3.0) of a scalar
    y.backward(gy)
    x64 = as_ref(x)
    y64 = reference(x64)
    y64.backward(gy.double())
    torch.testing.assert_close(y.double(), y64, rtol=1.3e-6, atol=1e-5)  # TE's fp32 single-op tolerances
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("shape", [(), (7,)], ids=["0-D", "1-D"])
def test_extra_inputs_and_outputs_of_an_elementwise_pipeline_take_x_s_shape(edges, shape):
    x, r = leaf(shape, 2), leaf(shape, 3)
    gy, g_tee = (torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    y, tee = edges.ResidualGelu()(x, r)
    assert y.shape == shape and tee.shape == shape
    torch.autograd.backward((y, tee), (gy, g_tee))
    x64, r64 = as_ref(x), as_ref(r)
    s64 = x64 + r64
    torch.autograd.backward((gelu64(s64), s64), (gy.double(), g_tee.double()))
    torch.testing.assert_close(y.double(), gelu64(s64).detach(), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(tee.double(), s64.detach(), rtol=1.3e-6, atol=1e-5)
    for got, want in ((x.grad, x64.grad), (r.grad, r64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match=rf"ResidualGelu: extra_input0 must have x's shape, \[{', '.join(map(str, shape))}\], got \[1\]"):
        edges.ResidualGelu()(x, torch.zeros(1))


def test_a_one_d_input_of_a_linear_pipeline_is_one_row(edges):
    """TE's Linear and LayerNorm take [..., K]: a 1-D input is one row, and the output is 1-D."""
    module = edges.NormLinear(dtype=torch.float64)
    randomize_(module, torch.Generator().manual_seed(6))
    x = leaf((4,), 7, torch.float64)
    y = module(x)
    assert y.shape == (6,)
    gy = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    y.backward(gy)
    p = {k: as_ref(v) for k, v in module.state_dict().items()}
    x64 = as_ref(x)
    mean, var = x64.mean(), ((x64 - x64.mean()) ** 2).mean()
    h = (x64 - mean) / torch.sqrt(var + 1e-5) * p["0.weight"] + p["0.bias"]
    y64 = p["1.weight"] @ h + p["1.bias"]
    y64.backward(gy)
    torch.testing.assert_close(y, y64.detach(), rtol=1e-12, atol=1e-12)  # float64 on CPU: tighter than TE's
    torch.testing.assert_close(x.grad, x64.grad, rtol=1e-12, atol=1e-12)
    for key, param in module.named_parameters():
        torch.testing.assert_close(param.grad, p[key].grad, rtol=1e-12, atol=1e-12)


def test_a_shape_constraint_that_exists_is_named(edges):
    with pytest.raises(ValueError, match=r"SwigluAny: x must have shape \[\.\.\., n\] with n a multiple of 2 "
                                         r"\(the pipeline's GLUs split each row\), got \[\]"):
        edges.SwigluAny()(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"NormLinear: x must have shape \[\.\.\., 4\], got \[\]"):
        edges.NormLinear()(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"BiasGelu: x must have shape \[\.\.\., 4\], got \[3\]"):
        edges.BiasGelu()(torch.zeros(3))


@pytest.mark.parametrize("value", [torch.tensor([1, 2, -3]), torch.tensor([True, False, True]),
                                   torch.tensor([1 + 2j, -1j, 3])], ids=["int64", "bool", "complex64"])
@pytest.mark.parametrize("name", ["GeluAny", "Scale3", "BiasGelu"])
def test_integer_bool_and_complex_inputs_are_refused_naming_the_dtype(edges, name, value):
    """torch's GELU refuses them; computed in float and cast back, GELU([1, 2, -3]) gave [0, 1, 0]."""
    x = value.repeat(4)[:4] if name == "BiasGelu" else value
    with pytest.raises(TypeError, match=rf"{name}: x has dtype {value.dtype}, but the module takes floating-point "
                                        r"tensors only \(float32, float16, bfloat16; float64 on CPU\)"):
        getattr(edges, name)()(x)
    with torch.no_grad(), pytest.raises(TypeError, match=f"x has dtype {value.dtype}"):
        getattr(edges, name)()(x)


def test_an_integer_extra_input_is_refused(edges):
    with pytest.raises(TypeError, match="ResidualGelu: extra_input0 has dtype torch.int64"):
        edges.ResidualGelu()(torch.zeros(3), torch.tensor([1, 2, 3]))


def test_meta_tensors_propagate_shapes_as_the_eager_model_does(edges):
    """On the meta device the module runs as eager torch does there: shapes, dtypes and grads'
    shapes, no values (no kernel is launched)."""
    module = edges.NormLinear(device="meta")
    x = torch.empty(3, 5, 4, device="meta", requires_grad=True)
    y = module(x)
    assert y.shape == (3, 5, 6) and y.device.type == "meta" and y.dtype == torch.float32
    y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.is_meta
    assert all(p.grad.shape == p.shape and p.grad.is_meta for p in module.parameters())
    with torch.no_grad():
        assert module(torch.empty(7, 4, device="meta")).shape == (7, 6)
    y, tee = edges.ResidualGelu()(torch.empty(2, 9, device="meta"), torch.empty(2, 9, device="meta"))
    assert y.shape == tee.shape == (2, 9) and y.is_meta
    assert edges.Scale3()(torch.empty((), device="meta")).shape == ()
    with pytest.raises(ValueError, match=r"NormLinear: x is on cpu but the module's parameters are on meta; move "
                                         r"one of them \(meta parameters hold no values: module.to_empty"):
        module(torch.zeros(2, 4))


def test_every_shipped_module_runs_on_meta_tensors():
    """Forward and backward of every shipped module on meta tensors (TeMlp's too: no memory)."""
    import generated
    from references import INPUT_SHAPES, module_inputs, module_names

    for name in module_names(generated):  # (one process: not those built for a tensor-parallel group)
        cls = getattr(generated, name)
        module = cls(device="meta")
        inputs = [t.requires_grad_() for t in module_inputs(module, 5, torch.Generator(), device="meta")]
        outputs = module(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        assert outputs[0].is_meta, name
        if name not in INPUT_SHAPES:  # those take and give other shapes than [rows, features]
            assert outputs[0].shape[0] == 5, name
            if module.out_features is not None:  # a size-generic module's depends on x's width
                assert outputs[0].shape == (5, module.out_features), name
        sum(o.sum() for o in outputs).backward()
        assert all(t.grad.shape == t.shape for t in inputs if t.is_floating_point()), name
        assert all(p.grad is not None and p.grad.shape == p.shape for p in module.parameters()), name


@pytest.mark.parametrize("change, error, message", [
    ("cast", TypeError, r"NormLinear: parameter 1.weight has dtype torch.float16 but 0.weight has torch.float32; "
                        r"the module computes in one dtype: cast the whole module \(module.to\(dtype\)\)"),
    ("shape", ValueError, r"NormLinear: parameter 1.weight has shape \[6, 2\], but the spec's op makes it \[6, 4\]; "
                          r"load a state_dict of the spec's shapes"),
    ("device", ValueError, r"NormLinear: parameter 1.weight is on meta but 0.weight is on cpu; move the whole module"),
    ("none", TypeError, r"NormLinear: parameter 1.weight must be a torch.Tensor, got NoneType"),
])
def test_a_parameter_replaced_or_cast_after_construction_is_named(edges, change, error, message):
    module = edges.NormLinear()
    linear = module.get_submodule("1")
    weight = linear.weight
    linear.weight = {"cast": lambda: torch.nn.Parameter(weight.detach().half()),
                     "shape": lambda: torch.nn.Parameter(weight.detach()[:, :2].clone()),
                     "device": lambda: torch.nn.Parameter(torch.empty(6, 4, device="meta")),
                     "none": lambda: None}[change]()
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(error, match=message):
            module(torch.zeros(2, 4))


def test_every_parameter_cast_together_is_only_a_dtype_mismatch_with_x(edges):
    module = edges.NormLinear().half()
    with pytest.raises(TypeError, match="NormLinear: x has dtype torch.float32 but the module's parameters are "
                                        "torch.float16; convert the input or the module"):
        module(torch.zeros(2, 4))
