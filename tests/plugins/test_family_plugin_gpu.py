"""The kernel-family fixture's checked-in package on the GPU (tests/fixtures/family_project): the
plugin's row softmax kernels, forward and backward, against float64 in every dtype at TE's
tolerances, at a width a block's threads divide and one they do not, with large inputs (the max
must come off before exp); and its pipelines, with autograd, against float64 references."""

import pytest
import torch

import references as R
from family_references import PIPELINES, PROJECT, softmax64
from plugin_references import import_package

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# TE's single-op tolerances (rtol, atol), as tests/runtime/test_gpu.py's
TOLS = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


@pytest.fixture(scope="module")
def pkg():
    return import_package(PROJECT, "generated_softmax")


def assert_close(name, got, ref, dtype):
    rtol, atol = TOLS[dtype]
    assert got.dtype == dtype and torch.isfinite(got.float()).all(), f"{name}: non-finite values (unwritten output?)"
    torch.testing.assert_close(got.double(), ref.to(got.device, torch.float64), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("width", [256, 1000])
@pytest.mark.parametrize("rows, offset", [(1031, 0.0), (3, 0.0), (64, 1000.0)], ids=["odd_rows", "few_rows", "large"])
def test_row_softmax_kernels(pkg, dtype, width, rows, offset):
    kernels = pkg._kernels
    forward, backward = getattr(kernels, f"row_softmax_fwd_h{width}"), getattr(kernels, f"row_softmax_bwd_h{width}")
    gen = torch.Generator().manual_seed(width + rows)
    x = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * 3 + offset).to("cuda", dtype)
    dy = torch.randn(rows, width, generator=gen, dtype=torch.float64).to("cuda", dtype)
    y = forward(x)
    assert_close(f"y ({rows}x{width})", y, softmax64(x.double()), dtype)
    # the backward from the y it is given (the forward's, in the dtype): dx = J^T dy of softmax at
    # that y, y * (dy - <dy, y>), in float64
    y64, dy64 = y.double(), dy.double()
    assert_close(f"dx ({rows}x{width})", backward(dy, y), y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True)), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("shape", [(1031,), (3, 7)], ids=["odd_rows", "3d"])
def test_family_pipelines_on_gpu(pkg, name, dtype, shape):
    cls_name, reference, features, gemm = PIPELINES[name]
    module = getattr(pkg, cls_name)(device="cuda", dtype=dtype)
    R.randomize_(module, torch.Generator().manual_seed(3))
    R.run_and_compare(module, name, (*shape, features), dtype, "cuda", reference=reference, gemm=gemm)
