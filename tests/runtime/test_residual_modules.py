"""Residual(*ops): fusegen's eager Residual (the oracle) and the generated modules nest alike, so
checkpoints move between them; numerics against float64 references are in test_pipelines_cpu.py
(references.PIPELINES: residual_blocks, nested_residual)."""

import pytest
import torch

import generated
from fusegen import eager
from references import PIPELINES, as64, layer_norm, randomize_, run_and_compare
from spec_packages import imported_package


def eager_residual_blocks(dtype):
    """specs/residual_blocks.py's residual_blocks, built with fusegen.eager."""
    n = 1024
    return eager.Sequential(
        eager.Residual(eager.RMSNorm(n), eager.Linear(n, 4 * n), eager.GELU(), eager.Linear(4 * n, n)),
        eager.Residual(eager.LayerNorm(n), eager.Linear(n, n, bias=False)),
    ).to(dtype)


def eager_nested_residual(dtype):
    n = 1024
    return eager.Sequential(
        eager.Linear(n, n, bias=False),
        eager.Residual(eager.LayerNorm(n), eager.Residual(eager.RMSNorm(n), eager.Linear(n, n)), eager.GELU()),
        eager.RMSNorm(n),
    ).to(dtype)


EAGER = {"residual_blocks": eager_residual_blocks, "nested_residual": eager_nested_residual}


@pytest.mark.parametrize("name", sorted(EAGER))
def test_state_dicts_and_children_nest_as_the_eager_modules(name):
    module = getattr(generated, PIPELINES[name][0])(dtype=torch.float32)
    reference = EAGER[name](torch.float32)
    assert list(module.state_dict()) == list(reference.state_dict())
    shapes = lambda m: {k: v.shape for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(module) == shapes(reference)
    # a Residual is a child holding its ops as its own children, printed as the spec writes them
    assert [m._get_name() for m in module.children()] == [m._get_name() for m in reference.children()]
    assert "Residual(\n" in repr(module)


@pytest.mark.parametrize("name", sorted(EAGER))
def test_checkpoints_move_between_eager_and_generated(name):
    """The eager model's weights load into the generated module (and back) and both compute the
    same function: the eager Residual is y = x + ops(x), the generated one a tee and an add."""
    reference = EAGER[name](torch.float32)
    randomize_(reference, torch.Generator().manual_seed(5))
    module = getattr(generated, PIPELINES[name][0])(dtype=torch.float32)
    module.load_state_dict(reference.state_dict())
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(6))
    expected = PIPELINES[name][1]({k: as64(v, "cpu") for k, v in reference.state_dict().items()}, as64(x, "cpu"))[0]
    scale = expected.abs().max().item()
    for got in (module(x), reference(x)):
        assert (got.double() - expected).abs().max().item() <= 4 * 2.0**-11 * scale
    back = EAGER[name](torch.float32)
    back.load_state_dict(module.state_dict())
    assert torch.equal(back(x), reference(x))


def test_eager_residual_adds_its_input_once_rounded():
    """The eager oracle itself: y = x + ops(x) in float64 then one rounding, in bf16 too."""
    torch.manual_seed(0)
    block = eager.Residual(eager.GELU(), eager.ConstantScale(0.5)).to(torch.bfloat16)
    x = torch.randn(3, 5, 8).bfloat16()
    x64 = x.double()
    expected = (x64 + torch.nn.functional.gelu(x64, approximate="tanh").bfloat16().double() * 0.5).bfloat16()
    assert torch.equal(block(x), expected)


def test_eager_residual_bad_contents_are_errors():
    with pytest.raises(TypeError, match=r"Residual\(\) needs at least one op"):
        eager.Residual()
    with pytest.raises(TypeError, match="a Sequential cannot be nested in a Residual"):
        eager.Residual(eager.Sequential(eager.GELU()))
    with pytest.raises(ValueError, match=r"Residual\(\) cannot hold AddExtraInput\(\)"):
        eager.Residual(eager.AddExtraInput())


SPEC = """\
from fusegen.eager import Sequential, Residual, GELU, LayerNorm, RMSNorm, Linear

# no op fixes the width: a size-generic pipeline (kernels take n at run time)
generic_residual = Sequential(Residual(GELU()), GELU())
# a norm over the last two dims inside a Residual (it runs between views that flatten its rows)
two_dim_norm = Sequential(Residual(LayerNorm((2, 4))), RMSNorm(4))
# Residuals back to back and one that is a whole Sequential's only op
only_residuals = Sequential(Residual(Linear(8, 8)), Residual(Linear(8, 8, bias=False), Residual(GELU())))
"""


def gelu(t):
    return torch.nn.functional.gelu(t, approximate="tanh")


def rms(t, w):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w


REFERENCES = {
    "generic_residual": (lambda p, x: (gelu(x + gelu(x)),), (2, 3, 6)),
    "two_dim_norm": (lambda p, x: (rms(x + torch.nn.functional.layer_norm(x, (2, 4), p["0.0.weight"],
                                                                          p["0.0.bias"]), p["1.weight"]),), (5, 2, 4)),
    "only_residuals": (lambda p, x: ((lambda h: h + (lambda g: g + gelu(g))(h @ p["1.0.weight"].t()))(
        x + x @ p["0.0.weight"].t() + p["0.0.bias"]),), (7, 8)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_residual_shapes_on_cpu_against_float64_and_the_eager_spec(tmp_path, dtype):
    """Residuals where no op fixes the width, around a multi-dim norm and nested back to back:
    output and grads of x and every parameter against float64 (and the no-grad forward); the spec
    run eagerly (its own fusegen.eager Sequential) loads the generated module's weights and agrees."""
    eager_models = {}
    exec(compile(SPEC, "residual_spec.py", "exec"), eager_models)
    with imported_package(tmp_path, "residual_spec.py", SPEC, "residual_pkg", dtypes=("float32", "bfloat16")) as pkg:
        for name, (reference, shape) in REFERENCES.items():
            module = getattr(pkg, "".join(part.capitalize() for part in name.split("_")))(dtype=dtype)
            randomize_(module, torch.Generator().manual_seed(3))
            gemm = name != "generic_residual"
            run_and_compare(module, name, shape, dtype, "cpu", seed=4, reference=reference, gemm=gemm)
            run_and_compare(module, name, shape, dtype, "cpu", seed=4, reference=reference, gemm=gemm,
                            no_grad=(torch.no_grad, torch.inference_mode))
            model = eager_models[name].to(dtype)
            model.load_state_dict(module.state_dict())
            x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)
            expected = reference({k: as64(v, "cpu") for k, v in module.state_dict().items()}, as64(x, "cpu"))[0]
            scale = expected.abs().max().item()
            for got in (module(x), model(x)):
                assert got.shape == x.shape[:-1] + expected.shape[-1:]
                assert (got.double() - expected).abs().max().item() <= 4 * (2.0**-8 if dtype == torch.bfloat16
                                                                              else 2.0**-11) * scale


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [3, 2048], ids=["graphs", "no graphs"])
@pytest.mark.parametrize("name", sorted(EAGER))
def test_gpu_generated_matches_the_eager_oracle_and_float64(name, rows):
    """On the GPU in bf16, a few rows (CUDA-graph replay) and many (column-sum partials): the
    generated module's output and grads (x and every parameter) against float64, and the eager
    model loaded with its weights computes the same output."""
    module = getattr(generated, PIPELINES[name][0])(device="cuda", dtype=torch.bfloat16)
    randomize_(module, torch.Generator().manual_seed(8))
    run_and_compare(module, name, (rows, 1024), torch.bfloat16, "cuda", seed=9, ref_device="cuda")
    reference = EAGER[name](torch.bfloat16).cuda()
    reference.load_state_dict(module.state_dict())
    x = torch.randn(rows, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(10)).bfloat16()
    expected = PIPELINES[name][1]({k: as64(v, "cuda") for k, v in module.state_dict().items()}, as64(x, "cuda"))[0]
    scale = expected.abs().max().item()
    for got in (module(x), reference(x)):
        assert (got.double() - expected).abs().max().item() <= 4 * 2.0**-8 * scale
