"""torch.compile(fullgraph=True) of a graph-replaying module's training call: its forward under
autograd is one custom op (``fusegen::<pipeline>_forward_<digest>``) and its backward another
(``..._backward_<digest>``), joined by torch.library.register_autograd, with the weight-grad GEMMs
in the autograd formula (templates/runtime/compiled_passes.py). On CPU the ops run the reference
math, so the compiled model is eager's bit for bit, and both agree with float64 references; on a
GPU the ops replay CUDA graphs at a few rows (the cuda-marked tests)."""

import re
import sys

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import generated
from references import PIPELINES, as64, assert_close_to_reference, randomize_

# an MLP with a norm (and its no-grad GEMM epilogue), a GLU MLP, Dropout and an extra input, an
# in-place residual (an extra output written back), a chain of elementwise ops with three extra
# inputs, two Residuals, a forward op of one output (Fc2: its backward reads only its arguments),
# a size-generic Reshape whose backward takes the input width (the backward op's SymInt n)
CLASSES = ["Gpt2Mlp", "GluMlp", "GptOssMlp", "DropoutMlp", "ResidualInPlace", "ElementwiseChain", "ResidualBlocks",
           "Fc2", "RowsOf64"]


def _module_of(module):
    return sys.modules[type(module).__module__]


def _inputs(module, gen, rows=(3, 5)):
    n = module.in_features or 128  # a size-generic pipeline: any width (a multiple of 64 for RowsOf64)
    extra = [torch.randn(*rows, e, generator=gen) for e in module.extra_input_features]
    return [torch.randn(*rows, n, generator=gen), *extra]


def _train(module, inputs, steps=1, call=None):
    """Forward + backward of ``call`` (default: ``module``, whose parameters' grads it returns)
    ``steps`` times (grads accumulate in .grad), with signed output grads: the outputs, the
    inputs' grads, the parameters' grads."""
    torch.manual_seed(0)  # Dropout's keys
    leaves = [t.clone().requires_grad_() for t in inputs]
    module.zero_grad(set_to_none=True)
    call = module if call is None else call
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        outputs = call(*leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, [torch.randn(o.shape, generator=gen) for o in outputs])
    return ([o.detach() for o in outputs] + [t.grad for t in leaves]
            + [p.grad for p in module.parameters()])


def _graphs_backend(graphs):
    """AOT autograd with the forward and backward graphs it compiles recorded (run as traced)."""

    def record(kind):
        def compiler(graph_module, example_inputs):
            graphs.append((kind, graph_module))
            return make_boxed_func(graph_module.forward)
        return compiler

    return aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))


def _fusegen_nodes(graph_module):
    return [str(node.target) for node in graph_module.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("fusegen.")]


@pytest.mark.parametrize("name", CLASSES)
def test_training_compiles_to_one_forward_op_and_one_backward_op(name):
    """The forward graph AOT autograd compiles holds exactly the forward op, the backward graph
    exactly the backward op (no per-kernel ops), and the compiled module trains as the module
    does, bit for bit: outputs, grads of x, of every extra input and every parameter."""
    module = getattr(generated, name)()
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, torch.Generator().manual_seed(2))
    want = _train(module, inputs)
    graphs = []
    torch._dynamo.reset()
    got = _train(torch.compile(module, fullgraph=True, backend=_graphs_backend(graphs)), inputs)
    pipeline = type(module).__module__.split(".")[-1]
    nodes = {kind: _fusegen_nodes(g) for kind, g in graphs}
    assert sorted(nodes) == ["backward", "forward"], nodes
    assert len(nodes["forward"]) == 1 and re.fullmatch(rf"fusegen\.{pipeline}_forward_[0-9a-f]{{8}}\.default",
                                                         nodes["forward"][0]), nodes
    assert len(nodes["backward"]) == 1 and re.fullmatch(rf"fusegen\.{pipeline}_backward_[0-9a-f]{{8}}\.default",
                                                          nodes["backward"][0]), nodes
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g is not None and torch.equal(g, w), f"{name}: tensor {i} differs under torch.compile"


@pytest.mark.parametrize("pipeline", ["gpt2_mlp", "gpt_oss_mlp", "glu_mlp", "residual_blocks"])
def test_compiled_training_matches_a_float64_reference(pipeline):
    """Two steps of a compiled model of two layers of one pipeline (the grads accumulate: the
    second step's weight-grad GEMMs meet a .grad already there) against the float64 reference of
    the same two layers: the output, x's grad and every parameter's grad of both layers."""
    class_name, reference, _ = PIPELINES[pipeline]
    layers = [getattr(generated, class_name)() for _ in range(2)]
    for seed, layer in enumerate(layers):
        randomize_(layer, torch.Generator().manual_seed(10 + seed))
    model = torch.nn.Sequential(*layers)
    x = torch.randn(6, layers[0].in_features, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    got = _train(torch.compile(model, fullgraph=True, backend="aot_eager"), [x], steps=2)
    params = [{k: as64(v, "cpu", True) for k, v in layer.state_dict().items()} for layer in layers]
    x64 = as64(x, "cpu", True)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        y = reference(params[1], reference(params[0], x64)[0])[0]
        y.backward(torch.randn(y.shape, generator=gen).to(torch.float64))
    assert_close_to_reference(f"{pipeline} y", got[0], y, torch.float32)
    assert_close_to_reference(f"{pipeline} dx", got[1], x64.grad, torch.float32)
    names = [f"{i}.{k}" for i, p in enumerate(params) for k in p]
    want = [v.grad for p in params for v in p.values()]
    assert len(got[2:]) == len(want)
    for key, g, w in zip(names, got[2:], want):
        assert_close_to_reference(f"{pipeline} d{key}", g, w, torch.float32)


def test_dynamic_shapes_one_graph_for_every_row_count():
    """torch.compile(dynamic=True): the ops' fakes take symbolic row counts, so one compiled graph
    serves 3, 5 and 9 rows, each step eager's bit for bit."""
    module = generated.Gpt2Mlp()
    randomize_(module, torch.Generator().manual_seed(1))
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=_graphs_backend(graphs))
    gen = torch.Generator().manual_seed(2)
    for rows in (3, 5, 9):
        inputs = _inputs(module, gen, rows=(rows,))
        for i, (g, w) in enumerate(zip(_train(compiled, inputs), _train(module, inputs))):
            assert torch.equal(g, w), f"{rows} rows: tensor {i}"
    assert [kind for kind, _ in graphs] == ["forward", "backward"]  # compiled once


def test_a_frozen_parameter_gets_no_grad_and_the_others_theirs():
    """requires_grad=False parameters (a frozen layer): the compiled backward skips their
    weight-grad GEMMs (ctx.needs_input_grad), leaves their .grad None, and the other grads are the
    module's."""
    module = generated.Gpt2Mlp()
    randomize_(module, torch.Generator().manual_seed(1))
    frozen = {"1.weight", "0.bias"}
    for key, parameter in module.named_parameters():
        parameter.requires_grad_(key not in frozen)
    inputs = _inputs(module, torch.Generator().manual_seed(2))
    want = _train(module, inputs)
    graphs = []
    torch._dynamo.reset()
    got = _train(torch.compile(module, fullgraph=True, backend=_graphs_backend(graphs)), inputs)
    keys = [key for key, _ in module.named_parameters()]
    for i, (g, w) in enumerate(zip(got, want)):
        key = keys[i - 2] if i >= 2 else f"tensor {i}"
        if key in frozen:
            assert g is None and w is None, key
        else:
            assert torch.equal(g, w), key
    backward = next(g for kind, g in graphs if kind == "backward")
    gemms = [n for n in backward.graph.nodes if n.op == "call_function" and "mm" in str(n.target)]
    assert len(gemms) == 1, gemms  # the unfrozen weight's grad only (1.weight's is skipped)


def test_a_double_backward_through_the_compiled_module_raises():
    """A second derivative is refused, not wrong: AOT autograd does not differentiate a compiled
    backward."""
    module = generated.Gpt2Mlp()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 1024, requires_grad=True)
    (dx,) = torch.autograd.grad(compiled(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dx.sum().backward()


@pytest.mark.parametrize("name", ["Gpt2Mlp", "DropoutMlp"])
def test_activation_checkpointing_under_compile(name):
    """torch.utils.checkpoint around a generated module inside the compiled function: the
    forward op runs again in the backward, the grads are the uncheckpointed module's. With
    Dropout in training mode too: the forward op is tagged nondeterministic_seeded, so AOT
    autograd runs it again with the random-number generator's state of the first run (the same
    keys, the same masks; untagged, the recompute drew new masks and the grads were wrong)."""
    module = getattr(generated, name)()
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, torch.Generator().manual_seed(2))
    want = _train(module, inputs)

    def checkpointed(*tensors):
        return torch.utils.checkpoint.checkpoint(module, *tensors, use_reentrant=False)

    graphs = []
    torch._dynamo.reset()
    got = _train(module, inputs, call=torch.compile(checkpointed, fullgraph=True, backend=_graphs_backend(graphs)))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"tensor {i}"
    backward = next(g for kind, g in graphs if kind == "backward")
    # recomputed there, not saved (the random one under run_with_rng_state, which names the op)
    pipeline = type(module).__module__.split(".")[-1]
    assert re.search(rf"fusegen\.{pipeline}_forward_[0-9a-f]{{8}}", backward.code), backward.code


def test_autocast_under_compile_trains_in_autocasts_dtype():
    """Under torch.autocast the compiled module computes in autocast's dtype (the module casts
    before the op), as the module does: the same outputs and grads (float32 parameters' grads)."""
    module = generated.Gpt2Mlp()
    randomize_(module, torch.Generator().manual_seed(1))
    inputs = _inputs(module, torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _train(module, inputs)
        torch._dynamo.reset()
        got = _train(torch.compile(module, fullgraph=True, backend="aot_eager"), inputs)
    assert want[0].dtype == torch.bfloat16 and want[2].dtype == torch.float32
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), f"tensor {i}"


def _cuda_pair(gen):
    first, second = (generated.Gpt2Mlp(device="cuda") for _ in range(2))
    for seed, module in enumerate((first, second)):
        randomize_(module, torch.Generator().manual_seed(seed))
    return first, second


def _step(model, x, dy):
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_training_replays_graphs_at_a_few_rows():
    """Under inductor, a model of two Gpt2Mlp layers at 4 rows: from each key's second call the
    forward and backward ops replay graphs (one forward and one backward graph a layer, found by
    its parameters' addresses), each step on new inputs and output grads, with the uncompiled
    model's outputs and grads (fp32 GEMM roundoff: inductor picks its own weight-grad GEMMs); a
    parameter updated in place between steps is seen."""
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Sequential(*_cuda_pair(gen))
    passes = _module_of(model[0]).COMPILED_PASSES
    passes.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for step in range(5):
        if step == 3:
            with torch.no_grad():
                model[0]._modules["1"].weight.mul_(0.5)
        x = torch.randn(4, 1024, generator=gen).to("cuda")
        dy = torch.randn(4, 1024, generator=gen).to("cuda")
        got, want = _step(compiled, x, dy), _step(model, x, dy)
        for i, (g, w) in enumerate(zip(got, want)):
            scale = w.abs().max().item() or 1.0
            assert (g - w).abs().max().item() <= 4 * 2.0**-11 * scale, f"step {step}, tensor {i}"
    assert passes.failed is None
    assert passes.captured == 4  # a forward and a backward graph for each layer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_training_at_many_rows_replays_no_graph():
    """Past max_rows the ops run their stages as they are: nothing captured, the same results."""
    gen = torch.Generator().manual_seed(6)
    model = torch.nn.Sequential(*_cuda_pair(gen))
    passes = _module_of(model[0]).COMPILED_PASSES
    passes.clear()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(3):
        x = torch.randn(passes.max_rows + 1, 1024, generator=gen).to("cuda")
        dy = torch.randn(passes.max_rows + 1, 1024, generator=gen).to("cuda")
        got, want = _step(compiled, x, dy), _step(model, x, dy)
        for i, (g, w) in enumerate(zip(got, want)):
            scale = w.abs().max().item() or 1.0
            assert (g - w).abs().max().item() <= 4 * 2.0**-11 * scale, f"tensor {i}"
    assert passes.captured == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_forward_outputs_are_tensors_of_their_own():
    """The forward op's outputs, replayed, are new tensors each call (not the graph's buffers): two
    forwards kept alive together, then both backwards, give each its own grads."""
    gen = torch.Generator().manual_seed(8)
    module = _cuda_pair(gen)[0]
    passes = _module_of(module).COMPILED_PASSES
    passes.clear()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    xs = [torch.randn(4, 1024, generator=gen).to("cuda").requires_grad_() for _ in range(4)]
    for x in xs[:2]:  # the key's first call and its capture
        compiled(x).sum().backward()
    assert passes.captured == 2
    ys = [compiled(x) for x in xs[2:]]  # both replayed; the first's tensors must survive the second
    for x, y in zip(xs[2:], ys):
        x.grad = None
        y.backward(torch.ones_like(y))
        x_eager = x.detach().clone().requires_grad_()
        want = module(x_eager)
        want.backward(torch.ones_like(want))
        assert (y.detach() - want.detach()).abs().max().item() <= 4 * 2.0**-11 * want.abs().max().item()
        assert (x.grad - x_eager.grad).abs().max().item() <= 4 * 2.0**-11 * x_eager.grad.abs().max().item()


class _RecomputingGraph:
    """A stand-in for a captured CUDA graph on CPU: its replay runs the captured pass again on the
    graph's input buffers and writes the results into the captured outputs' memory, as a graph's
    kernels write into its fixed buffers."""

    def __init__(self, run, outputs):
        self.run, self.replays = run, 0
        self.outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)

    def replay(self):
        self.replays += 1
        new = self.run()
        for buffer, value in zip(self.outputs, [new] if isinstance(new, torch.Tensor) else new):
            if buffer is not None:
                buffer.copy_(value)


@pytest.mark.parametrize("name, training", [("Gpt2Mlp", True), ("DropoutMlp", False), ("Fc2", True),
                                            ("ResidualInPlace", True)])
def test_the_ops_replay_logic_on_cpu(monkeypatch, name, training):
    """PassGraphs' replay path on CPU, with graphs stood in for by recomputing ones: from each
    key's second call the forward and backward ops copy the call's tensors into the graph's
    buffers, replay, and hand out new tensors (a Dropout's None keys in eval mode, a single
    output as a tensor); four steps on new inputs give the uncompiled module's results bit for
    bit, and a parameter updated in place is seen. (Dropout in training mode is left out: a capture
    draws keys of its own, so the masks are not eager's sequence, as with the module's graphs.)"""
    from generated._runtime import compiled_passes

    captured = []

    def capture(run):
        outputs = run()
        captured.append(_RecomputingGraph(run, outputs))
        return captured[-1], outputs

    module = getattr(generated, name)().train(training)
    randomize_(module, torch.Generator().manual_seed(1))
    passes = _module_of(module).COMPILED_PASSES
    passes.clear()
    monkeypatch.setattr(compiled_passes, "_capture", capture)
    monkeypatch.setattr(passes, "_where", lambda x: ("cpu stream", -1))
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(2)
    for step in range(4):
        if step == 3:
            with torch.no_grad():
                next(module.parameters()).mul_(0.5)
        inputs = _inputs(module, gen, rows=(4,))
        want = _train(module, inputs)
        got = _train(compiled, inputs)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"{name}: step {step}, tensor {i}"
    assert passes.captured == 2 and len(captured) == 2  # the forward's graph and the backward's
    assert [graph.replays for graph in captured] == [3, 3]  # from each key's second call on
    passes.clear()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replayed_forward_draws_new_dropout_masks_each_call():
    """DropoutMlp in training mode under inductor at 4 rows: the forward op draws its keys inside
    the replayed graph, so two replayed calls on the same input give different outputs (fresh
    masks), and each backward uses its own forward's masks: the last Dropout (p = 0.1) zeroes
    y - extra exactly where it drops, so the grad of the Bias before it is the output grad summed
    over the rows it kept, scaled by 1 / 0.9 (and the extra input's grad is the output grad)."""
    module = generated.DropoutMlp(device="cuda")
    randomize_(module, torch.Generator().manual_seed(1))
    passes = _module_of(module).COMPILED_PASSES
    passes.clear()
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    x, extra = (torch.randn(4, n, generator=gen).to("cuda") for n in (module.in_features, 256))
    outputs = []
    for _ in range(4):
        module.zero_grad(set_to_none=True)
        xi, ei = x.clone().requires_grad_(), extra.clone().requires_grad_()
        y = compiled(xi, ei)
        dy = torch.randn(y.shape, generator=gen).to("cuda")
        y.backward(dy)
        assert torch.equal(ei.grad, dy)
        kept = (y.detach() - extra) != 0
        want = (dy * kept).sum(0) / 0.9
        got = module._modules["3"].bias.grad
        assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
        outputs.append(y.detach())
    assert passes.captured == 2
    assert not torch.equal(outputs[2], outputs[3])  # both replayed, each with keys of its own


def test_a_replay_copies_in_and_out_one_launch_a_dtype(monkeypatch):
    """A pass's tensors of several dtypes (activations, fp32 statistics) are copied one
    _foreach_copy_ a dtype: a mixed list would fall back to a launch a tensor."""
    from generated._runtime import compiled_passes

    calls = []
    real = torch._foreach_copy_

    def counting(targets, sources):
        calls.append({t.dtype for t in targets})
        return real(targets, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    sources = [torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(3), torch.randn(2, 2, dtype=torch.bfloat16),
               torch.randn(5)]
    targets = [torch.empty_like(s) for s in sources]
    compiled_passes._copy_each(targets, sources)
    assert calls == [{torch.bfloat16}, {torch.float32}]
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
