"""The self-attention ops (generator/ops/attention.py): their reference math, the eager modules and
the shipped FA2 path against a float64 reference written here, independently: attention over the
whole packed batch at once with an explicit [total, total] mask (same sequence, and causal),
rotary as complex rotation of the pairs (x_i, x_{i + d/2}), grads by autograd through it."""

from __future__ import annotations

import math

import pytest
import torch

from fusegen import eager
from fusegen.ops import OPS
from fusegen.ops import attention as ops_attention

# (op, hidden, heads, kv_heads given to the op or None, the kv heads it has)
OPS_UNDER_TEST = [
    ("MultiHeadedSelfAttention", 64, 4, None, 4),
    ("GroupedQueryAttention", 128, 8, 2, 2),
    ("MultiQuerySelfAttention", 64, 4, None, 1),
]
# packed batches: lengths 1, 2, odd and long (and one of a single long sequence)
LENGTHS = [[1, 2, 7, 33], [1], [2, 1, 1, 40], [65]]


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def rotary64(t, positions, base):
    """Rotate-half rotary on t [total, heads, d] as complex rotation: pair (t_i, t_{i+d/2}) times
    exp(1j * pos * base^(-2i/d))."""
    d = t.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(t[..., : d // 2], t[..., d // 2:]) * torch.polar(
        torch.ones(len(positions), d // 2, dtype=torch.float64), positions[:, None] * theta[None, :])[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


def attention64(x, lengths, heads, kv_heads, causal, rotary_base):
    """The float64 reference: [total, (heads + 2 kv) d] -> [total, heads d]."""
    total, d = x.shape[0], x.shape[1] // (heads + 2 * kv_heads)
    q = x[:, : heads * d].reshape(total, heads, d)
    k = x[:, heads * d:(heads + kv_heads) * d].reshape(total, kv_heads, d)
    v = x[:, (heads + kv_heads) * d:].reshape(total, kv_heads, d)
    sequence = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths])
    if rotary_base is not None:
        q, k = rotary64(q, positions, rotary_base), rotary64(k, positions, rotary_base)
    allowed = sequence[:, None] == sequence[None, :]
    if causal:
        allowed &= torch.arange(total)[:, None] >= torch.arange(total)[None, :]
    out = []
    for h in range(heads):
        kv = h * kv_heads // heads
        scores = q[:, h] @ k[:, kv].T / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.softmax(scores, dim=-1) @ v[:, kv])
    return torch.stack(out, dim=1).reshape(total, heads * d)


def make_args(name, hidden, heads, kv, causal, rotary):
    positional = (hidden, heads) if kv is None else (hidden, heads, kv)
    keywords = dict(attn_mask_type="causal" if causal else "no_mask", rotary_base=rotary)
    return positional, keywords


@pytest.mark.parametrize("name,hidden,heads,kv,kv_heads", OPS_UNDER_TEST)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rotary", [None, 10000.0])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_reference_math_matches_float64(name, hidden, heads, kv, kv_heads, causal, rotary, lengths):
    """The op's shipped reference forward and backward, with explicit cu_seqlens, against autograd
    through the independent reference."""
    gen = torch.Generator().manual_seed(hash((name, causal, rotary, len(lengths))) % 2**31)
    width = (heads + 2 * kv_heads) * (hidden // heads)
    x = torch.randn(sum(lengths), width, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(sum(lengths), hidden, generator=gen, dtype=torch.float64)
    ref = attention64(x, lengths, heads, kv_heads, causal, rotary)
    (dx_ref,) = torch.autograd.grad(ref, x, dy)

    positional, keywords = make_args(name, hidden, heads, kv, causal, rotary)
    module = getattr(eager, name)(*positional, **keywords)
    op = OPS[name]
    forward, backward = op.reference
    constants = op.reference_arguments(module.args)
    assert constants == (heads, kv_heads, causal, rotary, 0.0)  # no dropout
    y = forward(x.detach(), offsets(lengths), *constants)
    dx = backward(x.detach(), dy, offsets(lengths), *constants)
    torch.testing.assert_close(y, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name,hidden,heads,kv,kv_heads", OPS_UNDER_TEST)
@pytest.mark.parametrize("causal", [True, False])
def test_eager_module_packed_one_sequence_and_3d(name, hidden, heads, kv, kv_heads, causal):
    """fusegen.eager's modules in fp32: packed (cu_seqlens given), one 2-D sequence, and a 3-D batch
    (batch-major: batch sequences of seq tokens); outputs and grads of x against float64 at fp32's
    tolerance."""
    gen = torch.Generator().manual_seed(7)
    positional, keywords = make_args(name, hidden, heads, kv, causal, 500000.0)
    module = getattr(eager, name)(*positional, **keywords)
    width = (heads + 2 * kv_heads) * (hidden // heads)
    cases = [([1, 2, 5, 17], None), ([9], None), ([6, 6, 6], (3, 6))]
    for lengths, shape3d in cases:
        x64 = torch.randn(sum(lengths), width, generator=gen, dtype=torch.float64, requires_grad=True)
        dy64 = torch.randn(sum(lengths), hidden, generator=gen, dtype=torch.float64)
        ref = attention64(x64, lengths, heads, kv_heads, causal, 500000.0)
        (dx_ref,) = torch.autograd.grad(ref, x64, dy64)
        x = x64.detach().float().requires_grad_()
        if shape3d is not None:
            y = module(x.reshape(*shape3d, width)).reshape(-1, hidden)
        elif len(lengths) > 1:
            y = module(x, cu_seqlens=offsets(lengths))
        else:
            y = module(x)
        y.backward(dy64.float())
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref.detach(), rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(x.grad.double(), dx_ref, rtol=1.3e-6, atol=1e-5)


def test_eager_sequential_runs_attention_between_linears():
    """The op in fusegen.eager's Sequential, as the issue's layer has it (3-D input: sequences)."""
    torch.manual_seed(0)
    model = eager.Sequential(eager.Linear(32, 64, bias=False), eager.GroupedQueryAttention(32, 4, 2),
                             eager.Linear(32, 32, bias=False))
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    model = model.double()
    w1, w2 = model[0].weight, model[2].weight
    ref = torch.stack([attention64(x[b] @ w1.T, [5], 4, 2, True, None) for b in range(2)]) @ w2.T
    torch.testing.assert_close(model(x), ref, rtol=1e-12, atol=1e-12)


def stage_path(x, dy, cu, max_seqlen, heads, kv_heads, causal, rotary_base):
    """What the generated stage runs, with the prep kernels' math done by the shipped helpers in
    fp32 (their CPU launchers' math): one buffer of q, k, v in x's dtype, q, k, v views of it,
    flash_attention_forward / flash_attention_backward, the backward prep. Returns y, dx and what
    the forward returned besides y."""
    q, k, v = ops_attention.attention_inputs(x.float(), cu, heads, kv_heads, rotary_base)
    q, k, v = torch.cat([q, k, v], dim=1).to(x.dtype).split([heads, kv_heads, kv_heads], dim=1)
    y, lse = ops_attention.flash_attention_forward(q, k, v, cu, max_seqlen, causal)
    # the log-sum-exp in FA2's layout on every path (a torch.compile op's fake runs the reference)
    assert lse.shape == (heads, x.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
    dq, dk, dv = ops_attention.flash_attention_backward(dy, y, q, k, v, lse, cu, max_seqlen, causal)
    assert dq.dtype == dk.dtype == dv.dtype == x.dtype
    dx = ops_attention.attention_inputs_bwd(dq.float(), dk.float(), dv.float(), cu, rotary_base).to(x.dtype)
    return y, dx, (q, lse)


def test_reference_path_of_the_stage_helpers_matches_float64():
    """flash_attention_forward / flash_attention_backward (what the generated stage calls) off FA2
    (CPU), between the prep kernels' math: y, and dx from what the forward returned."""
    gen = torch.Generator().manual_seed(3)
    lengths, heads, kv_heads = [3, 1, 12], 4, 2
    x = torch.randn(16, (heads + 2 * kv_heads) * 16, generator=gen, dtype=torch.float32)
    dy = torch.randn(16, heads * 16, generator=gen, dtype=torch.float32)
    x64 = x.double().requires_grad_()
    ref = attention64(x64, lengths, heads, kv_heads, True, 10000.0)
    (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
    y, dx, (q, lse) = stage_path(x, dy, offsets(lengths), 12, heads, kv_heads, True, 10000.0)
    assert q.dtype == torch.float32 and lse.shape == (heads, 16)
    assert y.dtype == dx.dtype == torch.float32
    # q, k, v rounded to fp32 before the attention (as FA2 takes them): a few fp32 roundings
    torch.testing.assert_close(y.double(), ref.detach(), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1.3e-6, atol=1e-5)


def test_empty_sequence_contributes_nothing():
    x = torch.randn(4, 3 * 8, dtype=torch.float64)
    y = ops_attention.self_attention(x, torch.tensor([0, 2, 2, 4], dtype=torch.int32), 1, 1, True, None)
    torch.testing.assert_close(y, attention64(x, [2, 2], 1, 1, True, None), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call,problem", [
    (lambda: eager.MultiHeadedSelfAttention(100, 8), "heads=8 must divide hidden=100"),
    (lambda: eager.GroupedQueryAttention(128, 8, 3), "kv_heads=3 must divide heads=8"),
    (lambda: eager.MultiHeadedSelfAttention(8 * 18, 8, rotary_base=10000.0), None),
    (lambda: eager.MultiHeadedSelfAttention(4 * 9, 4, rotary_base=10000.0), "head_dim = hidden / heads = 9 must be even"),
    (lambda: eager.MultiHeadedSelfAttention(4 * 12, 4), "multiples of 8 up to 256"),
    (lambda: eager.MultiHeadedSelfAttention(2 * 512, 2), "multiples of 8 up to 256"),
    (lambda: eager.MultiHeadedSelfAttention(64, 4, attn_mask_type="padding"), "must be one of 'causal', 'no_mask'"),
    (lambda: eager.MultiHeadedSelfAttention(64, 4, "FusedAttention"), "must be te.DotProductAttention"),
    (lambda: eager.MultiHeadedSelfAttention(64, 4, rotary_base=0.5), "must be a finite number above 1"),
    (lambda: eager.GroupedQueryAttention(64, 4, 0), "must be positive"),
])
def test_bad_arguments_are_refused_with_the_reason(call, problem):
    if problem is None:  # head_dim 18: even but not a multiple of 8
        problem = "head_dim = hidden / heads = 18"
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        call()


def test_backend_may_be_named_or_left_out():
    assert eager.GroupedQueryAttention(64, 4, 2, "DotProductAttention").args["backend"] == "DotProductAttention"
    assert eager.GroupedQueryAttention(64, 4, 2).args["backend"] == "DotProductAttention"


# --- the FA2 path: CUDA only (the lead runs these on an H100) ---------------------------------------

# Transformer Engine's own attention tests (tests/pytorch/attention/run_attention_with_cp.py, ``get_tols``):
# bf16 atol = rtol = 2.5e-2 where kv heads = heads, 3.5e-2 with fewer (GQA); fp16 atol = rtol = 5e-3.
def fa2_tolerance(dtype, grouped):
    if dtype == torch.bfloat16:
        return 3.5e-2 if grouped else 2.5e-2
    return 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,hidden,heads,kv,kv_heads", [
    ("MultiHeadedSelfAttention", 512, 4, None, 4), ("GroupedQueryAttention", 1024, 8, 2, 2),
    ("MultiQuerySelfAttention", 256, 4, None, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_path_matches_float64(dtype, name, hidden, heads, kv, kv_heads, causal):
    """flash_attention_forward / flash_attention_backward on CUDA 16-bit: PyTorch's FA2 varlen
    kernels on q, k, v that are views of one buffer (as the prep kernel writes it), rotary and
    split by torch ops here; against float64 at TE's attention tolerances."""
    gen = torch.Generator().manual_seed(11)
    lengths = [1, 2, 37, 300, 5]
    width = (heads + 2 * kv_heads) * (hidden // heads)
    x = torch.randn(sum(lengths), width, generator=gen).to(dtype)
    dy = torch.randn(sum(lengths), hidden, generator=gen).to(dtype)
    x64 = x.double().requires_grad_()
    ref = attention64(x64, lengths, heads, kv_heads, causal, 10000.0)
    (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
    cu = offsets(lengths).cuda()
    y, dx, (q, lse) = stage_path(x.cuda(), dy.cuda(), cu, max(lengths), heads, kv_heads, causal, 10000.0)
    assert ops_attention.attention_on_flash(q) and not q.is_contiguous(), "a CUDA 16-bit input runs on FA2, q a view"
    assert y.dtype == dx.dtype == dtype
    tol = fa2_tolerance(dtype, kv_heads != heads)
    torch.testing.assert_close(y.cpu().double(), ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(dx.cpu().double(), dx_ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("call,col,problem", [
    ("te.GroupedQueryAttention(64, 4, 3)", 36, "kv_heads=3 must divide heads=4"),
    ("te.MultiHeadedSelfAttention(100, 8)", 36, "heads=8 must divide hidden=100"),
    ("te.MultiHeadedSelfAttention(36, 4, rotary_base=1e4)", 36, "head_dim = hidden / heads = 9 must be even"),
    ("te.MultiQuerySelfAttention(4 * 264, 4)", 36, "multiples of 8 up to 256"),
    ("te.MultiQuerySelfAttention(64, 4, attn_mask_type='padding')", 85, "'attn_mask_type' of MultiQuerySelfAttention "
                                                                        "must be one of 'causal', 'no_mask'"),
    ("te.MultiHeadedSelfAttention(64, 4, 'FlashAttention')", 71, "must be te.DotProductAttention"),
])
def test_spec_errors_at_the_call(call, col, problem):
    """Build-time checks in a spec: SpecErrors at file:line:col of the call (or the argument)."""
    from fusegen.errors import SpecError
    from fusegen.frontend import parse_spec

    text = f"from transformer_engine.pytorch import ops as te\nm = te.Sequential(te.Linear(8, 8), {call})\n"
    with pytest.raises(SpecError) as err:
        parse_spec(text, "s.py")
    assert (err.value.location.line, err.value.location.col) == (2, col)
    assert problem in err.value.message


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eager_module_on_cuda_matches_float64(dtype):
    """fusegen.eager's module on CUDA (the reference math in fp32, one rounding): packed sequences."""
    gen = torch.Generator().manual_seed(5)
    lengths = [1, 2, 9, 130]
    module = eager.GroupedQueryAttention(256, 4, 2, rotary_base=10000.0)
    x = torch.randn(sum(lengths), 512, generator=gen).to(dtype)
    dy = torch.randn(sum(lengths), 256, generator=gen).to(dtype)
    x64 = x.double().requires_grad_()
    ref = attention64(x64, lengths, 4, 2, True, 10000.0)
    (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
    xc = x.cuda().requires_grad_()
    y = module(xc, cu_seqlens=offsets(lengths).cuda())
    y.backward(dy.cuda())
    # one rounding of an fp32 result: TE's single-op tolerances
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(y.detach().cpu().double(), ref.detach(), **tol)
    torch.testing.assert_close(xc.grad.cpu().double(), dx_ref, **tol)


RAN = []  # the stood-in FA2 kernels that ran


def fake_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
    """FA2 varlen's contract, on the CPU in float64 (so the glue around it is tested without a GPU):
    out [total, heads, d] in q's dtype, the log-sum-exp [heads, total] in fp32, rng state, unused."""
    assert q.dtype == k.dtype == v.dtype and cu_q.dtype == cu_k.dtype == torch.int32 and q.stride(-1) == 1
    assert dropout_p == 0.0 and not return_debug_mask and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    RAN.append("forward")
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    assert scale == pytest.approx(1 / math.sqrt(d))
    x = torch.cat([q, k, v], dim=1).reshape(q.shape[0], -1).double()
    out = attention64(x, lengths, heads, kv_heads, is_causal, None).reshape(q.shape)
    return out.to(q.dtype), torch.zeros(heads, q.shape[0]), torch.zeros(2, dtype=torch.int64), torch.empty(0), None


def fake_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                        scale=None):
    assert dout.shape == out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and rng_state.shape == (2,)
    assert rng_state.device == q.device and unused.numel() == 0  # dropout 0: placeholders, as varlen_attn's
    RAN.append("backward")
    lengths = (cu_q[1:] - cu_q[:-1]).tolist()
    heads, kv_heads = q.shape[1], k.shape[1]
    x = torch.cat([q, k, v], dim=1).reshape(q.shape[0], -1).double().requires_grad_()
    y = attention64(x, lengths, heads, kv_heads, is_causal, None)
    (dx,) = torch.autograd.grad(y, x, dout.reshape(y.shape).double())
    dq, dk, dv = dx.reshape(q.shape[0], heads + 2 * kv_heads, -1).split([heads, kv_heads, kv_heads], dim=1)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_flash_path_glue_around_the_kernels(monkeypatch, causal):
    """flash_attention_forward / flash_attention_backward on the FA2 path with FA2 stood in for by
    its contract on the CPU: q, k, v views of one buffer, the layouts, the dtype and the arguments
    the kernels get (bf16 inputs; float64 reference at bf16's attention tolerance)."""
    class FakeAten:
        _flash_attention_forward = staticmethod(fake_flash_forward)
        _flash_attention_backward = staticmethod(fake_flash_backward)

    class FakeOps:
        aten = FakeAten

    monkeypatch.setattr(ops_attention, "attention_on_flash", lambda x: True)
    monkeypatch.setattr(ops_attention.torch, "ops", FakeOps, raising=False)
    gen = torch.Generator().manual_seed(13)
    lengths, heads, kv_heads = [1, 2, 7, 20], 4, 2
    x = torch.randn(sum(lengths), (heads + 2 * kv_heads) * 16, generator=gen).to(torch.bfloat16)
    dy = torch.randn(sum(lengths), heads * 16, generator=gen).to(torch.bfloat16)
    x64 = x.double().requires_grad_()
    ref = attention64(x64, lengths, heads, kv_heads, causal, 10000.0)
    (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
    RAN.clear()
    y, dx, (q, lse) = stage_path(x, dy, offsets(lengths), 20, heads, kv_heads, causal, 10000.0)
    assert RAN == ["forward", "backward"] and lse.shape == (heads, sum(lengths)), "the (stood-in) FA2 kernels ran"
    assert y.dtype == dx.dtype == q.dtype == torch.bfloat16 and y.shape == (sum(lengths), heads * 16)
    torch.testing.assert_close(y.double(), ref.detach(), rtol=2.5e-2, atol=2.5e-2)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=3.5e-2, atol=3.5e-2)
