"""A module's forward and backward under autograd, replayed from CUDA graphs at a few rows
(templates/runtime/: graphs.py CudaGraphs.training, training_graphs.py replay_forward,
replay_backward, backward_done).

On a GPU: every module that replays graphs gives the grads of its plain path on new inputs and
output grads; its outputs and grads are its own (a parameter's ``.grad`` is never a graph buffer,
so accumulation over micro-batches adds up); a second forward before the first's backward runs
plain; a forward whose autograd graph is dropped frees the graph; ``retain_graph`` works, and a
second backward after a later forward reused the buffers raises; Dropout's masks are new each
replay and its backward uses the forward's; threads each get their own grads. On CPU: the
generated code of a module with graphs (its stages as functions, weight-grad GEMMs after them).
"""

import gc
import inspect
import threading

import pytest
import torch
import torch.utils.checkpoint

import generated
import references as R
from generated import _runtime

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# the modules that replay graphs in float32, as these tests run them (instances on the meta device:
# no parameter memory, no initialisation work); an attention pipeline replays them in bf16/fp16
# only (FlashAttention-2): test_attention_graphs.py
GRAPHED = sorted(name for name in R.module_names(generated) if R.replays_graphs_in(getattr(generated, name), torch.float32))


def _module(name, dtype=torch.float32):
    module = getattr(generated, name)(device="cuda", dtype=dtype)
    R.randomize_(module, torch.Generator().manual_seed(7))
    return module


def _inputs(module, rows, gen, dtype=torch.float32):
    """The module's inputs and, after one plain call for the shapes, its output grads."""
    inputs = R.module_inputs(module, rows, gen, dtype=dtype)
    rows, module.cuda_graphs.max_rows = module.cuda_graphs.max_rows, 0  # (no no-grad graph)
    with torch.no_grad():
        out = module(*[t.clone() for t in inputs])
    module.cuda_graphs.max_rows = rows
    outs = out if isinstance(out, tuple) else (out,)
    grads = [torch.randn(o.shape, generator=gen).to(device="cuda", dtype=dtype) for o in outs]
    return inputs, grads


def _step(module, inputs, grads):
    """One forward + backward: the outputs, then the grads of every input and parameter (from
    torch.autograd.grad: nothing is accumulated)."""
    xs = [t.clone().requires_grad_() for t in inputs]
    out = module(*xs)
    outs = list(out) if isinstance(out, tuple) else [out]
    got = torch.autograd.grad(outs, xs + list(module.parameters()), grads, allow_unused=True)
    return [o.detach() for o in outs] + [g for g in got if g is not None]


def _plain(module, inputs, grads):
    rows = module.cuda_graphs.max_rows
    module.cuda_graphs.max_rows = 0
    try:
        return _step(module, inputs, grads)
    finally:
        module.cuda_graphs.max_rows = rows


def _training_graph(module):
    (graph,) = [g for key, g in module.cuda_graphs._graphs.items() if key[0] == "training" and g is not None]
    return graph


def _assert_same(name, got, want, dtype=torch.float32):
    assert len(got) == len(want), name
    for k, (a, b) in enumerate(zip(got, want)):
        R.assert_close_to_reference(f"{name} tensor {k}", a, b.double(), dtype)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("name", GRAPHED)
def test_replayed_steps_give_the_plain_grads_on_new_inputs(name):
    """Steps 1 (plain), 2 (captures the forward, then the backward) and 3-4 (replay both) on new
    inputs and output grads each: outputs and every grad as the plain path's (fp32: cuBLAS under
    capture may pick another GEMM algorithm, so within the GEMM row), and each step's tensors are
    its own (a later step leaves them as they were)."""
    module = _module(name).eval()
    gen = torch.Generator().manual_seed(5)
    calls = [_inputs(module, 24, gen) for _ in range(4)]
    got = [_step(module, *call) for call in calls]
    assert module.cuda_graphs.captured == 1, module.cuda_graphs.failed
    graph = _training_graph(module)
    assert graph.replays == 3 and graph.backward is not None and graph.lease is None
    kept = [[t.clone() for t in tensors] for tensors in got]
    for i, (call, tensors) in enumerate(zip(calls, got)):
        _assert_same(f"{name} step {i}", tensors, _plain(module, *call))
        for k, (t, was) in enumerate(zip(tensors, kept[i])):
            assert torch.equal(t, was), f"{name}: step {i}'s tensor {k} changed after later steps"


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replayed_steps_in_half_precision_match_the_plain_path(dtype):
    module = _module("TeMlp", dtype=dtype)
    gen = torch.Generator().manual_seed(6)
    for step in range(4):
        call = _inputs(module, 16, gen, dtype=dtype)
        _assert_same(f"TeMlp step {step}", _step(module, *call), _plain(module, *call), dtype)
    assert _training_graph(module).replays == 3  # step 1 runs plain, step 2 captures and replays


@pytest.mark.cuda
@needs_gpu
def test_parameter_grads_accumulate_over_micro_batches_and_are_never_graph_buffers():
    """loss.backward() over three micro-batches adds up as the plain path's grads do; a grad
    kept from one step is not changed by the next step's replays."""
    module = _module("TeMlp", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    batches = [_inputs(module, 8, gen, dtype=torch.bfloat16) for _ in range(3)]
    for _ in range(2):  # the first step runs plain, the second captures
        _step(module, *batches[0])

    def accumulate():
        module.zero_grad(set_to_none=True)
        for inputs, grads in batches:
            module(*inputs).backward(grads[0])
        return [p.grad for p in module.parameters()]

    replayed = accumulate()
    kept = [g.clone() for g in replayed]
    assert _training_graph(module).replays == 4
    rows = module.cuda_graphs.max_rows
    module.cuda_graphs.max_rows = 0
    plain = accumulate()
    module.cuda_graphs.max_rows = rows
    for k, (a, b) in enumerate(zip(kept, plain)):
        R.assert_close_to_reference(f"accumulated grad {k}", a, b.double(), torch.bfloat16)
    accumulate()  # three more replays
    for k, (a, b) in enumerate(zip(replayed, kept)):
        assert torch.equal(a, b), f"parameter grad {k} of an earlier step changed"


@pytest.mark.cuda
@needs_gpu
def test_a_second_forward_before_the_first_backward_runs_plain():
    module = _module("PrenormBlock")
    gen = torch.Generator().manual_seed(9)
    calls = [_inputs(module, 8, gen) for _ in range(3)]
    for _ in range(2):
        _step(module, *calls[0])
    graph = _training_graph(module)
    replays = graph.replays
    xs = [[t.clone().requires_grad_() for t in inputs] for inputs, _ in calls]
    first = module(*xs[0])
    assert graph.replays == replays + 1 and graph.leased()
    second = module(*xs[1])  # the buffers hold the first forward's tensors: plain
    assert graph.replays == replays + 1
    for out, (_, grads) in ((second, calls[1]), (first, calls[0])):  # the later one first
        outs = list(out) if isinstance(out, tuple) else [out]
        torch.autograd.backward(outs, grads)
    assert graph.lease is None
    for k in range(2):
        got = [x.grad for x in xs[k]]
        want = _plain(module, *calls[k])
        outs = want[:len(calls[k][1])]
        _assert_same(f"forward {k}", got, want[len(outs):len(outs) + len(got)])
    module(*calls[2][0])  # free again: replays
    assert graph.replays == replays + 2


@pytest.mark.cuda
@needs_gpu
def test_a_forward_whose_graph_is_dropped_frees_the_buffers():
    """A forward under autograd whose outputs are dropped without a backward (evaluation with
    grad on) lets the next forward replay."""
    module = _module("TeMlp", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(10)
    inputs, grads = _inputs(module, 4, gen, dtype=torch.bfloat16)
    for _ in range(2):
        _step(module, inputs, grads)
    graph = _training_graph(module)
    out = module(inputs[0])
    assert graph.leased()
    del out
    gc.collect()
    assert not graph.leased()
    _assert_same("after a dropped forward", _step(module, inputs, grads), _plain(module, inputs, grads), torch.bfloat16)
    assert graph.replays == 3


@pytest.mark.cuda
@needs_gpu
def test_retain_graph_backwards_twice_and_raises_once_the_buffers_were_reused():
    module = _module("TeMlp")
    gen = torch.Generator().manual_seed(11)
    inputs, grads = _inputs(module, 4, gen)
    for _ in range(2):
        _step(module, inputs, grads)
    x = inputs[0].clone().requires_grad_()
    out = module(x)
    out.backward(grads[0], retain_graph=True)
    once = x.grad.clone()
    out.backward(grads[0], retain_graph=True)  # nothing replayed since: the buffers still hold its tensors
    torch.testing.assert_close(x.grad, 2 * once, rtol=0, atol=0)
    module(inputs[0].clone().requires_grad_())  # a later forward replays into the same buffers
    with pytest.raises(RuntimeError, match="TeMlp: a second backward .*max_rows = 0"):
        out.backward(grads[0])


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("name", ["NormDropout", "PostAttention"])
def test_dropout_draws_new_masks_each_replay_and_its_backward_uses_the_forwards(name, monkeypatch):
    """Training mode: each replayed step's Dropout key is new; the step's outputs and grads are
    the plain path's with that key (the forward's saved key, fed to the plain path)."""
    module = _module(name).train()
    gen = torch.Generator().manual_seed(12)
    calls = [_inputs(module, 32, gen) for _ in range(4)]
    keys, steps = [], []
    for inputs, grads in calls:
        xs = [t.clone().requires_grad_() for t in inputs]
        out = module(*xs)
        outs = list(out) if isinstance(out, tuple) else [out]
        saved = _runtime.saved_tensors(outs[0].grad_fn)  # (the grad_fn is the Function's ctx)
        (key,) = [t.clone() for t in saved if t is not None and t.dtype == torch.int64]
        got = torch.autograd.grad(outs, xs + list(module.parameters()), grads)
        keys.append(key)
        steps.append([o.detach() for o in outs] + list(got))
    assert _training_graph(module).replays == 3
    assert len({k.item() for k in keys}) == 4
    for i, (call, key) in enumerate(zip(calls, keys)):
        monkeypatch.setattr(generated._reference, "new_seed", lambda like, key=key: key.clone())
        _assert_same(f"{name} step {i}", steps[i], _plain(module, *call))


@pytest.mark.cuda
@needs_gpu
def test_a_backward_inside_a_callers_capture_runs_its_stages_there():
    """A caller capturing the backward of a replayed forward in its own graph gets the stages'
    launches in it (no graph is captured or replayed inside another); replaying the caller's
    graph gives the plain path's grads."""
    module = _module("TeMlp")
    gen = torch.Generator().manual_seed(18)
    inputs, grads = _inputs(module, 8, gen)
    want = _plain(module, inputs, grads)
    side = torch.cuda.Stream()  # the caller's stream: the forward's, so also the backward's
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(module, inputs, grads)  # the forward and backward graphs are captured
        x = inputs[0].clone().requires_grad_()
        out = module(x)  # replayed
        assert _training_graph(module).replays == 2
    module.zero_grad(set_to_none=True)
    caller = torch.cuda.CUDAGraph()
    with torch.cuda.graph(caller, stream=side):
        out.backward(grads[0])
    caller.replay()
    torch.cuda.synchronize()
    _assert_same("caller's graph of the backward", [x.grad, *(p.grad for p in module.parameters())], want[1:])


@pytest.mark.cuda
@needs_gpu
def test_a_second_derivative_through_a_replayed_step_raises():
    """The first-order guard holds on replayed steps too: a first derivative with create_graph
    equals the plain one, and differentiating it again (with respect to the input, or to a weight
    whose only path is through what the forward kept) raises."""
    module = _module("TeMlp")
    gen = torch.Generator().manual_seed(19)
    inputs, grads = _inputs(module, 8, gen)
    for _ in range(2):
        _step(module, inputs, grads)
    weight = module._modules["3"].weight
    want = _plain(module, inputs, grads)
    x = inputs[0].clone().requires_grad_()
    out = module(x)
    assert _training_graph(module).replays == 2
    (grad,) = torch.autograd.grad(out, x, grads[0], create_graph=True)
    R.assert_close_to_reference("create_graph grad", grad, want[1].double(), torch.float32)
    with pytest.raises(RuntimeError, match="TeMlp: second derivatives .* are not supported"):
        torch.autograd.grad(grad.sum(), weight)


@pytest.mark.cuda
@needs_gpu
def test_threads_training_one_module_each_get_their_own_grads():
    module = _module("TeMlp", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(13)
    calls = [_inputs(module, 4, gen, dtype=torch.bfloat16) for _ in range(6)]
    want = [_plain(module, *call) for call in calls]
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(15):
                results[k] = _step(module, *calls[k])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for k in range(6):
        _assert_same(f"thread {k}", results[k], want[k], torch.bfloat16)
    assert _training_graph(module).replays > 0


@pytest.mark.cuda
@needs_gpu
def test_a_parameter_moved_between_forward_and_backward_is_read_where_it_is_now():
    """As a wrapper that frees parameters after the forward and gathers them again for the
    backward does (FSDP): the backward finds the weight elsewhere and runs its stages as usual on
    the forward's tensors, giving the plain path's grads (the old memory is overwritten first)."""
    module = _module("TeMlp")
    gen = torch.Generator().manual_seed(16)
    inputs, grads = _inputs(module, 8, gen)
    for _ in range(2):
        _step(module, inputs, grads)
    want = _plain(module, inputs, grads)
    replays = _training_graph(module).replays
    x = inputs[0].clone().requires_grad_()
    out = module(x)
    assert _training_graph(module).replays == replays + 1
    weight = module._modules["3"].weight
    old = weight.data
    weight.data = old.clone()  # the same values in new memory
    old.fill_(1e4)  # what the graph would read, were it replayed
    got = torch.autograd.grad(out, [x, *module.parameters()], grads[0])
    _assert_same("moved between forward and backward", list(got), want[1:])


@pytest.mark.cuda
@needs_gpu
def test_parameters_moving_every_call_turn_the_graphs_off():
    module = _module("Gpt2Mlp")
    gen = torch.Generator().manual_seed(17)
    with pytest.warns(RuntimeWarning, match="Gpt2Mlp: its parameters moved to new memory 3 times"):
        for step in range(12):
            inputs, grads = _inputs(module, 8, gen)
            _assert_same(f"step {step}", _step(module, inputs, grads), _plain(module, inputs, grads))
            weight = module._modules["0"].weight
            weight.data = weight.data.clone()  # regathered into new memory, as FSDP does every call
    assert "moved to new memory 3 times" in module.cuda_graphs.failed
    assert module.cuda_graphs.captured == 0


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_runs_plain_and_gives_the_plain_grads(reentrant):
    """Under torch.utils.checkpoint every forward runs as usual (its saved-tensor hooks, or the
    recomputation under grad, must see what a forward keeps): three checkpointed steps, the
    grads of the plain path, no training graph captured."""
    module = _module("Gpt2Mlp")
    gen = torch.Generator().manual_seed(15)
    for step in range(3):
        inputs, grads = _inputs(module, 8, gen)
        x = inputs[0].clone().requires_grad_()
        module.zero_grad(set_to_none=True)
        # (.backward: the reentrant checkpoint does not support torch.autograd.grad)
        torch.utils.checkpoint.checkpoint(module, x, use_reentrant=reentrant).backward(grads[0])
        got = [x.grad, *(p.grad for p in module.parameters())]
        want = _plain(module, inputs, grads)[1:]
        _assert_same(f"checkpointed step {step}", list(got), want)
    assert not [key for key in module.cuda_graphs._graphs if key[0] == "training"] or reentrant


def test_a_module_with_graphs_runs_its_stages_as_functions_and_weight_grads_last():
    """The generated code (CPU): TeMlp's Function runs forward_stages and backward_stages through
    the runtime's replay functions; the weight-grad GEMMs come after the replayed part, which
    returns what they read."""
    te_mlp = inspect.getmodule(generated.TeMlp)
    backward = inspect.getsource(te_mlp.TeMlpFunction.backward)
    stages = inspect.getsource(te_mlp.backward_stages)
    assert "replay_backward(ctx, backward_stages" in backward and "backward_done(ctx)" in backward
    assert "ref.weight_grad(" not in stages and backward.count("ref.weight_grad(") == 2
    assert "replay_forward(graph, ctx, forward_stages, args)" in inspect.getsource(te_mlp.TeMlpFunction.forward)
    gelu_any = inspect.getmodule(generated.GeluAny)  # no graphs: the same shape of Function, given none
    assert "replay_forward(graph, ctx, forward_stages, args)" in inspect.getsource(gelu_any.GeluAnyFunction.forward)
    assert "GeluAnyFunction.apply(None, *args)" in inspect.getsource(gelu_any.GeluAny.forward)


def test_training_on_cpu_runs_the_stages_as_usual():
    module = generated.Gpt2Mlp(dtype=torch.float64)  # a module with graphs; a small one
    R.randomize_(module, torch.Generator().manual_seed(14))
    x = torch.randn(3, module.in_features, dtype=torch.float64, requires_grad=True)
    out = module(x)
    assert out.grad_fn.replayed is None
    out.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in module.parameters())
    assert module.cuda_graphs.captured == 0
