"""Attention pipelines replayed from CUDA graphs at a few rows, and the bound on the longest
sequence that makes it possible (templates/runtime/checks.py: packed_sequences; graphs.py:
CudaGraphs' ``per_call`` and ``dtypes``; training_graphs.py).

A graph reads the packed sequences' offsets (cu_seqlens) from a buffer of its own, copied in each
call like x, and FlashAttention-2's max_seqlen (a host int, fixed in the graph) is the call's row
count at a few rows: a bound of every sequence, so one graph per row count and batch count serves
every set of lengths, and a device seq_lens needs no sync (its values checked on the device).

On CPU: the bound (no host read of the lengths at a few rows on a device, nor under compile), the
rendered module (which arguments a graph copies, the dtypes it captures in), a replay's saved
values. On a GPU (``cuda``): bf16 layers (GQA with rotary, MHA, MQA) replayed with new lengths each
call against an uncaptured run and float64, no-grad and training (grads of x and every
parameter), a new batch count a new graph, no sync on replay, fp32 uncaptured without a warning.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import generated
from generated._runtime import checks, training_graphs
from references import as64, assert_close_to_reference, randomize_
from test_attention_pipelines import GPU_LAYERS, HIDDEN, LAYERS, assert_close_scaled, bf16_tolerance, layer64

ATTENTION_MODULES = ["AttentionBlock", "LlamaLayer", "MhaBlock", "MqaBlock"]


class HostRead(Exception):
    """A read of the lengths on the host (a device sync where seq_lens is on a GPU)."""


@pytest.fixture
def no_host_reads(monkeypatch):
    """Tensor.tolist and Tensor.item raise: packed_sequences must not read the lengths."""
    def refuse(self, *args, **kwargs):
        raise HostRead("the lengths were read on the host")
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)


# --- the bound (CPU; a device x is a meta one here: packed_sequences treats every non-CPU device alike)

def test_at_a_few_rows_on_a_device_the_bound_is_the_rows_and_the_lengths_stay_there(no_host_reads):
    x = torch.empty(12, 8, device="meta")
    seq_lens = torch.tensor([3, 0, 1, 8], device="meta")
    cu_seqlens, max_seqlen = checks.packed_sequences("M", x, seq_lens, None, 128)
    assert max_seqlen == 12 and cu_seqlens.shape == (5,) and cu_seqlens.dtype == torch.int32
    # a max_seqlen given is checked against the lengths (on the device), and the rows passed on:
    # one graph's key for every call of 12 rows in 4 sequences
    assert checks.packed_sequences("M", x, seq_lens, None, 12)[1] == 12
    assert checks.packed_sequences("M", x, seq_lens, 8, 128)[1] == 12
    # the 2-D and 3-D forms: the sequence length x's shape gives
    assert checks.packed_sequences("M", x, None, 5 + 7, 128)[1] == 12
    assert checks.packed_sequences("M", x.reshape(3, 4, 8), None, 9, 128)[1] == 4


def test_above_a_few_rows_without_max_seqlen_a_device_seq_lens_is_read_on_the_host(no_host_reads):
    """(the sync the bound saves: a device seq_lens with more rows and no max_seqlen)"""
    x = torch.empty(12, 8, device="meta")
    seq_lens = torch.tensor([3, 0, 1, 8], device="meta")
    with pytest.raises(HostRead):
        checks.packed_sequences("M", x, seq_lens, None, 11)
    with pytest.raises(HostRead):
        checks.packed_sequences("M", x, seq_lens, None)  # a module without graphs
    assert checks.packed_sequences("M", x, seq_lens, 8)[1] == 8  # max_seqlen given: no read


def test_on_the_cpu_the_bound_stays_the_longest_length():
    """A CPU x replays no graphs: the ops see the longest length (or max_seqlen), as before."""
    x = torch.zeros(12, 8)
    assert checks.packed_sequences("M", x, torch.tensor([3, 0, 1, 8]), None, 128)[1] == 8
    assert checks.packed_sequences("M", x, torch.tensor([3, 0, 1, 8]), 10, 128)[1] == 10


def test_under_compile_without_max_seqlen_the_bound_is_the_rows_checked_on_the_device(no_host_reads, monkeypatch):
    """torch.compile traces packed_sequences: no host read (a graph break), no guard on the
    lengths; the rows bound them and the device checks them (_assert_async: on CPU it raises at
    once, on a GPU the next sync reports it)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.zeros(12, 8)
    cu_seqlens, max_seqlen = checks.packed_sequences("M", x, torch.tensor([3, 0, 1, 8]), None, 128)
    assert max_seqlen == 12
    monkeypatch.undo()  # (reading the offsets back)
    assert cu_seqlens.tolist() == [0, 3, 3, 4, 12]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="M: seq_lens must be lengths of 0 or more summing to x's 12 rows"):
        checks.packed_sequences("M", x, torch.tensor([3, 0, 1, 7]), None)
    with pytest.raises(RuntimeError, match="longest at most max_seqlen=5"):
        checks.packed_sequences("M", x, torch.tensor([3, 0, 1, 8]), 5)


# --- the rendered modules (CPU)

@pytest.mark.parametrize("name", ATTENTION_MODULES)
def test_an_attention_module_replays_graphs_copying_its_offsets_in_bf16_and_fp16_only(name):
    module_file = inspect.getmodule(getattr(generated, name))
    module = getattr(generated, name)(device="meta")
    for graphs in (module.cuda_graphs, module_file.COMPILED_GRAPHS):
        assert graphs.inputs == 1 and graphs.dtypes == (torch.bfloat16, torch.float16)
        # the per-call tensor a graph copies in is the offsets, by its position in the Function's arguments
        stages = list(inspect.signature(module_file.forward_stages).parameters)
        assert [stages[i] for i in graphs.per_call] == ["cu_seqlens"]
        assert graphs.copied == (0, *graphs.per_call)
    # torch.compile's training ops replay in the same dtypes (fp32 runs the reference math)
    assert module_file.COMPILED_PASSES.dtypes == (torch.bfloat16, torch.float16)
    # the module bounds the longest length by the rows at its graphs' max_rows
    assert "max_seqlen, self.cuda_graphs.max_rows)" in inspect.getsource(type(module).forward)


def test_modules_without_sequences_render_their_graphs_as_before():
    module = generated.TeMlp(device="meta")
    assert module.cuda_graphs.per_call == () and module.cuda_graphs.dtypes is None


def test_the_plan_decides_replay_and_its_dtypes_from_the_stages():
    from pathlib import Path

    from fusegen import fusion_rules
    from fusegen.build import plan_specs
    from fusegen.emit.pipeline import replay_dtypes, replays_graphs
    from fusegen.frontend import parse_spec
    from fusegen.names import NameTable

    path = Path(__file__).resolve().parents[2] / "specs" / "attention_block.py"
    plans = {p.pipeline.name: p for p in plan_specs(parse_spec(path.read_text(), "attention_block.py"), NameTable(),
                                                    fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)}
    attention = plans["attention_block"]
    assert replays_graphs(attention) and replay_dtypes(attention) == ("bfloat16", "float16")
    assert [s.rule.stage.replay_dtypes for s in attention.forward if s.rule.name == "attention"] == [
        ("float16", "bfloat16")]


def test_a_graph_key_is_per_row_and_batch_count_never_per_lengths():
    """CudaGraphs' key of an attention pipeline's call (x, parameters, cu_seqlens, max_seqlen): the
    offsets' shape is in it, their values are not (the replay copies them in), max_seqlen (the
    rows at a few rows) is; the offsets are never taken for a parameter (a new tensor each call:
    its address would drop the graphs every call)."""
    from generated._runtime.graphs import CudaGraphs

    weight = torch.zeros(4, 4)

    def call(rows, lengths, by_parameters=False, graphs=None):
        graphs = graphs or CudaGraphs("M", inputs=1, per_call=(2,), by_parameters=by_parameters)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        args = (torch.zeros(rows, 4), weight, cu, rows)
        return graphs, graphs._key("training", args, 0, 0)

    graphs, key = call(24, [3, 1, 20])
    assert graphs._layout == ([1], [3])  # the weight a parameter, max_seqlen a host value
    assert call(24, [10, 10, 4], graphs=graphs)[1] == key  # new lengths: the same graph
    assert call(24, [12, 12], graphs=graphs)[1] != key  # a new batch count: a graph of its own
    assert call(23, [3, 1, 19], graphs=graphs)[1] != key  # a new row count (and bound)
    assert graphs.copied == (0, 2)
    graphs, key = call(24, [3, 1, 20], by_parameters=True)  # the compiled no-grad op's graphs
    assert key[-1] == weight.data_ptr() and call(24, [24, 0, 0], True, graphs)[1] == key


def test_graphs_pickle_with_their_per_call_inputs_and_dtypes():
    import pickle

    graphs = generated.AttentionBlock(device="meta").cuda_graphs
    twin = pickle.loads(pickle.dumps(graphs))
    assert (twin.per_call, twin.dtypes, twin.inputs) == (graphs.per_call, graphs.dtypes, graphs.inputs)
    passes = inspect.getmodule(generated.AttentionBlock).COMPILED_PASSES
    twin = pickle.loads(pickle.dumps(passes))
    assert (twin.dtypes, twin.max_rows, twin.captured) == (passes.dtypes, passes.max_rows, 0)


def test_a_replay_reads_its_own_parameters_and_keeps_host_ints_as_they_are():
    """What a replayed forward's backward reads: the graph's buffers, this call's parameters where
    the capture's were (marked by position), and host ints (max_seqlen) as they are, never taken
    for positions (an int 2 here would have read args[2])."""
    buffer = torch.zeros(3)

    class Entry:
        saved = [buffer, training_graphs._Parameter(2), 2]
        replays = 0

    args = (torch.ones(1), torch.ones(2), torch.full((4,), 7.0))
    replay = training_graphs._Replay(Entry, args)
    assert replay.saved[0] is buffer and replay.saved[1] is args[2] and replay.saved[2] == 2


def test_cpu_calls_of_an_attention_module_need_no_graphs():
    """On CPU the module runs as usual (the float64 checks: test_attention_pipelines.py)."""
    module = generated.AttentionBlock()
    with torch.no_grad():
        module(torch.randn(5, HIDDEN), torch.tensor([2, 3]))
    assert module.cuda_graphs.captured == 0 and module.cuda_graphs.failed is None


# --- on a GPU

def bf16_module(name, seed=0):
    module = getattr(generated, name)(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(seed))
    return module.cuda().to(torch.bfloat16)


def plain(module, run):
    """``run()`` with the module's graphs off."""
    rows, module.cuda_graphs.max_rows = module.cuda_graphs.max_rows, 0
    try:
        return run()
    finally:
        module.cuda_graphs.max_rows = rows


# the same 24 rows in 3 sequences each call (one graph), lengths 1, 2, odd, long and 0 among them
SAME_SHAPE = [[3, 1, 20], [10, 10, 4], [1, 0, 23], [24, 0, 0], [7, 9, 8]]


def _batch(lengths, gen):
    x = torch.randn(sum(lengths), HIDDEN, generator=gen)
    return x.to("cuda", torch.bfloat16), torch.tensor(lengths, device="cuda", dtype=torch.int32)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_no_grad_replays_with_new_lengths_match_an_uncaptured_run_and_float64(name):
    heads, kv_heads = LAYERS[name][:2]
    tol = bf16_tolerance(kv_heads, heads)
    module = bf16_module(name)
    gen = torch.Generator().manual_seed(3)
    params = {k: as64(v, "cpu", False) for k, v in module.state_dict().items()}
    for call, lengths in enumerate(SAME_SHAPE):
        x, seq_lens = _batch(lengths, gen)
        with torch.no_grad():
            if call >= 2:  # a replay: no sync, the lengths checked on the device
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = module(x, seq_lens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = plain(module, lambda: module(x, seq_lens))
        assert module.cuda_graphs.captured == (0 if call == 0 else 1), module.cuda_graphs.failed
        assert_close_scaled(f"{name} call {call} y (uncaptured)", y, want.double().cpu(), tol)
        ref = layer64(name, params, as64(x, "cpu", False), lengths)
        assert_close_scaled(f"{name} call {call} y (float64)", y, ref, tol)
    # a new batch count (the same rows): offsets of another shape, a graph of its own
    for _ in range(3):
        x, seq_lens = _batch([12, 12], gen)
        with torch.no_grad():
            y = module(x, seq_lens)
    assert module.cuda_graphs.captured == 2
    assert_close_scaled(f"{name} two sequences", y, layer64(name, params, as64(x, "cpu", False), [12, 12]), tol)


def _step(module, x, seq_lens, dy):
    """Forward + backward: the output, x's grad, every parameter's grad (autograd.grad: nothing
    accumulated)."""
    x = x.clone().requires_grad_()
    y = module(x, seq_lens)
    grads = torch.autograd.grad(y, [x, *module.parameters()], dy)
    return [y.detach(), *grads]


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_training_replays_with_new_lengths_match_an_uncaptured_run_and_float64(name):
    heads, kv_heads = LAYERS[name][:2]
    tol = bf16_tolerance(kv_heads, heads)
    module = bf16_module(name)
    names = ["y", "dx", *(f"d{k}" for k, _ in module.named_parameters())]
    gen = torch.Generator().manual_seed(4)
    for call, lengths in enumerate(SAME_SHAPE):
        x, seq_lens = _batch(lengths, gen)
        dy = torch.randn(x.shape, generator=gen).to("cuda", torch.bfloat16)
        if call >= 2:  # replays of the forward and the backward: no sync
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = _step(module, x, seq_lens, dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want = plain(module, lambda: _step(module, x, seq_lens, dy))
        assert module.cuda_graphs.captured == (0 if call == 0 else 1), module.cuda_graphs.failed
        if call >= 2:  # the forward replayed (call 1 captured it), the backward captured and replayed
            (graph,) = [g for key, g in module.cuda_graphs._graphs.items() if key[0] == "training" and g is not None]
            assert graph.backward is not None and graph.replays == call and graph.lease is None
        # float64: the output and the grads of x and every parameter
        params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
        x64 = as64(x, "cpu", True)
        ref = layer64(name, params, x64, lengths)
        refs = [ref.detach(), *torch.autograd.grad(ref, [x64, *(params[k] for k, _ in module.named_parameters())],
                                                   dy.double().cpu())]
        for what, g, w, r in zip(names, got, want, refs):
            assert_close_scaled(f"{name} call {call} {what} (uncaptured)", g, w.double().cpu(), tol)
            assert_close_scaled(f"{name} call {call} {what} (float64)", g, r, tol)
    x, seq_lens = _batch([5, 19], gen)  # a new batch count: a new key
    dy = torch.randn(x.shape, generator=gen).to("cuda", torch.bfloat16)
    for _ in range(3):
        got = _step(module, x, seq_lens, dy)
    assert module.cuda_graphs.captured == 2
    want = plain(module, lambda: _step(module, x, seq_lens, dy))
    for what, g, w in zip(names, got, want):
        assert_close_scaled(f"{name} [5, 19] {what}", g, w.double().cpu(), tol)


@pytest.mark.cuda
def test_fp32_on_cuda_runs_uncaptured_without_a_warning():
    """fp32 runs the attention's reference math, which reads the offsets on the host: such calls
    are never captured (no failed capture, no warning) and match float64."""
    module = generated.AttentionBlock(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(5))
    module = module.cuda()
    gen = torch.Generator().manual_seed(6)
    lengths = [3, 1, 20]
    x = torch.randn(sum(lengths), HIDDEN, generator=gen).cuda()
    seq_lens = torch.tensor(lengths, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            xg = x.clone().requires_grad_()
            y = module(xg, seq_lens)
            y.backward(torch.ones_like(y))
            with torch.no_grad():
                y_no_grad = module(x, seq_lens)
    assert module.cuda_graphs.captured == 0 and module.cuda_graphs.failed is None
    params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
    ref = layer64("AttentionBlock", params, as64(x, "cpu", False), lengths)
    assert_close_to_reference("fp32 y", y.cpu(), ref.detach(), torch.float32)
    assert_close_to_reference("fp32 no-grad y", y_no_grad.cpu(), ref.detach(), torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("rows_lengths", [[3, 1, 20], [100, 7, 90, 1]], ids=["few rows", "many rows"])
def test_fullgraph_compile_with_a_device_seq_lens_and_no_max_seqlen_matches_eager(rows_lengths):
    """torch.compile(fullgraph=True) of a bf16 attention layer called with a device seq_lens and
    no max_seqlen: no graph break (the rows bound the longest length), forward and backward as
    the eager module's."""
    name = "AttentionBlock"
    heads, kv_heads = GPU_LAYERS[name][:2]
    tol = bf16_tolerance(kv_heads, heads)
    module = bf16_module(name)
    gen = torch.Generator().manual_seed(8)
    x, seq_lens = _batch(rows_lengths, gen)
    dy = torch.randn(x.shape, generator=gen).to("cuda", torch.bfloat16)
    want = plain(module, lambda: _step(module, x, seq_lens, dy))
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    got = _step(compiled, x, seq_lens, dy)
    with torch.no_grad():
        got_no_grad = compiled(x, seq_lens)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_close_scaled(f"compiled tensor {k}", g, w.double().cpu(), tol)
    assert_close_scaled("compiled no-grad y", got_no_grad, want[0].double().cpu(), tol)



@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_compiled_training_replays_with_new_lengths_match_an_uncaptured_run(name):
    """torch.compile(fullgraph=True) of a bf16 attention layer at a few rows: its forward and
    backward ops replay CUDA graphs (the offsets copied in, the rows the bound) with new lengths
    every call, and compute what the uncompiled module does."""
    heads, kv_heads = LAYERS[name][:2]
    tol = bf16_tolerance(kv_heads, heads)
    module = bf16_module(name)
    passes = inspect.getmodule(type(module)).COMPILED_PASSES
    passes.clear()
    gen = torch.Generator().manual_seed(9)
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    names = ["y", "dx", *(f"d{k}" for k, _ in module.named_parameters())]
    for call, lengths in enumerate(SAME_SHAPE):
        x, seq_lens = _batch(lengths, gen)
        dy = torch.randn(x.shape, generator=gen).to("cuda", torch.bfloat16)
        got = _step(compiled, x, seq_lens, dy)
        want = plain(module, lambda: _step(module, x, seq_lens, dy))
        for what, g, w in zip(names, got, want):
            assert_close_scaled(f"{name} compiled call {call} {what}", g, w.double().cpu(), tol)
    assert passes.captured == 2 and passes.failed is None  # the forward op's graph and the backward op's


@pytest.mark.cuda
def test_fp32_under_compile_on_cuda_runs_uncaptured_without_a_warning():
    """fp32 attention under torch.compile on CUDA: its ops never capture the reference math (which
    reads the offsets on the host), no failed capture, no warning."""
    module = generated.AttentionBlock(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(5))
    module = module.cuda()
    passes = inspect.getmodule(type(module)).COMPILED_PASSES
    passes.clear()
    gen = torch.Generator().manual_seed(10)
    lengths = [3, 1, 20]
    x = torch.randn(sum(lengths), HIDDEN, generator=gen).cuda()
    seq_lens = torch.tensor(lengths, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True)
    with warnings.catch_warnings():
        # a failed capture warns with a RuntimeWarning (inductor's own fp32 matmul hint is a UserWarning)
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(3):
            xg = x.clone().requires_grad_()
            y = compiled(xg, seq_lens)
            y.backward(torch.ones_like(y))
    assert passes.captured == 0 and passes.failed is None
    params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
    ref = layer64("AttentionBlock", params, as64(x, "cpu", False), lengths)
    assert_close_to_reference("fp32 compiled y", y.detach().cpu(), ref.detach(), torch.float32)


# --- torch.compile(fullgraph=True) on CPU: the attention's reference math traced without host reads

@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("form", ["seq_lens", "3-D"])
def test_fullgraph_compile_of_the_reference_path_matches_eager_and_float64(name, form):
    """On CPU (float32: the reference math, which loops over the sequences reading their offsets
    on the host) the compiled module attends over all rows with the sequences' block-diagonal
    mask, traced from the device offsets; seq_lens without max_seqlen (the rows bound it). The
    output, the grads of x and every parameter and the no-grad output against the eager module
    and float64."""
    module = generated.__dict__[name](dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(9))
    gen = torch.Generator().manual_seed(10)
    lengths = [3, 0, 1, 8, 5] if form == "seq_lens" else [6, 6, 6]
    x = torch.randn(sum(lengths), HIDDEN, generator=gen)
    dy = torch.randn(x.shape, generator=gen)
    seq_lens = torch.tensor(lengths)

    def run(m):
        xg = x.clone().requires_grad_()
        y = m(xg, seq_lens) if form == "seq_lens" else m(xg.reshape(3, 6, HIDDEN)).reshape(x.shape)
        grads = torch.autograd.grad(y, [xg, *module.parameters()], dy)
        with torch.no_grad():
            y_no_grad = m(x, seq_lens) if form == "seq_lens" else m(x.reshape(3, 6, HIDDEN)).reshape(x.shape)
        return [y.detach(), *grads, y_no_grad]

    want = run(module)
    torch._dynamo.reset()
    got = run(torch.compile(module, fullgraph=True, backend="aot_eager"))
    params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
    x64 = as64(x, "cpu", True)
    ref = layer64(name, params, x64, lengths)
    refs = [ref.detach(), *torch.autograd.grad(ref, [x64, *(params[k] for k, _ in module.named_parameters())],
                                               dy.double()), ref.detach()]
    names = ["y", "dx", *(f"d{k}" for k, _ in module.named_parameters()), "no-grad y"]
    for what, g, w, r in zip(names, got, want, refs, strict=True):
        assert_close_to_reference(f"{name} compiled {what} (float64)", g, r, torch.float32)
        assert_close_to_reference(f"{name} compiled {what} (eager)", g, w.double(), torch.float32)


def test_the_reference_attention_reads_no_offsets_on_the_host_under_compile(no_host_reads, monkeypatch):
    """What makes it traceable: under compile, attention_blocks is one range with a mask made on
    the device; the mask is the sequences' block diagonal (causal: and the lower triangle)."""
    from generated import _reference as ref

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q = torch.zeros(6, 2, 8)
    ((start, end, keep),) = ref.attention_blocks(torch.tensor([0, 2, 2, 6], dtype=torch.int32), q, True)
    monkeypatch.undo()
    want = torch.zeros(6, 6, dtype=torch.bool)
    want[:2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    want[2:, 2:] = torch.ones(4, 4, dtype=torch.bool).tril()
    assert (start, end) == (0, 6) and torch.equal(keep, want)


@pytest.mark.parametrize("name", ATTENTION_MODULES)
def test_the_backward_reads_the_one_buffer_and_makes_its_views_again(name):
    """q, k, v are views the backward takes again of the one tensor saved (the prep kernel's
    buffer, or the projection without rotary): they are not saved, nor passed to the backward."""
    module_file = inspect.getmodule(getattr(generated, name))
    saved = list(inspect.signature(module_file.backward_stages).parameters)
    hint = next(p[:-len("_lse")] for p in saved if p.endswith("_lse"))
    assert not {f"{hint}_q", f"{hint}_k", f"{hint}_v"} & set(saved)
    assert f"{hint}_qkv" in saved or name == "MhaBlock"  # (MhaBlock: no rotary, the projection is saved)
