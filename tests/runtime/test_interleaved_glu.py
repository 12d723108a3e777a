"""GLUs with glu_interleave_size (specs/te_interleaved_glu.py) against float64 references that split
the interleaved blocks independently, on CPU and, marked cuda, on a GPU; and the spec errors for
sizes the blocks do not fit."""

import pytest
import torch
import torch.nn.functional as F

import generated
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.pipeline import build_pipeline
from references import randomize_, run_and_compare


def split_blocks(t, k):
    """(a, b) of rows [a(k), b(k), a(k), b(k), ...]."""
    blocks = t.reshape(*t.shape[:-1], t.shape[-1] // (2 * k), 2, k)
    return blocks[..., 0, :].flatten(-2), blocks[..., 1, :].flatten(-2)


def interleaved_mlp(p, x):
    a, b = split_blocks(F.linear(x, p["0.weight"], p["0.bias"]), 32)
    return (F.linear(F.silu(a) * b, p["2.weight"], p["2.bias"]),)


def interleaved_any(p, x):
    a, b = split_blocks(x, 16)
    a = a.clamp(max=3.0)
    return (a * torch.sigmoid(1.702 * a) * (b.clamp(-3.0, 3.0) + 1.0),)


# class -> (reference, input widths, whether a GEMM runs)
CASES = {"InterleavedMlp": (interleaved_mlp, (256,), True), "InterleavedAny": (interleaved_any, (32, 96, 4096), False)}


def check(cls, dtype, device, lead):
    reference, widths, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    for width in widths:
        run_and_compare(module, cls, (*lead, width), dtype, device, seed=width, ref_device=device, reference=reference,
                        gemm=gemm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype):
    check(cls, dtype, "cpu", (2, 3))


def test_a_width_the_blocks_do_not_fit_is_an_error():
    with pytest.raises(ValueError, match=r"InterleavedAny: x must have shape \[\.\.\., n\] with n a multiple of 32"):
        generated.InterleavedAny()(torch.randn(2, 48))
    (spec,) = parse_spec("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Linear(4, 96), "
                         "te.ops.SwiGLU(glu_interleave_size=32))\n", "spec.py")
    with pytest.raises(SpecError, match="SwiGLU\\(\\) with glu_interleave_size=32 reads blocks \\[a\\(32\\), b\\(32\\), "
                                        "...\\], but it receives 96 features, not a multiple of 64"):
        build_pipeline(spec)
    # a size passed back from the op after it is checked too
    (spec,) = parse_spec("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.GELU(), "
                         "te.ops.SwiGLU(glu_interleave_size=32), te.ops.Linear(48, 8))\n", "spec.py")
    with pytest.raises(SpecError, match="it receives 96 features, not a multiple of 64"):
        build_pipeline(spec)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 row", "185 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)
