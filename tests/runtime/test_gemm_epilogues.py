"""GEMM epilogues (specs/te_gemm_epilogues.py: fusion_rules/linear_epilogue.py): a residual as
beta = 1, a ConstantScale as alpha forward and backward, a bias with a scale, a bias with a ReLU
(its backward from the GEMM's output); outputs, every grad
and the in-place residual against float64 references, on CPU and, marked cuda, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import generated
from references import assert_close_to_reference, randomize_, run_and_compare


def scaled_residual(p, x, r):
    return (F.linear(x, p["0.weight"]) * 0.5 + r,)


def scaled_linear(p, x):
    return (F.gelu(F.linear(x, p["0.weight"], p["0.bias"]) * 2.0, approximate="tanh"),)


def scaled_projection(p, x):
    return (F.linear(x, p["0.weight"]) * 0.25,)


def relu_mlp(p, x):
    return (F.linear(F.relu(F.linear(x, p["0.weight"], p["0.bias"])), p["2.weight"], p["2.bias"]),)


CASES = {"ScaledResidual": scaled_residual, "ScaledLinear": scaled_linear, "ScaledProjection": scaled_projection,
         "ReluMlp": relu_mlp}


def check(cls, dtype, device, lead):
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    run_and_compare(module, cls, (*lead, 256), dtype, device, seed=2, ref_device=device, reference=CASES[cls])


def check_linear_residual(dtype, device):
    """BasicLinear + AddExtraInput(in_place=True): the GEMM accumulates into the residual, which
    the caller then holds as the sum."""
    module = generated.LinearResidual(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(4)
    x, r, gy = (torch.randn(6, 256, generator=gen).to(device, dtype) for _ in range(3))
    w = module.get_submodule("0").weight.detach().double()
    want = x.double() @ w.t() + r.double()
    x.requires_grad_()
    y = module(x, r)
    y.backward(gy)
    assert_close_to_reference("LinearResidual output", y, want, dtype)
    assert_close_to_reference("LinearResidual residual after the call", r, want, dtype)  # now the sum
    assert_close_to_reference("LinearResidual input grad", x.grad, gy.double() @ w, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype):
    check(cls, dtype, "cpu", (2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_linear_into_the_residual(dtype):
    check_linear_residual(dtype, "cpu")


def test_cpu_relu_epilogue_serving_a_glu_after_it(tmp_path):
    """Linear, ReLU, QGEGLU: the backward run (bias, ReLU, QGEGLU) starts from the GEMM's ReLU output,
    which stands for the ReLU's input and is the QGEGLU's."""
    import importlib
    import sys

    from fusegen import build, output

    (tmp_path / "relu_glu_spec.py").write_text(
        "import transformer_engine.pytorch as te\n"
        "relu_glu = te.ops.Sequential(te.ops.Linear(64, 32), te.ops.ReLU(), te.ops.QGEGLU(), te.ops.Linear(16, 8))\n")
    config = build.Config((tmp_path / "relu_glu_spec.py",), tmp_path / "relu_glu_pkg", archs=(), dtypes=("float32",),
                          root=tmp_path)
    output.write_package(build.build_package(config), config.out)
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("relu_glu_pkg")
    finally:
        sys.path.remove(str(tmp_path))

    def reference(p, x):
        a, b = F.relu(F.linear(x, p["0.weight"], p["0.bias"])).chunk(2, dim=-1)
        return (F.linear(a * torch.sigmoid(1.702 * a) * b, p["3.weight"], p["3.bias"]),)

    module = pkg.ReluGlu(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(1))
    run_and_compare(module, "relu_glu", (3, 5, 64), torch.float32, "cpu", seed=4, reference=reference)


def on_gpu(test):
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@on_gpu
@pytest.mark.parametrize("lead", [(1,), (5, 37)], ids=["1 row", "185 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)


@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_linear_into_the_residual(dtype):
    check_linear_residual(dtype, "cuda")
