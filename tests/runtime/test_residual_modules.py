"""Residual(*ops): fusegen's eager Residual (the oracle) and the generated modules nest alike, so
checkpoints move between them; numerics against float64 references are in test_pipelines_cpu.py
(references.PIPELINES: residual_blocks, nested_residual)."""

import pytest
import torch

import generated
from fusegen import eager
from references import PIPELINES, as64, randomize_


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


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [3, 2048], ids=["graphs", "no graphs"])
@pytest.mark.parametrize("name", sorted(EAGER))
def test_gpu_generated_matches_the_eager_oracle_and_float64(name, rows):
    """On the GPU in bf16, a few rows (CUDA-graph replay) and many (column-sum partials): the
    generated module's output and grads (x and every parameter) against float64, and the eager
    model loaded with its weights computes the same output."""
    from references import run_and_compare

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
