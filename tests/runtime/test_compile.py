"""torch.compile(fullgraph=True) of generated modules: every launcher is a torch.library custom op
under compile (its fake: the launcher's reference path on meta tensors), so a module, and a model
of several, compiles without a graph break (fullgraph raises on one) and gives the eager results:
outputs, input grads and parameter grads. On CPU with the aot_eager backend (dynamo and AOT
autograd, the same kernels at run time: bit for bit), on a GPU with inductor."""

import pytest
import torch

import generated
from references import randomize_

# one of each stage and calling convention: norm, GEMM (and the no-grad GELU epilogue),
# elementwise, dropout in a norm kernel, extra inputs and outputs, Reshape, an in-place residual
# (one tensor as two Function outputs), per-row scales at any width, L2Normalization
CLASSES = ["Gpt2Mlp", "PostAttention", "HeadNorm", "LinearResidual", "MoeSwiglu", "L2normBlock", "DropoutMlp",
           "ElementwiseChain"]


def _inputs(module, device, gen):
    n = module.in_features or 64
    extra = [torch.rand(3, 5, generator=gen) + 0.5 if e == "rows" else
             torch.randn(3, 5, e if isinstance(e, int) else eval(e, {"n": n}), generator=gen)
             for e in module.extra_input_features]
    return [t.to(device) for t in (torch.randn(3, 5, n, generator=gen), *extra)]


def _run(module, inputs):
    torch.manual_seed(0)  # Dropout's keys
    inputs = [t.clone().requires_grad_() for t in inputs]
    module.zero_grad(set_to_none=True)
    outputs = module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    grads = [p.grad for p in module.parameters()]
    with torch.no_grad():
        no_grad = module(*[t.detach() for t in inputs])
    return [o.detach() for o in outputs] + [t.grad for t in inputs] + grads + list(
        no_grad if isinstance(no_grad, tuple) else (no_grad,))


@pytest.mark.parametrize("name", CLASSES)
def test_fullgraph_on_cpu_matches_eager(name):
    module = getattr(generated, name)()
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, "cpu", torch.Generator().manual_seed(2))
    want = _run(module, inputs)
    torch._dynamo.reset()
    got = _run(torch.compile(module, fullgraph=True, backend="aot_eager"), inputs)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{name}: tensor {i} differs under torch.compile"


def test_a_model_of_several_generated_modules_compiles_as_one_graph():
    model = torch.nn.Sequential(generated.Gpt2Mlp(), torch.nn.GELU(), generated.Gpt2Mlp())
    for m in model:
        randomize_(m, torch.Generator().manual_seed(3))
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(4))
    want = model(x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(model, fullgraph=True, backend="aot_eager")(x), want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["Gpt2Mlp", "PostAttention", "TeMlp"])
def test_fullgraph_with_inductor_on_a_gpu(name):
    """Inductor compiles the torch ops around the custom ops (its own GEMM choices among them):
    the results agree with eager to fp32 GEMM roundoff. In eval mode: inductor draws Dropout's
    keys from its own random-number generator, as it does for every random op, so training-mode
    masks differ from eager's (reproducible under torch.manual_seed all the same)."""
    module = getattr(generated, name)(device="cuda").eval()
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, "cuda", torch.Generator().manual_seed(2))
    want = _run(module, inputs)
    torch._dynamo.reset()
    got = _run(torch.compile(module, fullgraph=True), inputs)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = w.abs().max().item() or 1.0
        assert (g - w).abs().max().item() <= 4 * 2.0**-11 * scale, f"{name}: tensor {i}"
