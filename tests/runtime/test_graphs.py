"""A module's no-grad forward replayed from CUDA graphs (templates/runtime/graphs.py: CudaGraphs).

On a GPU: every module that replays graphs gives the results of its plain no-grad forward on new
inputs, returns new tensors each call, follows in-place parameter updates, drops its graphs when a
parameter moves, runs plain above ``max_rows``, inside a caller's capture and under
inference_mode, draws new Dropout masks each replay, serves several threads, and survives a
failed capture with a warning. On CPU: which modules use graphs, and that modules with them
pickle and copy."""

import copy
import pickle
import threading

import pytest
import torch

import generated
import references as R
from generated import _runtime

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# the modules that replay graphs in float32, as these tests run them (instances on the meta device:
# no parameter memory, no initialisation work); an attention pipeline replays them in bf16/fp16
# only (FlashAttention-2): test_attention_graphs.py
GRAPHED = sorted(name for name in R.module_names(generated) if R.replays_graphs_in(getattr(generated, name), torch.float32))


def _module(name, dtype=torch.float32, device="cuda"):
    module = getattr(generated, name)(device=device, dtype=dtype)
    R.randomize_(module, torch.Generator().manual_seed(7))
    return module


_inputs = R.module_inputs


def _plain(module, inputs):
    """The module's no-grad forward without graphs."""
    rows = module.cuda_graphs.max_rows
    module.cuda_graphs.max_rows = 0
    try:
        with torch.no_grad():
            out = module(*[t.clone() for t in inputs])
    finally:
        module.cuda_graphs.max_rows = rows
    return list(out) if isinstance(out, tuple) else [out]


def _call(module, inputs):
    with torch.no_grad():
        out = module(*[t.clone() for t in inputs])  # a clone: an in-place residual is written
    return list(out) if isinstance(out, tuple) else [out]


def test_modules_of_two_launches_or_more_use_graphs():
    """Multi-stage pipelines get graphs; a one-kernel pipeline, where copying in and out costs
    more than it saves, does not (nor one with a user's module: test_user_modules.py)."""
    assert "TeMlp" in GRAPHED and "PrenormBlock" in GRAPHED
    assert "GeluAny" not in GRAPHED and "MoeSwiglu" not in GRAPHED  # one elementwise kernel each


def test_a_module_with_graphs_pickles_copies_and_saves_without_them(tmp_path):
    module = _module("Gpt2Mlp", device="cpu")  # any module with graphs; a small one copies fast
    module.cuda_graphs.max_rows = 17
    module.cuda_graphs._graphs["probe"] = None
    for twin in (copy.deepcopy(module), pickle.loads(pickle.dumps(module))):
        assert twin.cuda_graphs.max_rows == 17 and twin.cuda_graphs._graphs == {}
        assert twin.cuda_graphs is not module.cuda_graphs
    torch.save(module, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert loaded.cuda_graphs.max_rows == 17 and loaded.cuda_graphs._graphs == {}
    x = torch.randn(3, module.in_features)
    with torch.no_grad():
        assert torch.equal(loaded(x), module(x))


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("name", GRAPHED)
def test_replays_give_the_plain_forward_on_new_inputs(name):
    """Calls 1 (plain), 2 (captures) and 3-4 (replays) on new inputs each: every output equals
    the plain forward's on the same inputs (fp32: cuBLAS under capture may pick another GEMM
    algorithm, so within the GEMM row), a replay of the same inputs gives the same bits, and
    each call's outputs are its own (a later call leaves them as they were)."""
    module = _module(name).eval()
    gen = torch.Generator().manual_seed(5)
    calls = [_inputs(module, 24, gen) for _ in range(4)]
    got = [_call(module, inputs) for inputs in calls]
    assert module.cuda_graphs.captured == 1, module.cuda_graphs.failed
    kept = [[t.clone() for t in outputs] for outputs in got]
    again = _call(module, calls[3])
    for i, (inputs, outputs) in enumerate(zip(calls, got)):
        for k, (out, want) in enumerate(zip(outputs, _plain(module, inputs))):
            R.assert_close_to_reference(f"{name} call {i} output {k}", out, want.double(), torch.float32)
            assert torch.equal(out, kept[i][k]), f"{name}: call {i}'s output {k} changed after later calls"
    for a, b in zip(again, got[3]):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replays_in_half_precision_match_the_plain_forward_bit_for_bit(dtype):
    module = _module("TeMlp", dtype=dtype).eval()
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):
        inputs = _inputs(module, 16, gen, dtype=dtype)
        got, want = _call(module, inputs), _plain(module, inputs)
        R.assert_close_to_reference("TeMlp", got[0], want[0].double(), dtype)
    assert module.cuda_graphs.captured == 1


@pytest.mark.cuda
@needs_gpu
def test_parameters_updated_in_place_are_seen_and_moved_ones_drop_the_graphs():
    module = _module("PrenormBlock")
    gen = torch.Generator().manual_seed(8)
    inputs = _inputs(module, 8, gen)
    for _ in range(3):
        _call(module, inputs)
    assert module.cuda_graphs.captured == 1
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)  # as an optimizer step does
    R.assert_close_to_reference("in-place update", _call(module, inputs)[0], _plain(module, inputs)[0].double(), torch.float32)
    first = next(module.parameters())
    first.data = first.data.clone() * 2  # new memory: the graph would read the old
    got = _call(module, inputs)
    assert module.cuda_graphs.captured == 0
    R.assert_close_to_reference("moved parameter", got[0], _plain(module, inputs)[0].double(), torch.float32)
    module.to(torch.float16)
    half = [t.half() for t in inputs]
    for _ in range(3):
        got = _call(module, half)
    R.assert_close_to_reference("after module.to", got[0], _plain(module, half)[0].double(), torch.float16)


@pytest.mark.cuda
@needs_gpu
def test_more_rows_than_max_rows_and_too_many_shapes_run_plain():
    module = _module("TeMlp", dtype=torch.bfloat16)
    module.cuda_graphs.max_rows, module.cuda_graphs.max_graphs = 32, 2
    gen = torch.Generator().manual_seed(9)
    for rows in (33, 33, 33, 1, 1, 2, 2, 3, 3, 3):
        inputs = _inputs(module, rows, gen, dtype=torch.bfloat16)
        got = _call(module, inputs)
        R.assert_close_to_reference(f"rows {rows}", got[0], _plain(module, inputs)[0].double(), torch.bfloat16)
    assert module.cuda_graphs.captured == 2  # 1 and 2 rows; 33 is above max_rows, 3 a third shape
    module.cuda_graphs.clear()
    assert module.cuda_graphs.captured == 0


@pytest.mark.cuda
@needs_gpu
def test_inference_mode_and_no_grad_calls_share_graphs():
    module = _module("TeMlp", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(10)
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode, torch.no_grad):
        x = _inputs(module, 4, gen, dtype=torch.bfloat16)[0]
        with mode():
            y = module(x)
        assert y.is_inference() == (mode is torch.inference_mode)
        R.assert_close_to_reference("TeMlp", y, _plain(module, [x])[0].double(), torch.bfloat16)
    assert module.cuda_graphs.captured == 1


@pytest.mark.cuda
@needs_gpu
def test_inside_a_callers_capture_the_module_runs_plain():
    """A caller capturing its own graph gets the module's launches in it (no graph in a graph)."""
    module = _module("TeMlp", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(11)
    static = _inputs(module, 8, gen, dtype=torch.bfloat16)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            module(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = module(static)
    fresh = _inputs(module, 8, gen, dtype=torch.bfloat16)[0]
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    R.assert_close_to_reference("caller's graph", out, _plain(module, [fresh])[0].double(), torch.bfloat16)


@pytest.mark.cuda
@needs_gpu
def test_dropout_in_training_draws_new_masks_on_every_replay():
    """Dropout(0.1) of post_attention, training mode, no grad: each replay's mask is new (the
    graph's generator advances), and every element is either dropped or the plain value."""
    module = _module("PostAttention").train()
    gen = torch.Generator().manual_seed(12)
    inputs = _inputs(module, 64, gen)
    outs = [_call(module, inputs)[1] for _ in range(5)]  # extra output: residual + dropout(bias + y)
    assert module.cuda_graphs.captured == 1
    module.eval()
    kept = _call(module, inputs)[1] - inputs[1]  # no dropout: bias + y
    masks = []
    for out in outs[1:]:
        delta = out - inputs[1]
        dropped = delta.abs() < 1e-6
        masks.append(dropped)
        torch.testing.assert_close(delta[~dropped], kept[~dropped] / 0.9, rtol=1e-5, atol=1e-5)
        assert 0.05 < dropped.float().mean().item() < 0.15
    assert not torch.equal(masks[1], masks[2]) and not torch.equal(masks[2], masks[3])


@pytest.mark.cuda
@needs_gpu
def test_threads_calling_one_module_each_get_their_own_results():
    module = _module("TeMlp", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(13)
    inputs = [_inputs(module, 4, gen, dtype=torch.bfloat16)[0] for _ in range(8)]
    want = [_plain(module, [x])[0] for x in inputs]
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(20):
                with torch.no_grad():
                    results[k] = module(inputs[k])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors
    for k in range(8):
        R.assert_close_to_reference(f"thread {k}", results[k], want[k].double(), torch.bfloat16)
    assert module.cuda_graphs.captured == 1


@pytest.mark.cuda
@needs_gpu
def test_a_failed_capture_warns_and_the_module_goes_on_without_graphs():
    graphs = _runtime.CudaGraphs("Probe", inputs=1)
    calls = []

    def forward(x, w):  # synchronising is not allowed while a stream is captured
        calls.append(1)
        torch.cuda.synchronize()
        return x * w

    x, w = torch.randn(4, 8, device="cuda"), torch.randn(8, device="cuda")
    with torch.no_grad():
        assert torch.equal(graphs.no_grad(forward, (x, w)), x * w)
        with pytest.warns(RuntimeWarning, match="Probe: capturing its no-grad forward in a CUDA graph failed"):
            assert torch.equal(graphs.no_grad(forward, (x, w)), x * w)
        assert graphs.failed and graphs.captured == 0
        assert torch.equal(graphs.no_grad(forward, (x, w)), x * w)
    # PyTorch is left as it was: random ops (a module's initialisation) and captures work
    assert torch.rand(8, device="cuda").unique().numel() == 8
    _module("TeMlp", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
    graph.replay()
    assert torch.equal(y, x * 2)
