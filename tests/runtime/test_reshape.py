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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 row", "185 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)
