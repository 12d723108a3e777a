"""Generated pipelines with self-attention over packed sequences (specs/attention_block.py), end to
end on CPU: the attention op's stage reads the pipeline's packed sequences (``cu_seqlens``,
``max_seqlen``), the backward gets the host int without ``save_for_backward``, the no-grad forward
runs the same stages. Against a float64 reference written here, independently of the generated
code: attention one sequence at a time with an explicit causal mask, rotary as rotate-half with
cos/sin tables (positions restarting at each sequence), the Residuals, RMSNorm, LayerNorm, SwiGLU.
Outputs and grads of x and every parameter, packed batches with lengths 1, 2, odd, long and 0, the
three call forms, and the errors for bad seq_lens. A ``cuda`` test runs the same in bf16 (FA2)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import generated
from references import as64, assert_close_to_reference, attention64, layer_norm, randomize_, rms_norm, swiglu

HIDDEN, HEAD_DIM = 256, 64

# pipeline class → (heads, kv_heads, causal, rotary_base, norm); the specs' numbers, restated
LAYERS = {
    "AttentionBlock": (4, 2, True, 10000.0, "rms"),
    "MhaBlock": (4, 4, False, None, "layer"),
    "MqaBlock": (4, 1, True, 10000.0, "rms"),
}
# the issue's Llama-3-8B layer (specs/llama_layer.py, hidden 4096): on the GPU in bf16, and on the
# CPU once (test_the_issue_layer_trains_on_the_cpu: a few tokens, its float64 reference in seconds)
GPU_LAYERS = {**LAYERS, "LlamaLayer": (32, 8, True, 500000.0, "rms")}
# packed batches: lengths 1, 2, odd and long, an empty sequence among them, one long sequence
BATCHES = [[1, 2, 7, 33], [1], [2, 0, 1, 40], [65], [5, 5, 5]]


def layer64(name, p, x, lengths):
    """The spec's layer in float64: y = x + attn_block(x) [+ mlp_block(y)]."""
    heads, kv_heads, causal, rotary, norm = GPU_LAYERS[name]
    if norm == "rms":
        h = rms_norm(x, p["0.0.weight"])
    else:
        h = layer_norm(x, p["0.0.weight"], p["0.0.bias"])
    h = F.linear(h, p["0.1.weight"], p.get("0.1.bias"))
    h = attention64(h, lengths, heads, kv_heads, causal, rotary)
    x = x + F.linear(h, p["0.3.weight"], p.get("0.3.bias"))
    if "1.0.weight" not in p:
        return x
    h = swiglu(F.linear(rms_norm(x, p["1.0.weight"]), p["1.1.weight"]))
    return x + F.linear(h, p["1.3.weight"])


def make_module(name, seed=0):
    module = getattr(generated, name)(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(seed))
    return module


def check_against_float64(module, name, x, lengths, call, no_grad=True):
    """Forward + backward of ``call(module, x)`` against layer64 on the packed rows: the output,
    x's grad and every parameter's grad, at 4 units of roundoff (fp32 with GEMMs: fp16's)."""
    module.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(len(lengths) + sum(lengths))
    x = x.detach().requires_grad_()
    y = call(module, x)
    assert y.shape == x.shape and y.dtype == torch.float32
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
    x64 = as64(x, "cpu", True)
    ref = layer64(name, params, x64.reshape(-1, HIDDEN), lengths).reshape(x.shape)
    ref.backward(dy.double())
    assert_close_to_reference(f"{name} y", y, ref, torch.float32)
    assert_close_to_reference(f"{name} dx", x.grad, x64.grad, torch.float32)
    for key, parameter in module.named_parameters():
        assert parameter.grad is not None, f"{name}: no grad for {key}"
        assert_close_to_reference(f"{name} d{key}", parameter.grad, params[key].grad, torch.float32)
    if no_grad:  # the no-grad forward: the same stages keeping nothing
        with torch.no_grad():
            again = call(module, x)
        assert again.grad_fn is None
        assert_close_to_reference(f"{name} no-grad y", again, ref, torch.float32)


def test_the_issue_layer_trains_on_the_cpu():
    """The issue's example, generated.LlamaLayer (specs/llama_layer.py: two Residuals, GQA of 32
    and 8 heads of 128 with rotary base 500000, SwiGLU 14336), in float32 on the CPU: output and
    the grads of x and every parameter against the float64 reference on a packed batch, then
    training steps lower a loss."""
    module = make_module("LlamaLayer")
    lengths = [1, 4, 0, 3]
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(sum(lengths), 4096, generator=gen)
    seq_lens = torch.tensor(lengths)
    module.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    y = module(xg, seq_lens)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
    x64 = as64(x, "cpu", True)
    ref = layer64("LlamaLayer", params, x64, lengths)
    ref.backward(dy.double())
    assert_close_to_reference("LlamaLayer y", y, ref, torch.float32)
    assert_close_to_reference("LlamaLayer dx", xg.grad, x64.grad, torch.float32)
    for key, parameter in module.named_parameters():
        assert_close_to_reference(f"LlamaLayer d{key}", parameter.grad, params[key].grad, torch.float32)
    del params, x64, ref
    # it trains: plain SGD on a regression target lowers the loss step by step
    target = torch.randn(x.shape, generator=gen)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        loss = (module(x, seq_lens) - target).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("lengths", BATCHES, ids=lambda lengths: "-".join(map(str, lengths)))
def test_packed_batch_matches_float64(name, lengths):
    module = make_module(name)
    x = torch.randn(sum(lengths), HIDDEN, generator=torch.Generator().manual_seed(1))
    seq_lens = torch.tensor(lengths)  # int64 on the CPU: the longest length without a sync
    check_against_float64(module, name, x, lengths, lambda m, x: m(x, seq_lens))


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_call_forms(name):
    """seq_lens as a keyword, int32, with max_seqlen above the longest; a 2-D x (one sequence);
    a 3-D x [batch, seq, hidden] (batch sequences of seq tokens, batch-major)."""
    module = make_module(name, seed=2)
    gen = torch.Generator().manual_seed(3)
    lengths = [3, 1, 9]
    x = torch.randn(13, HIDDEN, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    check_against_float64(module, name, x, lengths, lambda m, x: m(x, seq_lens=seq_lens, max_seqlen=16))
    check_against_float64(module, name, torch.randn(11, HIDDEN, generator=gen), [11], lambda m, x: m(x))
    check_against_float64(module, name, torch.randn(3, 6, HIDDEN, generator=gen), [6, 6, 6], lambda m, x: m(x))


def test_backward_gets_max_seqlen_as_a_host_int_not_a_saved_tensor():
    """max_seqlen reaches the backward on the ctx (replay_forward's host=), never through
    save_for_backward (which takes tensors only); with max_seqlen= given, the bound given."""
    module = make_module("AttentionBlock")
    x = torch.randn(8, HIDDEN, requires_grad=True)
    y = module(x, torch.tensor([3, 5]), max_seqlen=7)
    ctx = y.grad_fn
    assert list(ctx.host_values.values()) == [7]
    assert all(isinstance(t, torch.Tensor) for t in ctx.saved_tensors if t is not None)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_sequences_do_not_see_each_other():
    """Changing one packed sequence's tokens leaves the other sequences' outputs as they were."""
    module = make_module("MhaBlock")  # no mask: every token of a sequence sees all of it
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(4))
    seq_lens = torch.tensor([5, 7])
    with torch.no_grad():
        y = module(x, seq_lens)
        x2 = x.clone()
        x2[6] += 1.0
        y2 = module(x2, seq_lens)
    assert torch.equal(y[:5], y2[:5]) and not torch.equal(y[5:], y2[5:])


def test_state_dict_keys_follow_the_eager_nesting():
    assert list(make_module("AttentionBlock").state_dict()) == [
        "0.0.weight", "0.1.weight", "0.3.weight", "1.0.weight", "1.1.weight", "1.3.weight"]
    assert list(make_module("MhaBlock").state_dict()) == [
        "0.0.weight", "0.0.bias", "0.1.weight", "0.1.bias", "0.3.weight", "0.3.bias"]


@pytest.mark.parametrize("seq_lens,kind,problem", [
    (torch.tensor([3, 4]), ValueError, "sums to 7 tokens but x's rows are 8"),
    (torch.tensor([9, -1]), ValueError, "negative length"),
    (torch.tensor([4.0, 4.0]), TypeError, "int32 or int64"),
    (torch.tensor([], dtype=torch.int64), ValueError, "at least one"),
    (torch.tensor([[4, 4]]), ValueError, "1-D [batch]"),
    ([4, 4], TypeError, "must be a torch.Tensor"),
])
def test_bad_seq_lens_are_refused(seq_lens, kind, problem):
    module = make_module("AttentionBlock")
    with pytest.raises(kind, match="AttentionBlock: seq_lens") as info:
        module(torch.randn(8, HIDDEN), seq_lens)
    assert problem in str(info.value)


def test_bad_call_forms_are_refused():
    module = make_module("AttentionBlock")
    with pytest.raises(ValueError, match="max_seqlen=3 is less than the longest of seq_lens, 5"):
        module(torch.randn(8, HIDDEN), torch.tensor([5, 3]), max_seqlen=3)
    with pytest.raises(ValueError, match="seq_lens was given with a 3-D x"):
        module(torch.randn(2, 4, HIDDEN), torch.tensor([4, 4]))


# TE's attention tolerances (tests/ops/test_attention_ops.py's fa2_tolerance): bf16 2.5e-2, GQA/MQA
# 3.5e-2, relative to the tensor's largest reference value here, as the layer's GEMMs round in bf16
def bf16_tolerance(kv_heads, heads):
    return 2.5e-2 if kv_heads == heads else 3.5e-2


def assert_close_scaled(what, got, ref, tol):
    scale = ref.abs().max().item()
    err = (got.detach().double().cpu() - ref.detach()).abs().max().item()
    assert math.isfinite(err) and err <= tol * scale, f"{what}: max |err| {err:.3e} > {tol} x {scale:.3e}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(GPU_LAYERS))
def test_bf16_on_cuda_matches_float64(name):
    """The generated layer on CUDA in bf16: attention through FA2 varlen, the rest fusegen's kernels
    and cuBLAS; packed lengths 1, 2, odd and long, then the 3-D form; output, x's and every
    parameter's grad against float64."""
    heads, kv_heads = GPU_LAYERS[name][:2]
    tol = bf16_tolerance(kv_heads, heads)
    module = make_module(name).cuda().to(torch.bfloat16)
    hidden = module.in_features
    for lengths, shape in [([1, 2, 7, 130, 33], None), ([64] * 3, (3, 64))]:
        module.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(sum(lengths))
        x = torch.randn(sum(lengths), hidden, generator=gen)
        dy = torch.randn(sum(lengths), hidden, generator=gen)
        xc = x.to("cuda", torch.bfloat16).requires_grad_()
        if shape is None:
            y = module(xc, torch.tensor(lengths, device="cuda", dtype=torch.int32))
        else:
            y = module(xc.reshape(*shape, hidden)).reshape(-1, hidden)
        y.backward(dy.to("cuda", torch.bfloat16))
        params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
        x64 = as64(xc, "cpu", True)
        ref = layer64(name, params, x64, lengths)
        ref.backward(dy.double())
        assert_close_scaled(f"{name} y", y, ref, tol)
        assert_close_scaled(f"{name} dx", xc.grad, x64.grad, tol)
        for key, parameter in module.named_parameters():
            assert_close_scaled(f"{name} d{key}", parameter.grad, params[key].grad, tol)


def test_the_plan_fuses_around_the_attention_stage():
    """The layer's plan (not only its numbers): attention a stage of its own, the first Residual's
    add fused into the second's RMSNorm kernel (and its grad into that norm's backward), the last
    GEMM adding into the residual (beta = 1)."""
    from pathlib import Path

    from fusegen import fusion_rules
    from fusegen.build import plan_specs
    from fusegen.frontend import parse_spec
    from fusegen.names import NameTable

    path = Path(__file__).resolve().parents[2] / "specs" / "attention_block.py"
    plans = plan_specs(parse_spec(path.read_text(), "attention_block.py"), NameTable(), fusion_rules.FORWARD_RULES,
                       fusion_rules.BACKWARD_RULES)
    plan = {p.pipeline.name: p for p in plans}["attention_block"]
    assert [s.rule.name for s in plan.forward] == [
        "elementwise", "norm", "linear", "attention", "linear", "add_norm", "linear", "elementwise", "linear_scale_add"]
    assert [s.rule.name for s in plan.backward][::-1] == [  # listed by op order; run last first
        "elementwise_backward", "linear_backward", "elementwise_backward", "linear_backward", "norm_residual_grad",
        "linear_backward", "attention_backward", "linear_backward", "norm_residual_grad"]
    assert [s.rule.name for s in plan.inference if s.rule.name == "attention"] == ["attention"]


def test_llama_layer_takes_the_bench_peers_weights():
    """specs/llama_layer.py (issue 38's example layer): bench/bench_layer.py loads its eager peer's
    weights into generated.LlamaLayer by GENERATED_KEYS; every key and shape matches (on meta: the
    layer holds 218M parameters), and shapes propagate on meta. Its numerics are those of
    AttentionBlock's structure, tested above."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "bench_layer.py"
    spec = importlib.util.spec_from_file_location("bench_layer", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    eager = bench.EagerLlamaLayer("meta", torch.bfloat16)
    module = generated.LlamaLayer(device="meta", dtype=torch.bfloat16)
    mapped = {bench.GENERATED_KEYS[k]: tuple(v.shape) for k, v in eager.state_dict().items()}
    # (its Linears' FP8 state, TE's _extra_state, aside: a checkpoint without it loads, tested in test_fp8.py)
    assert mapped == {k: tuple(v.shape) for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    module.load_state_dict({bench.GENERATED_KEYS[k]: v for k, v in eager.state_dict().items()})
    # shapes through the packed call form, forward and backward (the reference path's meta shapes)
    x = torch.empty(23, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = module(x, seq_lens=torch.tensor([5, 18]), max_seqlen=18)
    assert y.is_meta and y.shape == (23, 4096)
    y.sum().backward()
    assert x.grad.shape == x.shape and all(p.grad.shape == p.shape for p in module.parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_bf16_layer_is_captured_in_a_cuda_graph_and_replays_new_tokens(name):
    """Your CUDA graph of the layer's forward + backward in bf16 (FlashAttention-2; the offsets and
    the rotary positions computed on the device, max_seqlen a fixed bound): replayed on new tokens
    of the same lengths, the output and every grad match an uncaptured run on those tokens (FA2's
    backward sums dq with atomics, so within bf16's attention tolerance, not bit for bit)."""
    heads, kv_heads = LAYERS[name][:2]
    tol = bf16_tolerance(kv_heads, heads)
    module = make_module(name).cuda().to(torch.bfloat16)
    lengths = [3, 17, 1, 40]
    seq_lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    static = torch.randn(sum(lengths), HIDDEN, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    dy = torch.randn(sum(lengths), HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)

    def step(x):
        module(x, seq_lens, max_seqlen=max(lengths)).backward(dy)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        for _ in range(2):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    static.grad = None
    with torch.cuda.graph(graph):
        y = module(static, seq_lens, max_seqlen=max(lengths))
        y.backward(dy)
    fresh = torch.randn(sum(lengths), HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        static.copy_(fresh)
        for p in module.parameters():
            p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = {"y": y.detach().clone(), "dx": static.grad.clone(),
                **{k: p.grad.clone() for k, p in module.named_parameters()}}
    for p in module.parameters():
        p.grad = None
    x = fresh.clone().requires_grad_()
    want_y = module(x, seq_lens, max_seqlen=max(lengths))
    want_y.backward(dy)
    want = {"y": want_y.detach(), "dx": x.grad, **{k: p.grad for k, p in module.named_parameters()}}
    for key, got in replayed.items():
        assert_close_scaled(f"{name} {key}", got, want[key].double().cpu(), tol)
