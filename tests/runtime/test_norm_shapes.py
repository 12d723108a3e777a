"""LayerNorm and RMSNorm over several trailing dims (specs/te_norms.py's layernorm_2d and
rmsnorm_groups), as TE's and PyTorch's multi-dim normalized_shape: outputs, input grads and
parameter grads against float64 references that normalise the N-D tensors over their last dims;
parameters of normalized_shape's shape under TE's state_dict keys; the eager oracle agrees; clear
errors for inputs whose dims do not end in normalized_shape. On CPU and, marked cuda, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import generated
from fusegen import eager
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.pipeline import build_pipeline
from references import as64, randomize_, run_and_compare


def layernorm_2d(p, x):
    return (F.layer_norm(x, (7, 2), p["0.weight"], p["0.bias"], 1e-5),)


def rmsnorm_groups(p, x):
    """Linear(64, 64), RMSNorm((4, 64), zero_centered_gamma=True) over each [4, 64] group, Linear(64, 32)."""
    h = F.linear(x, p["0.weight"], p["0.bias"])
    ms = h.pow(2).mean(dim=(-2, -1), keepdim=True)
    h = h * torch.rsqrt(ms + 1e-5) * (1 + p["1.weight"])
    return (F.linear(h, p["2.weight"], p["2.bias"]),)


# class -> (reference, the normalised trailing dims, whether a GEMM runs)
CASES = {"Layernorm2d": (layernorm_2d, (7, 2), False), "RmsnormGroups": (rmsnorm_groups, (4, 64), True)}


def check(cls, dtype, device, lead):
    reference, dims, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(4))
    run_and_compare(module, cls, (*lead, *dims), dtype, device, seed=5, ref_device=device, reference=reference,
                    gemm=gemm)


@pytest.mark.parametrize("lead", [(1,), (2, 3)], ids=["1 row", "2x3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype, lead):
    check(cls, dtype, "cpu", lead)


def test_layernorm_over_two_dims_in_float64_matches_torch_to_roundoff():
    """float64 on CPU, compared tighter than the pipelines' 4 units of a 16-bit type: output, input
    grad, weight and bias grads against torch's own layer_norm over (7, 2)."""
    module = generated.Layernorm2d(dtype=torch.float64)
    randomize_(module, torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 7, 2, generator=gen, dtype=torch.float64)
    dy = torch.randn(3, 5, 7, 2, generator=gen, dtype=torch.float64)
    weight, bias = (as64(t, "cpu", True) for t in (module._modules["0"].weight, module._modules["0"].bias))
    x_ref, x_got = as64(x, "cpu", True), as64(x, "cpu", True)
    y_ref = F.layer_norm(x_ref, (7, 2), weight, bias, 1e-5)
    y_ref.backward(dy)
    y = module(x_got)
    y.backward(dy)
    assert y.shape == (3, 5, 7, 2)
    for got, want in [(y, y_ref), (x_got.grad, x_ref.grad), (module._modules["0"].weight.grad, weight.grad),
                      (module._modules["0"].bias.grad, bias.grad)]:
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_parameters_keep_normalized_shape_under_te_keys_as_the_eager_sequential():
    fused = generated.RmsnormGroups()
    oracle = eager.Sequential(eager.Linear(64, 64), eager.RMSNorm((4, 64), zero_centered_gamma=True),
                              eager.Linear(64, 32))
    shapes = {k: tuple(v.shape) for k, v in fused.state_dict().items()}
    assert shapes == {"0.weight": (64, 64), "0.bias": (64,), "1.weight": (4, 64), "2.weight": (32, 64),
                      "2.bias": (32,)}
    assert shapes == {k: tuple(v.shape) for k, v in oracle.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in generated.Layernorm2d().state_dict().items()} == {
        "0.weight": (7, 2), "0.bias": (7, 2)}


@pytest.mark.parametrize("cls", sorted(CASES))
def test_the_eager_oracle_agrees(cls):
    """fusegen.eager's norms normalise the same trailing dims (the state_dict loaded across)."""
    reference, dims, _ = CASES[cls]
    fused = getattr(generated, cls)(dtype=torch.float64)
    randomize_(fused, torch.Generator().manual_seed(8))
    oracle = {"Layernorm2d": lambda: eager.Sequential(eager.LayerNorm((7, 2))),
              "RmsnormGroups": lambda: eager.Sequential(eager.Linear(64, 64),
                                                        eager.RMSNorm((4, 64), zero_centered_gamma=True),
                                                        eager.Linear(64, 32))}[cls]().double()
    oracle.load_state_dict(fused.state_dict())
    x = torch.randn(2, 3, *dims, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (want,) = reference({k: v.detach() for k, v in fused.state_dict().items()}, x)
    torch.testing.assert_close(oracle(x), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused(x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 2), (4, 2, 2), (2,)], ids=["14 not 7 rows", "[2, 2] not [7, 2]", "1-D"])
def test_an_input_whose_dims_do_not_end_in_normalized_shape_is_a_clear_error(shape):
    with pytest.raises(ValueError, match=r"Layernorm2d: LayerNorm\(\(7, 2\)\) \(op 0 at specs/te_norms.py:\d+:\d+\) normalises "
                                         r"the last 2 dims, so its input's shape must end in \[7, 2\]"):
        generated.Layernorm2d()(torch.randn(shape))
    with pytest.raises(ValueError, match=r"LayerNorm\(\(7, 2\)\) normalises the last 2 dims, so its input's shape "
                                         r"must end in \[7, 2\]"):
        eager.LayerNorm((7, 2))(torch.randn(shape))


def test_an_input_whose_last_dim_is_not_the_norms_is_the_input_check():
    with pytest.raises(ValueError, match=r"Layernorm2d: x must have shape \[\.\.\., 2\], got \[5, 2, 7\]"):
        generated.Layernorm2d()(torch.randn(5, 2, 7))


def _pipeline(ops):
    (spec,) = parse_spec(f"import transformer_engine.pytorch as te\nimport torch\nm = te.ops.Sequential({ops})\n",
                         "spec.py")
    return build_pipeline(spec)


def test_the_ops_after_the_norm_see_the_last_dim_as_in_te():
    """The norm reads [..., 7, 2] as rows of 14 between two views; ops around it see the last dim, 2
    (torch.nn's spelling too)."""
    p = _pipeline("te.ops.Bias(2), torch.nn.LayerNorm([7, 2]), te.ops.GELU()")
    assert [op.opdef.name for op in p.ops] == ["Bias", "FlattenRows", "LayerNorm", "UnflattenRows", "GELU"]
    assert [p.width(i) for i in range(6)] == [2, 2, 14, 14, 2, 2]
    assert p.ops[2].params[0][2] == (7, 2)
    with pytest.raises(SpecError, match=r"Linear\(\) expects 14 input features, but the op before it \(LayerNorm "
                                        r"at line 3\) produces 2"):
        _pipeline("te.ops.LayerNorm((7, 2)), te.ops.Linear(14, 8)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 group", "185 groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)
