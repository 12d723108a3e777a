"""The attention prep kernels (stages/attention/, templates/cuda/attention_prep.cuh) of the
shipped attention specs, through their launchers in generated/_kernels.py, against float64
references written here: the forward's, from the fused QKV projection to one buffer [rows, heads +
2 kv_heads, d] of rotary(q), rotary(k), v; the backward's, from dq, dk, dv to the projection's
grad (the rotary's transpose of dq and dk, dv copied; a plain copy without rotary).

On CPU the launchers run the shipped reference math (float64 angles, the op's oracle); on CUDA the
kernels, whose angle is defined as fp32(position * fp32(base^(-2i/d))) (the reference below
computes it so, then cos, sin and the rotation in float64), each output rounded once from fp32:
TE's single-op tolerances. Positions restart at each packed sequence: lengths 1, 2, odd, long and
0, up to 16,384 rows, and one sequence long enough that angles pass 10^5 radians (sincosf's slow
path)."""

from __future__ import annotations

import pytest
import torch


HEADS = {  # kernel family members of the shipped specs: (heads, kv_heads, head_dim, rotary_base)
    "qkv_prep_rope10000_fwd_h4_kv2_d64": (4, 2, 64, 10000.0),  # specs/attention_block.py
    "qkv_prep_rope10000_fwd_h4_kv1_d64": (4, 1, 64, 10000.0),  # mqa_block
    "qkv_prep_rope500000_fwd_h32_kv8_d128": (32, 8, 128, 500000.0),  # specs/llama_layer.py
}
BACKWARD = {  # the backward kernels: the same, and the MHA block's (no rotary: a copy)
    **{name.replace("_fwd_", "_bwd_"): shape for name, shape in HEADS.items()},
    "qkv_prep_bwd_h4_kv4_d64": (4, 4, 64, None),  # mha_block
}
# TE's single-op tolerances (rtol, atol)
TOLS = {torch.float32: (1.3e-6, 1e-5), torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
BATCHES = [[1, 2, 7, 0, 33], [1], [5, 0, 0, 12], [300, 1, 2, 77]]  # lengths 1, 2, odd, long, 0


def K():
    from generated import _kernels

    return _kernels


def offsets(lengths, device="cpu"):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


def rotary64(heads, lengths, base, inverse, fp32_angles):
    """Rotate-half of heads [rows, n, d] (float64) at each row's position in its sequence, the
    angle's sign flipped for the transpose. fp32_angles: angle = fp32(pos * fp32(base^(-2i/d)))
    (the CUDA kernels' definition); else all float64 (the op's oracle)."""
    d = heads.shape[-1]
    position = torch.cat([torch.arange(n, dtype=torch.float64) for n in lengths] or [torch.zeros(0)])
    inv_freq = torch.tensor(base, dtype=torch.float64) ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if fp32_angles:
        angle = (position.float()[:, None] * inv_freq.float()[None, :]).double()
    else:
        angle = position[:, None] * inv_freq[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    if inverse:
        sin = -sin
    a, b = heads[..., : d // 2], heads[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def prep64(x, lengths, shape, inverse, fp32_angles):
    """[rows, H + 2K, d] in float64: rotary (or its transpose) of the first H + K heads, the rest as they are."""
    heads, kv_heads, d, base = shape
    h = x.double().reshape(x.shape[0], heads + 2 * kv_heads, d)
    if base is None:
        return h
    rotated = rotary64(h[:, : heads + kv_heads], lengths, base, inverse, fp32_angles)
    return torch.cat([rotated, h[:, heads + kv_heads:]], dim=1)


def backward_inputs(rows, shape, dtype, gen, device):
    heads, kv_heads, d, _ = shape
    dqkv = torch.randn(rows, heads + 2 * kv_heads, d, generator=gen).to(device=device, dtype=dtype)
    dq, dk, dv = (t.contiguous() for t in dqkv.split([heads, kv_heads, kv_heads], dim=1))
    return dqkv, dq, dk, dv


# --- CPU: the launchers' reference path ---------------------------------------------------------

@pytest.mark.parametrize("name", sorted(HEADS))
def test_forward_launcher_on_cpu_runs_the_reference_math(name):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d, _ = shape = HEADS[name]
    lengths = [1, 2, 7, 0, 20]
    x = torch.randn(sum(lengths), (heads + 2 * kv_heads) * d, generator=gen)
    out = getattr(K(), name)(x, offsets(lengths))
    assert out.shape == (sum(lengths), heads + 2 * kv_heads, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), prep64(x, lengths, shape, False, False), rtol=1.3e-6, atol=1e-5)
    assert torch.equal(out[:, heads + kv_heads:], x.reshape(out.shape)[:, heads + kv_heads:])  # v: a copy


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_launcher_on_cpu_runs_the_reference_math(name):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d, _ = shape = BACKWARD[name]
    lengths = [3, 0, 1, 12]
    dqkv, dq, dk, dv = backward_inputs(sum(lengths), shape, torch.float32, gen, "cpu")
    dx = getattr(K(), name)(dq, dk, dv, offsets(lengths))
    assert dx.shape == (sum(lengths), (heads + 2 * kv_heads) * d) and dx.dtype == torch.float32
    want = prep64(dqkv, lengths, shape, True, False).reshape(dx.shape)
    torch.testing.assert_close(dx.double(), want, rtol=1.3e-6, atol=1e-5)


def test_the_forward_and_backward_are_transposes():
    """<prep(x), g> = <x, prep_bwd(g)>: the backward is the forward's transpose (float64 math)."""
    gen = torch.Generator().manual_seed(3)
    name = "qkv_prep_rope10000_fwd_h4_kv2_d64"
    lengths, shape = [5, 9], HEADS[name]
    x = torch.randn(14, 8 * 64, generator=gen, dtype=torch.float64)
    g, dq, dk, dv = backward_inputs(14, shape, torch.float64, gen, "cpu")
    forward = getattr(K(), name)(x, offsets(lengths))
    backward = getattr(K(), name.replace("_fwd_", "_bwd_"))(dq, dk, dv, offsets(lengths))
    torch.testing.assert_close((forward * g).sum(), (x * backward).sum(), rtol=1e-12, atol=1e-12)


# --- CUDA: the kernels --------------------------------------------------------------------------

NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def poison():
    """NaN in the caching allocator's free memory, so an unwritten output element shows up."""
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    block = torch.full((int(min(free * 0.5, 2 << 30)) // 4,), float("nan"), device="cuda")
    del block


def check(name, got, want, dtype):
    rtol, atol = TOLS[dtype]
    assert torch.isfinite(got.float()).all(), f"{name}: non-finite values (an unwritten output?)"
    torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("lengths", BATCHES + [[16384 - 3778 - 1, 3778, 1]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_forward_kernel_matches_float64(name, dtype, lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + 5)
    heads, kv_heads, d, _ = shape = HEADS[name]
    width = (heads + 2 * kv_heads) * d
    x = torch.randn(sum(lengths), width, generator=gen).to(dtype)
    poison()
    out = getattr(K(), name)(x.cuda(), offsets(lengths, "cuda"))
    assert out.shape == (sum(lengths), heads + 2 * kv_heads, d) and out.dtype == dtype and out.is_contiguous()
    check(name, out, prep64(x, lengths, shape, False, True), dtype)
    v = out[:, heads + kv_heads:].cpu()
    assert torch.equal(v, x.reshape(out.shape)[:, heads + kv_heads:]), "v is copied bit for bit"


@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("lengths", BATCHES + [[16384 - 3778 - 1, 3778, 1]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_kernel_matches_float64(name, dtype, lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + 6)
    heads, kv_heads, d, _ = shape = BACKWARD[name]
    dqkv, dq, dk, dv = backward_inputs(sum(lengths), shape, dtype, gen, "cpu")
    poison()
    dx = getattr(K(), name)(dq.cuda(), dk.cuda(), dv.cuda(), offsets(lengths, "cuda"))
    assert dx.shape == (sum(lengths), (heads + 2 * kv_heads) * d) and dx.dtype == dtype
    check(name, dx, prep64(dqkv, lengths, shape, True, True).reshape(dx.shape), dtype)


@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_kernel_reads_a_row_strided_projection(dtype):
    """x with a row stride wider than its row (a slice of a wider tensor), and one whose rows are
    not 16-byte aligned (the launcher copies it first)."""
    gen = torch.Generator().manual_seed(8)
    name = "qkv_prep_rope10000_fwd_h4_kv2_d64"
    lengths, shape = [3, 40, 1], HEADS[name]
    wide = torch.randn(44, 8 * 64 + 24, generator=gen).to(dtype)
    for x in (wide[:, :512], wide[:, 3:515]):
        out = getattr(K(), name)(x.cuda(), offsets(lengths, "cuda"))
        check(name, out, prep64(x, lengths, shape, False, True), dtype)


@pytest.mark.cuda
@NEEDS_GPU
def test_angles_past_sincosfs_fast_range():
    """Positions up to 120,000 (angles past 10^5 radians, where sincosf takes its slow path): fp32,
    the MQA block's kernels both ways, one long sequence then a short one."""
    gen = torch.Generator().manual_seed(9)
    name = "qkv_prep_rope10000_fwd_h4_kv1_d64"
    lengths, shape = [120_000, 3], HEADS[name]
    x = torch.randn(sum(lengths), 6 * 64, generator=gen)
    out = getattr(K(), name)(x.cuda(), offsets(lengths, "cuda"))
    check(name, out, prep64(x, lengths, shape, False, True), torch.float32)
    g, dq, dk, dv = backward_inputs(sum(lengths), shape, torch.float32, gen, "cpu")
    back = name.replace("_fwd_", "_bwd_")
    dx = getattr(K(), back)(dq.cuda(), dk.cuda(), dv.cuda(), offsets(lengths, "cuda"))
    check(back, dx, prep64(g, lengths, shape, True, True).reshape(dx.shape), torch.float32)
