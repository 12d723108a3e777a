"""Attention dropout (TE's DotProductAttention ``attention_dropout``, te.MultiheadAttention's and
te.TransformerLayer's default 0.1): in training each softmax probability is kept with probability
1 - p and scaled by 1 / (1 - p); in eval nothing is dropped (ops/attention.py, attention_math.py).

The mask of the reference path (CPU, fp32, float64) is documented: under the key ``k`` (the first
element of the rng state ``flash_attention_forward`` returns, drawn from torch's generator as
``torch.randint(-2**63, 2**63 - 1, (1,))``), probability (h, i, j) of the [heads, total, total]
matrix of the packed rows is kept where ``uniform(k, (h * total + i) * total + j)`` (ops/common.py's
counter-based 24-bit draw) is at least p rounded up to a multiple of 2**-24. The float64
references below build that mask and the attention around it independently of the code under
test. On CUDA bf16/fp16 FlashAttention-2 draws the mask (philox); those tests check its
statistics, seeding and CUDA-graph replay.
"""

import math

import pytest
import torch

from fusegen import eager
from fusegen.ops import attention as ops_attention
from fusegen.ops.common import uniform
from tests.ops.test_attention_ops import fa2_tolerance
from tests.references import assert_close_to_reference

LENGTHS = [3, 1, 9, 5]  # packed sequences: odd, a single token, longer
P = 0.1


def offsets(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def documented_keep(key, heads, total, p):
    """The documented mask [heads, total, total] (True: kept) under ``key`` (an int)."""
    index = torch.arange(heads * total * total, dtype=torch.int64).reshape(heads, total, total)
    threshold = math.ceil(p * 2**24) / 2**24
    return uniform(torch.tensor([key]), index) >= threshold


def attention64(q, k, v, lengths, causal, keep=None, p=0.0):
    """float64 softmax(q k^T / sqrt(d)) v per sequence, the probabilities times keep / (1 - p)
    where ``keep`` [heads, total, total] is given; q [total, heads, d], k and v [total, kv, d]."""
    total, heads, d = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(total, heads, d, dtype=torch.float64)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        for h in range(heads):
            scores = q[rows, h].double() @ k[rows, h // group].double().T / math.sqrt(d)
            if causal:
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if keep is not None:
                probs = probs * keep[h, rows, rows].double() / (1.0 - p)
            out[rows, h] = probs @ v[rows, h // group].double()
        start += n
    return out.reshape(total, -1)


def qkv(lengths, heads, kv_heads, d, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    make = lambda h: torch.randn(total, h, d, generator=gen, dtype=torch.float64).to(device, dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


# --- (1) eval and p = 0: no dropout, as before -----------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_eval_and_p0_are_the_no_dropout_attention(causal):
    q, k, v = qkv(LENGTHS, 4, 2, 8)
    cu, want = offsets(LENGTHS), attention64(q, k, v, LENGTHS, causal)
    plain, _ = ops_attention.flash_attention_forward(q, k, v, cu, 9, causal)
    eval_out, _, rng = ops_attention.flash_attention_forward(q, k, v, cu, 9, causal, 0.0)  # 'p if training else 0.0'
    assert rng is None, "eval mode keeps no rng state"
    torch.testing.assert_close(plain, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(eval_out, plain)


def test_an_eval_module_with_te_s_default_has_no_dropout():
    """eager te.MultiheadAttention with attention_dropout=0.1: eval is deterministic and equals
    attention_dropout=0.0 in training; training differs from it."""
    kwargs = dict(fuse_qkv_params=True, qkv_weight_interleaved=False, qkv_format="thd", params_dtype=torch.float64)
    dropping = eager.MultiheadAttention(64, 4, **kwargs)  # TE's default attention_dropout=0.1
    plain = eager.MultiheadAttention(64, 4, attention_dropout=0.0, **kwargs)
    plain.load_state_dict(dropping.state_dict())
    x = torch.randn(sum(LENGTHS), 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    cu = offsets(LENGTHS)
    want = plain(x, cu_seqlens=cu)
    assert not torch.equal(dropping(x, cu_seqlens=cu), want), "training drops probabilities"
    dropping.eval()
    assert torch.equal(dropping(x, cu_seqlens=cu), want)


# --- (2) float64 training: the documented mask, and grads consistent with the forward --------------

@pytest.mark.parametrize("causal", [True, False])
def test_training_output_is_the_documented_mask_s_attention(causal):
    q, k, v = qkv(LENGTHS, 4, 2, 8, seed=1)
    cu = offsets(LENGTHS)
    torch.manual_seed(11)
    key = torch.randint(-2**63, 2**63 - 1, (1,)).item()  # what the forward draws, reseeded
    torch.manual_seed(11)
    out, _, rng = ops_attention.flash_attention_forward(q, k, v, cu, 9, causal, P)
    assert rng.dtype == torch.int64 and rng.tolist() == [key, 0], "the saved state holds the key drawn"
    keep = documented_keep(key, 4, sum(LENGTHS), P)
    assert 0.8 < keep.double().mean().item() < 0.97, "about 1 - p of the probabilities kept"
    torch.testing.assert_close(out, attention64(q, k, v, LENGTHS, causal, keep, P), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, attention64(q, k, v, LENGTHS, causal), rtol=1e-6, atol=1e-6)


class StagePath(torch.autograd.Function):
    """The generated stage's forward and backward (flash_attention_forward / _backward) as one
    Function: the rng state saved by the forward, read by the backward."""

    @staticmethod
    def forward(ctx, q, k, v, cu, causal, p):
        out, lse, rng = ops_attention.flash_attention_forward(q, k, v, cu, max(LENGTHS), causal, p)
        ctx.save_for_backward(q, k, v, out, lse, rng, cu)
        ctx.causal, ctx.p = causal, p
        return out

    @staticmethod
    def backward(ctx, dy):
        q, k, v, out, lse, rng, cu = ctx.saved_tensors
        dq, dk, dv = ops_attention.flash_attention_backward(dy, out, q, k, v, lse, cu, max(LENGTHS), ctx.causal,
                                                            rng, ctx.p)
        return dq, dk, dv, None, None, None


@pytest.mark.parametrize("causal", [True, False])
def test_stage_backward_is_the_gradient_of_its_forward(causal):
    """gradcheck of the stage's backward against finite differences of its forward, each evaluation
    under the same seed (so the same mask)."""
    q, k, v = (t.requires_grad_() for t in qkv([3, 1, 4], 4, 2, 8, seed=2))
    cu = offsets([3, 1, 4])

    def reseeded(q, k, v):
        torch.manual_seed(5)
        return StagePath.apply(q, k, v, cu, causal, 0.3)

    assert torch.autograd.gradcheck(reseeded, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_module_grads_of_x_and_parameters_under_dropout():
    """eager te.MultiheadAttention (attention_dropout=0.1) in float64 training: gradcheck of x and
    every parameter, torch's generator reseeded before each evaluation."""
    model = eager.MultiheadAttention(32, 4, attention_dropout=P, fuse_qkv_params=True, qkv_weight_interleaved=False,
                                     qkv_format="thd", input_layernorm=True, params_dtype=torch.float64)
    lengths = [3, 1, 4]
    cu = offsets(lengths)
    x = torch.randn(sum(lengths), 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def reseeded(x, *params):  # params: the model's own, which gradcheck perturbs in place
        torch.manual_seed(9)
        return model(x, cu_seqlens=cu)

    inputs = (x.requires_grad_(), *model.parameters())
    assert len(inputs) == 7  # x; the norm's weight and bias; the QKV and output projections' weights and biases
    assert torch.autograd.gradcheck(reseeded, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)
    torch.manual_seed(9)
    assert not torch.equal(reseeded(x), model.eval()(x, cu_seqlens=cu)), "the mask applied"


def _gqa_reference(params, x64, keep=None):
    """specs/te_attention.py's te_gqa_attention in float64: RMSNorm, the QKV projection (TE's
    qkv_weight_interleaved layout: per kv group its 4 q heads, its k head, its v head), attention
    (8 heads sharing 2 kv heads of 32, causal; ``keep``: the dropout mask), the output projection."""
    h = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5) * params["layernorm_qkv.layer_norm_weight"]
    by_group = (h @ params["layernorm_qkv.weight"].T).reshape(x64.shape[0], 2, 6, 32)
    q, k, v = by_group[:, :, :4].reshape(x64.shape[0], 8, 32), by_group[:, :, 4], by_group[:, :, 5]
    return attention64(q, k, v, LENGTHS, True, keep, P) @ params["proj.weight"].T


def test_generated_module_in_eval_is_the_no_dropout_attention_on_cpu():
    import generated
    module = generated.TeGqaAttention().eval()
    params = {k.removeprefix("0."): v.double() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    x = torch.randn(sum(LENGTHS), 256, generator=torch.Generator().manual_seed(6))
    y = module(x, seq_lens=torch.tensor(LENGTHS, dtype=torch.int32))
    assert_close_to_reference("y", y, _gqa_reference(params, x.double()), torch.float32)


def test_generated_module_trains_with_the_documented_mask_on_cpu():
    """The shipped te.MultiheadAttention spec (TE's default attention_dropout=0.1), generated, in
    fp32 training on the CPU: its output is the float64 reference under the documented mask of the
    key it drew; the backward regenerates the same mask (dx against autograd of the reference)."""
    import generated
    module = generated.TeGqaAttention()  # RMSNorm, 8 heads sharing 2 kv heads of 32, no biases, thd
    params = {k.removeprefix("0."): v.detach().double().requires_grad_() for k, v in module.state_dict().items()
              if not k.endswith("_extra_state")}
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(sum(LENGTHS), 256, generator=gen)
    dy = torch.randn(sum(LENGTHS), 256, generator=gen)
    torch.manual_seed(21)
    key = torch.randint(-2**63, 2**63 - 1, (1,)).item()
    torch.manual_seed(21)
    xg = x.clone().requires_grad_()
    y = module(xg, seq_lens=torch.tensor(LENGTHS, dtype=torch.int32))
    y.backward(dy)
    x64 = x.double().requires_grad_()
    want = _gqa_reference(params, x64, documented_keep(key, 8, sum(LENGTHS), P))
    want.backward(dy.double())
    assert_close_to_reference("y", y, want, torch.float32)
    assert_close_to_reference("dx", xg.grad, x64.grad, torch.float32)
    for name, p in module.named_parameters():
        assert_close_to_reference(f"d{name}", p.grad, params[name.removeprefix("0.")].grad, torch.float32)


def test_training_under_torch_compile_fullgraph_on_cpu_keeps_the_mask():
    """torch.compile(fullgraph=True) of the generated module on the CPU in training: the same
    output as uncompiled under the same seed (the key drawn alike), grads finite."""
    import generated
    module = generated.TeGqaAttention()
    x = torch.randn(sum(LENGTHS), 256, generator=torch.Generator().manual_seed(8))
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    torch.manual_seed(3)
    want = module(x, seq_lens=seq_lens)
    compiled = torch.compile(module, fullgraph=True)
    torch.manual_seed(3)
    xg = x.clone().requires_grad_()
    got = compiled(xg, seq_lens=seq_lens)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    assert torch.isfinite(xg.grad).all() and all(torch.isfinite(p.grad).all() for p in module.parameters())
    torch.manual_seed(4)
    assert not torch.equal(compiled(x, seq_lens=seq_lens), want), "another seed, another mask"


# --- (3) statistics: dropout keeps the expectation ------------------------------------------------

def test_mean_over_seeds_approaches_the_no_dropout_output():
    """E[keep / (1 - p)] = 1, so the mean of the outputs over many keys is the output without
    dropout, within 5 standard errors of the samples' own spread."""
    q, k, v = qkv([6, 10], 2, 2, 8, seed=3)
    cu, samples = offsets([6, 10]), []
    for seed in range(400):
        torch.manual_seed(seed)
        samples.append(ops_attention.flash_attention_forward(q, k, v, cu, 10, False, 0.3)[0])
    samples = torch.stack(samples)
    want = attention64(q, k, v, [6, 10], False)
    err = (samples.mean(0) - want).abs()
    stderr = samples.std(0) / math.sqrt(len(samples))
    assert (err <= 5 * stderr + 1e-12).all(), f"max err / stderr {(err / stderr.clamp_min(1e-30)).max():.2f}"
    assert (samples.std(0) > 0).any(), "the samples differ"


# --- (4) CUDA bf16: FlashAttention-2's dropout --------------------------------------------------------

def gap(a, b):
    """max |a - b| relative to max |a|, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()


# FA2's backward adds dq's parts with atomics (PyTorch runs it deterministically only under
# torch.use_deterministic_algorithms), so two runs of one mask agree to its rounding, not bitwise;
# another mask moves the grads by far more (about sqrt(p / (1 - p)) of them)
SAME_MASK, OTHER_MASK = 1e-2, 5e-2


def _cuda_qkv():
    return qkv([40, 7, 64, 1], 4, 2, 64, dtype=torch.bfloat16, device="cuda", seed=7)


@pytest.mark.cuda
def test_flash_eval_equals_reference_and_seeds_decide_the_mask():
    q, k, v = _cuda_qkv()
    lengths = [40, 7, 64, 1]
    cu = offsets(lengths, "cuda")
    out, _, rng = ops_attention.flash_attention_forward(q, k, v, cu, 64, True, 0.0)
    assert rng is None
    want = attention64(q.cpu(), k.cpu(), v.cpu(), lengths, True)
    err, scale = (out.double().cpu() - want).abs().max().item(), want.abs().max().item()
    assert err <= fa2_tolerance(torch.bfloat16, True) * scale, err
    runs = []
    for seed in (1, 1, 2):
        torch.cuda.manual_seed(seed)
        runs.append(ops_attention.flash_attention_forward(q, k, v, cu, 64, True, P))
    assert runs[0][2].dtype == torch.int64 and runs[0][2].shape == (2,)
    assert torch.equal(runs[0][0], runs[1][0]), "same seed, same mask"
    assert not torch.equal(runs[0][0], runs[2][0]), "another seed, another mask"
    assert not torch.equal(runs[0][0], out), "training drops"


@pytest.mark.cuda
def test_flash_training_mean_over_seeds_approaches_eval():
    q, k, v = _cuda_qkv()
    cu = offsets([40, 7, 64, 1], "cuda")
    eval_out = ops_attention.flash_attention_forward(q, k, v, cu, 64, True)[0].double()
    samples = []
    for seed in range(300):
        torch.cuda.manual_seed(seed)
        samples.append(ops_attention.flash_attention_forward(q, k, v, cu, 64, True, P)[0].double())
    samples = torch.stack(samples)
    err = (samples.mean(0) - eval_out).abs()
    bound = 5 * samples.std(0) / math.sqrt(len(samples)) + 2e-2 * eval_out.abs().max()  # + bf16 rounding
    assert (err <= bound).all(), f"max err {err.max():.3e}"


@pytest.mark.cuda
def test_flash_backward_is_finite_and_seed_deterministic():
    q0, k0, v0 = _cuda_qkv()
    cu = offsets([40, 7, 64, 1], "cuda")
    dy = torch.randn(q0.shape[0], q0.shape[1] * q0.shape[2], device="cuda").to(torch.bfloat16)
    grads = []
    for seed in (3, 3, 4):
        torch.cuda.manual_seed(seed)
        out, lse, rng = ops_attention.flash_attention_forward(q0, k0, v0, cu, 64, True, P)
        grads.append(ops_attention.flash_attention_backward(dy, out, q0, k0, v0, lse, cu, 64, True, rng, P))
    assert all(torch.isfinite(g).all() for g in grads[0])
    assert all(gap(a, b) <= SAME_MASK for a, b in zip(grads[0], grads[1])), "same seed, same grads"
    assert all(gap(a, b) > OTHER_MASK for a, b in zip(grads[0], grads[2])), "another seed, another mask"
    plain = ops_attention.flash_attention_backward(dy, out, q0, k0, v0, lse, cu, 64, True)
    assert gap(plain[2], grads[2][2]) > OTHER_MASK, "the backward applies the forward's mask"


@pytest.mark.cuda
def test_cuda_graph_replay_draws_a_fresh_mask_each_replay():
    q, k, v = _cuda_qkv()
    cu = offsets([40, 7, 64, 1], "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture
        ops_attention.flash_attention_forward(q, k, v, cu, 64, True, P)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _, rng = ops_attention.flash_attention_forward(q, k, v, cu, 64, True, P)
    torch.cuda.manual_seed(5)
    graph.replay()
    first, first_rng = out.clone(), rng.clone()
    graph.replay()
    assert not torch.equal(out, first), "a replay draws a fresh mask"
    assert not torch.equal(rng, first_rng), "and saves its own rng state"
    torch.cuda.manual_seed(5)
    graph.replay()
    assert torch.equal(out, first), "the same seed replays the same mask"


@pytest.mark.cuda
def test_te_multihead_attention_with_te_s_default_dropout_trains_on_cuda():
    """The shipped te.MultiheadAttention(256, 4, ...) spec with TE's default attention_dropout: in
    training at a few rows (CUDA graphs) and compiled, masks fresh each call and the same under
    the same seed, grads finite; eval deterministic."""
    import generated
    module = generated.TeGptAttention(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 16, 256, device="cuda").to(torch.bfloat16)

    def step(m, seed):
        torch.manual_seed(seed)
        xg = x.clone().requires_grad_()
        y = m(xg)
        y.float().square().mean().backward()
        grads = [xg.grad.clone()] + [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        return y.detach(), grads

    for m in (module, torch.compile(module)):
        for _ in range(3):  # warm-up: a few rows' graphs are captured at a shape's second call
            step(m, 0)
        (y1, g1), (y2, g2), (y3, g3) = step(m, 1), step(m, 1), step(m, 2)
        assert torch.equal(y1, y2) and all(gap(a, b) <= SAME_MASK for a, b in zip(g1, g2)), "same seed, same mask"
        assert gap(y1, y3) > OTHER_MASK and gap(g1[0], g3[0]) > OTHER_MASK, "another seed, another mask"
        assert all(torch.isfinite(g).all() for g in g1)
    module.eval()
    with torch.no_grad():
        assert torch.equal(module(x), module(x))
