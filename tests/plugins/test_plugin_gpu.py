"""The plugin project's checked-in package on the GPU: LearnableScale's kernels, alone, in
elementwise runs and fused into an RMSNorm by the plugin's rule, against float64 references in
every dtype, and the scalar grad reduced deterministically."""

import pytest
import torch

import references as R
from plugin_references import PIPELINES, PROJECT, import_package

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def pkg():
    return import_package(PROJECT, "generated_ext")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("shape", [(1031, 64), (3, 7, 64)], ids=["odd_rows", "3d"])
def test_plugin_pipelines_on_gpu(pkg, name, dtype, shape):
    cls_name, reference, features = PIPELINES[name]
    module = getattr(pkg, cls_name)(device="cuda", dtype=dtype)
    R.randomize_(module, torch.Generator().manual_seed(3))
    R.run_and_compare(module, name, (*shape[:-1], features), dtype, "cuda", reference=reference)


def test_learnable_scale_grad_is_deterministic(pkg):
    module = pkg.NormScale(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4099, 64, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    grads = []
    for _ in range(3):
        module.zero_grad(set_to_none=True)
        module(x).backward(dy)
        grads.append(module._modules["1"].scale.grad.clone())
    assert grads[0].shape == () and all(torch.equal(grads[0], g) for g in grads[1:])
