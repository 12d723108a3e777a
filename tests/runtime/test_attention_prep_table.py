"""The attention prep kernels' table variant (templates/cuda/attention_prep_table.cuh: rotary by
TE's per-call table, forward(rotary_pos_emb=...)) of the shipped TE attention specs, through their
launchers in generated/_kernels.py, against float64 references written here from TE's rope math
(attention/rope.py apply_rotary_pos_emb, non-interleaved): the first half of a head [a | b] turns
by table[pos, i], the second by table[pos, i + d/2], which a general table makes different, so
every test here uses one whose halves differ; the backward is the transpose of that linear map,
written as its matrix's transpose (not as a rotation by a negated angle, which it is not then).

On CPU the launchers run the shipped reference math; on CUDA the kernels, whose angles are the
table's fp32 values, cos and sin in fp32 and each output rounded once: TE's single-op tolerances.
Positions restart at each packed sequence; a position beyond the table's rows reads its last row
(the kernels clamp; the module's check refuses such a call first)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.test_attention_prep import (BATCHES, DTYPE_IDS, DTYPES, K, NEEDS_GPU, backward_inputs, check,
                                               offsets, poison)

SHAPES = {  # the table variants of the shipped TE attention specs: (heads, kv_heads, head_dim)
    "qkv_prep_table_fwd_h4_kv4_d64": (4, 4, 64),  # specs/te_attention.py te_gpt_attention, gpt_stack
    "qkv_prep_table_fwd_h8_kv2_d32": (8, 2, 32),  # te_gqa_attention, te_llama_layer
    "qkv_prep_table_fwd_h8_kv1_d32": (8, 1, 32),  # specs/te_models.py's stacks
}
BACKWARD = {name.replace("_fwd_", "_bwd_"): shape for name, shape in SHAPES.items()}


def general_table(rows, d, gen):
    """A float32 [rows, d] table whose two halves differ (TE's own repeat them), angles up to ~300."""
    return (torch.randn(rows, d, generator=gen) * 100).float()


def positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths] or [torch.zeros(0, dtype=torch.int64)]).long()


def turn64(heads, table, lengths, transpose):
    """TE's rotate-half with a general table on heads [rows, n, d], float64: y1 = a cos t1 - b sin t1,
    y2 = b cos t2 + a sin t2 (t1 = table[pos, :d/2], t2 = table[pos, d/2:]), as the matrix [[c1,
    -s1], [s2, c2]] per pair; ``transpose``: its transpose [[c1, s2], [-s1, c2]]."""
    d = heads.shape[-1]
    rows = table.double()[positions(lengths).clamp(max=table.shape[0] - 1)]
    c1, s1 = rows[:, None, : d // 2].cos(), rows[:, None, : d // 2].sin()
    c2, s2 = rows[:, None, d // 2:].cos(), rows[:, None, d // 2:].sin()
    m = [[c1, -s1], [s2, c2]]
    if transpose:
        m = [[m[0][0], m[1][0]], [m[0][1], m[1][1]]]
    a, b = heads[..., : d // 2], heads[..., d // 2:]
    return torch.cat([m[0][0] * a + m[0][1] * b, m[1][0] * a + m[1][1] * b], dim=-1)


def prep64(x, lengths, shape, table, transpose):
    heads, kv_heads, d = shape
    h = x.double().reshape(x.shape[0], heads + 2 * kv_heads, d)
    return torch.cat([turn64(h[:, : heads + kv_heads], table, lengths, transpose), h[:, heads + kv_heads:]], dim=1)


# --- CPU: the launchers' reference path ---------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SHAPES))
def test_forward_launcher_on_cpu_runs_the_reference_math(name):
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, d = shape = SHAPES[name]
    lengths, table = [1, 2, 7, 0, 20], general_table(20, d, gen)
    x = torch.randn(sum(lengths), (heads + 2 * kv_heads) * d, generator=gen)
    out = getattr(K(), name)(x, offsets(lengths), table)
    assert out.shape == (sum(lengths), heads + 2 * kv_heads, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), prep64(x, lengths, shape, table, False), rtol=1.3e-6, atol=1e-5)
    assert torch.equal(out[:, heads + kv_heads:], x.reshape(out.shape)[:, heads + kv_heads:])  # v: a copy


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_launcher_on_cpu_runs_the_reference_math(name):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d = shape = BACKWARD[name]
    lengths, table = [3, 0, 1, 12], general_table(12, d, gen)
    dqkv, dq, dk, dv = backward_inputs(sum(lengths), (*shape, None), torch.float32, gen, "cpu")
    dx = getattr(K(), name)(dq, dk, dv, offsets(lengths), table)
    assert dx.shape == (sum(lengths), (heads + 2 * kv_heads) * d) and dx.dtype == torch.float32
    want = prep64(dqkv, lengths, shape, table, True).reshape(dx.shape)
    torch.testing.assert_close(dx.double(), want, rtol=1.3e-6, atol=1e-5)


def test_the_forward_and_backward_are_transposes_for_a_general_table():
    """<prep(x), g> = <x, prep_bwd(g)> in float64 with unequal halves' angles."""
    gen = torch.Generator().manual_seed(3)
    name = "qkv_prep_table_fwd_h8_kv2_d32"
    lengths, table = [5, 9], general_table(9, 32, gen).double()
    x = torch.randn(14, 12 * 32, generator=gen, dtype=torch.float64)
    g, dq, dk, dv = backward_inputs(14, (8, 2, 32, None), torch.float64, gen, "cpu")
    forward = getattr(K(), name)(x, offsets(lengths), table)
    backward = getattr(K(), name.replace("_fwd_", "_bwd_"))(dq, dk, dv, offsets(lengths), table)
    torch.testing.assert_close((forward * g).sum(), (x * backward).sum(), rtol=1e-12, atol=1e-12)


# --- CUDA: the kernels --------------------------------------------------------------------------

@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("lengths", BATCHES + [[16384 - 3778 - 1, 3778, 1]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_forward_kernel_matches_float64(name, dtype, lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + 5)
    heads, kv_heads, d = shape = SHAPES[name]
    table = general_table(max(lengths), d, gen)
    x = torch.randn(sum(lengths), (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    poison()
    out = getattr(K(), name)(x.cuda(), offsets(lengths, "cuda"), table.cuda())
    assert out.shape == (sum(lengths), heads + 2 * kv_heads, d) and out.dtype == dtype and out.is_contiguous()
    check(name, out, prep64(x, lengths, shape, table, False), dtype)
    v = out[:, heads + kv_heads:].cpu()
    assert torch.equal(v, x.reshape(out.shape)[:, heads + kv_heads:]), "v is copied bit for bit"


@pytest.mark.cuda
@NEEDS_GPU
@pytest.mark.parametrize("lengths", BATCHES + [[16384 - 3778 - 1, 3778, 1]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_backward_kernel_matches_float64(name, dtype, lengths):
    gen = torch.Generator().manual_seed(sum(lengths) + 6)
    heads, kv_heads, d = shape = BACKWARD[name]
    table = general_table(max(lengths), d, gen)
    dqkv, dq, dk, dv = backward_inputs(sum(lengths), (*shape, None), dtype, gen, "cpu")
    poison()
    dx = getattr(K(), name)(dq.cuda(), dk.cuda(), dv.cuda(), offsets(lengths, "cuda"), table.cuda())
    assert dx.shape == (sum(lengths), (heads + 2 * kv_heads) * d) and dx.dtype == dtype
    check(name, dx, prep64(dqkv, lengths, shape, table, True).reshape(dx.shape), dtype)


@pytest.mark.cuda
@NEEDS_GPU
def test_a_short_table_is_read_at_its_last_row_never_past_it():
    """A table of fewer rows than the longest sequence (which the module refuses on the host): the
    kernels clamp the position, reading the last row, never memory past the table."""
    gen = torch.Generator().manual_seed(7)
    name = "qkv_prep_table_fwd_h8_kv2_d32"
    lengths, shape = [40, 3], SHAPES[name]
    table = general_table(4, 32, gen)
    x = torch.randn(43, 12 * 32, generator=gen)
    out = getattr(K(), name)(x.cuda(), offsets(lengths, "cuda"), table.cuda())
    check(name, out, prep64(x, lengths, shape, table, False), torch.float32)
    g, dq, dk, dv = backward_inputs(43, (*shape, None), torch.float32, gen, "cpu")
    back = name.replace("_fwd_", "_bwd_")
    dx = getattr(K(), back)(dq.cuda(), dk.cuda(), dv.cuda(), offsets(lengths, "cuda"), table.cuda())
    check(back, dx, prep64(g, lengths, shape, table, True).reshape(dx.shape), torch.float32)
