"""The no-grad forward (plan.inference): with autograd off (torch.no_grad, torch.inference_mode)
every shipped module runs its ``no_grad_forward``, never its autograd.Function, and gives what the
autograd forward gives: bit for bit where the stages are the same (the same kernels run), and on
the GPU within a few units of roundoff where the no-grad plan fuses more (a GELU in cuBLASLt's
epilogue rounds the pre-activation once less). Against float64 references: test_pipelines_cpu.py
and, on a GPU, test_gpu.py."""

import pytest
import torch

import generated
from references import INPUT_SHAPES, module_inputs, module_names, randomize_

CLASSES = module_names(generated)


def _inputs(module, device, dtype, gen):
    if type(module).__name__ in INPUT_SHAPES:  # inputs not [..., in_features]
        return module_inputs(module, 15, gen, device, dtype)
    width = module.in_features or (16 if module.extra_input_features != () else 64) * 4
    lead = (3, 5)
    x = torch.randn(*lead, width, generator=gen)
    extra = []
    for n in module.extra_input_features:
        if n == "rows":  # one value per row (a row-scaled activation's scales)
            extra.append(torch.rand(*lead, generator=gen) + 0.5)
        else:
            extra.append(torch.randn(*lead, eval(n, {"n": width}) if isinstance(n, str) else n, generator=gen))
    return [t.to(device=device, dtype=dtype) for t in (x, *extra)]


def _run(module, inputs, mode):
    torch.manual_seed(11)  # Dropout's keys: the same draws in both runs
    with mode():
        outputs = module(*[t.clone() for t in inputs])  # in-place ops write into their extra input
    return [o.detach() for o in (outputs if isinstance(outputs, tuple) else (outputs,))]


def check(name, device, dtype, modes, monkeypatch):
    """The module's forward with autograd on, then under each of ``modes`` (one module for all)."""
    module = torch.nn.utils.skip_init(getattr(generated, name), device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, device, dtype, torch.Generator().manual_seed(2))
    with_grad = _run(module, inputs, torch.enable_grad)
    pipeline = __import__(f"generated.{module.__module__.rsplit('.', 1)[1]}", fromlist=["x"])
    monkeypatch.setattr(pipeline.__dict__[f"{name}Function"], "apply",
                        lambda *args: pytest.fail("the autograd.Function ran with autograd off"))
    same_stages = "the same stages" in pipeline.no_grad_forward.__doc__
    for mode in modes:
        without = _run(module, inputs, mode)
        assert len(without) == len(with_grad)
        for got, want in zip(without, with_grad):
            assert got.shape == want.shape and got.dtype == want.dtype, mode.__name__
            if same_stages:
                assert torch.equal(got, want), mode.__name__
            else:  # the plans differ at a GEMM (its epilogue): fp32 with a GEMM is held to fp16's roundoff
                eps = torch.finfo(torch.float16 if dtype == torch.float32 else dtype).eps
                assert (got.float() - want.float()).abs().max() <= 4 * eps * want.float().abs().max(), mode.__name__


@pytest.mark.parametrize("name", CLASSES)
def test_cpu(name, monkeypatch):
    check(name, "cpu", torch.float32, (torch.no_grad, torch.inference_mode), monkeypatch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CLASSES)
def test_gpu(name, dtype, monkeypatch):
    check(name, "cuda", dtype, (torch.no_grad,), monkeypatch)
