"""torch.compile(fullgraph=True) of generated modules: every launcher is a torch.library custom op
under compile (its fake: the launcher's reference path on meta tensors), so a module, and a model
of several, compiles without a graph break (fullgraph raises on one) and gives the eager results:
outputs, input grads and parameter grads. On CPU with the aot_eager backend (dynamo and AOT
autograd, the same kernels at run time: bit for bit), on a GPU with inductor."""

import re
import sys

import pytest
import torch

import generated
from generated._runtime import custom_ops
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


def _fusegen_nodes(graph_module):
    return [str(node.target) for node in graph_module.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("fusegen.")]


@pytest.mark.parametrize("name", ["Gpt2Mlp", "DropoutMlp", "ResidualInPlace", "ElementwiseChain"])
def test_a_graphed_modules_no_grad_forward_compiles_to_one_custom_op(name):
    """Under torch.compile a module that replays CUDA graphs runs its no-grad forward as one
    custom op (which replays a graph at run time), not one op per kernel: the graph dynamo hands
    its backend holds exactly that op, and the results are eager's bit for bit (the op runs the
    same stages; on CPU their reference math)."""
    module = getattr(generated, name)()
    assert hasattr(module, "cuda_graphs")
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, "cpu", torch.Generator().manual_seed(2))
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.manual_seed(0)
        want = module(*[t.clone() for t in inputs])
        torch.manual_seed(0)
        got = torch.compile(module, fullgraph=True, backend=backend)(*[t.clone() for t in inputs])
    nodes = [_fusegen_nodes(g) for g in graphs]
    pipeline = type(module).__module__.split(".")[-1]
    assert len(nodes) == 1 and len(nodes[0]) == 1, nodes
    assert re.fullmatch(rf"fusegen\.{pipeline}_no_grad_[0-9a-f]{{8}}", nodes[0][0]), nodes
    got, want = (o if isinstance(o, tuple) else (o,) for o in (got, want))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_no_grad_op_hands_out_tensors_of_its_own():
    """A custom op's outputs may not be its inputs, views, or each other (its schema says they are
    new): a pass that hands an input out, or the same tensor twice, gets copies."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    view = y[:, :4]
    out = custom_ops._new_tensors((x, y, view, y), (x,))
    assert all(torch.equal(o, w) for o, w in zip(out, (x, y, view, y)))
    assert out[0] is not x and out[1] is y and out[2]._base is None and out[3] is not y
    assert custom_ops._new_tensors(y, (x,)) is y


def test_an_op_output_with_gaps_is_handed_out_dense_as_its_fake_makes_it():
    """An output that is a view of part of a buffer (an attention's q of the prep kernel's
    [rows, heads + 2 kv_heads, d]) leaves the op as a dense copy: the op's fake (empty_like on
    meta) gives it dense strides, which a compiled graph checks against the real output's. Dense
    outputs in any order of dims (a transpose) are handed out as they are."""
    buffer = torch.randn(5, 6, 4)
    q, k, v = buffer.split([4, 1, 1], dim=1)
    out = custom_ops._new_tensors((q,), ())
    assert torch.equal(out[0], q) and out[0].is_contiguous() and out[0].untyped_storage().data_ptr() != \
        buffer.untyped_storage().data_ptr()
    assert out[0].stride() == torch.empty_like(q, device="meta").stride()
    dense = torch.randn(6, 5).t()
    assert custom_ops._new_tensors((dense,), ())[0] is dense
    assert custom_ops._dense(torch.randn(3, 1, 4)[:, :, :]) and not custom_ops._dense(buffer[:, :, :2])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_no_grad_calls_replay_graphs_found_by_parameters():
    """Under inductor the no-grad op of two modules of one pipeline replays a graph for each (by
    their parameters' addresses) on new inputs, with the results of each module's own forward bit
    for bit; a parameter updated in place is seen."""
    first, second = (generated.Gpt2Mlp(device="cuda") for _ in range(2))
    for seed, module in enumerate((first, second)):
        randomize_(module, torch.Generator().manual_seed(seed))
    graphs = sys.modules[type(first).__module__].COMPILED_GRAPHS
    graphs.clear()
    compiled = {m: torch.compile(m, fullgraph=True) for m in (first, second)}
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for step in range(4):
            if step == 3:
                first._modules["0"].weight.mul_(0.5)
            for module in (first, second):
                x = torch.randn(4, 1024, generator=gen).to("cuda")
                assert torch.equal(compiled[module](x), module(x)), f"step {step}"
    assert graphs.captured == 2, graphs.failed
    # with room for one graph, the newest key's graph replaces the oldest one's
    graphs.max_graphs = 1
    graphs.clear()
    try:
        with torch.no_grad():
            for module in (first, first, second, second, second):
                x = torch.randn(4, 1024, generator=gen).to("cuda")
                assert torch.equal(compiled[module](x), module(x))
        assert graphs.captured == 1
        assert next(iter(graphs._graphs))[-1] == second._modules["3"].bias.data_ptr()
    finally:
        graphs.max_graphs = 8
        graphs.clear()
