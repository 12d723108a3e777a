"""TE's QKV parameter layouts (issue 39): the runtime's row_blocks (TE's noop_cat semantics: named
row blocks of one parameter joined for the GEMM; a fixed row order) and the generate-time row order
of TE's qkv_weight_interleaved=True fused weight. References in float64, written here from TE's
documented semantics (module/_common.py noop_cat, attention/multi_head_attention.py's view
[groups, heads / groups + 2, head_dim])."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from generator.ops.te_modules import interleaved_qkv_rows

_SPEC = importlib.util.spec_from_file_location(
    "row_blocks", Path(__file__).resolve().parents[2] / "templates" / "runtime" / "row_blocks.py")
row_blocks = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("row_blocks", row_blocks)  # torch.compile traces its functions by module name
_SPEC.loader.exec_module(row_blocks)

HIDDEN, HEADS, GROUPS = 16, 4, 2
HEAD_DIM = HIDDEN // HEADS
ROWS = {"query": HEADS * HEAD_DIM, "key": GROUPS * HEAD_DIM, "value": GROUPS * HEAD_DIM}


def _split_parameters(dtype=torch.float64, seed=0):
    """query_weight, key_weight, value_weight as TE allocates them: adjacent row blocks of one buffer."""
    torch.manual_seed(seed)
    buffer = torch.randn(sum(ROWS.values()), HIDDEN, dtype=dtype)
    blocks, start = [], 0
    for rows in ROWS.values():
        blocks.append(torch.nn.Parameter(buffer[start:start + rows]))
        start += rows
    return blocks


def _check_join(blocks):
    torch.manual_seed(1)
    x = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, sum(ROWS.values()), dtype=torch.float64)
    (x @ row_blocks.join_rows(*blocks).t()).backward(dy)
    # float64 reference: the blocks' own product each, no join (TE: q = x q_w^T, k = x k_w^T, v = x v_w^T)
    ref_x = x.detach().clone().requires_grad_()
    ref_blocks = [b.detach().clone().requires_grad_() for b in blocks]
    outs = [ref_x @ b.t() for b in ref_blocks]
    torch.autograd.backward(outs, list(dy.split(list(ROWS.values()), dim=1)))
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    for name, block, ref in zip(ROWS, blocks, ref_blocks):
        assert block.grad is not None, f"{name}_weight got no grad"
        assert block.grad.shape == block.shape
        torch.testing.assert_close(block.grad, ref.grad, rtol=1e-12, atol=1e-12)


def test_join_rows_of_adjacent_blocks_is_a_view_with_each_blocks_grad():
    blocks = _split_parameters()
    joined = row_blocks.join_rows(*blocks)
    assert joined.data_ptr() == blocks[0].data_ptr(), "adjacent blocks must be joined without a copy"
    torch.testing.assert_close(joined, torch.cat([b.detach() for b in blocks]), rtol=0, atol=0)
    _check_join(blocks)


def test_join_rows_after_adjacency_is_broken_copies_and_is_still_right():
    blocks = _split_parameters()
    blocks[1].data = blocks[1].data.clone()  # what load_state_dict / param.data = ... may leave
    assert not row_blocks._adjacent(blocks)
    _check_join(blocks)
    moved = [torch.nn.Parameter(b.detach().to(torch.float32).to(torch.float64)) for b in _split_parameters()]
    assert not row_blocks._adjacent(moved)  # .to() re-creates each parameter on its own
    _check_join(moved)


def test_join_rows_of_one_block_is_the_block():
    (block,) = _split_parameters()[:1]
    assert row_blocks.join_rows(block) is block


def test_join_rows_compiles_fullgraph_on_cpu():
    blocks = _split_parameters(dtype=torch.float32)

    def project(x, *weights):
        return x @ row_blocks.join_rows(*weights).t()

    compiled = torch.compile(project, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, HIDDEN, requires_grad=True)
    compiled(x, *blocks).sum().backward()
    ref = [b.detach().clone().requires_grad_() for b in blocks]
    ref_x = x.detach().clone().requires_grad_()
    (ref_x @ torch.cat(ref).t()).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1.3e-6, atol=1e-5)
    for block, r in zip(blocks, ref):
        torch.testing.assert_close(block.grad, r.grad, rtol=1.3e-6, atol=1e-5)


def _te_interleaved_split(weight, heads, groups, head_dim):
    """TE's forward on the fused projection's rows, as multi_head_attention.py reads them with
    qkv_weight_interleaved=True: view [groups, heads/groups + 2, head_dim], split (heads/groups, 1, 1)."""
    per_group = heads // groups
    view = weight.reshape(groups, per_group + 2, head_dim, -1)
    q, k, v = view.split((per_group, 1, 1), dim=1)
    return q.reshape(heads * head_dim, -1), k.reshape(groups * head_dim, -1), v.reshape(groups * head_dim, -1)


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 2, 4), (4, 4, 8), (8, 1, 2), (6, 3, 4)])
def test_interleaved_qkv_rows_give_fusegens_q_k_v_order(heads, groups, head_dim):
    torch.manual_seed(2)
    rows = (heads + 2 * groups) * head_dim
    te_weight = torch.randn(rows, 3, dtype=torch.float64)
    order = interleaved_qkv_rows(heads, groups, head_dim)
    assert sorted(order) == list(range(rows)), "the order must be a permutation of TE's rows"
    expected = torch.cat(_te_interleaved_split(te_weight, heads, groups, head_dim))
    torch.testing.assert_close(te_weight[order], expected, rtol=0, atol=0)


def test_rows_in_order_grads_land_in_tes_layout():
    torch.manual_seed(3)
    heads, groups, head_dim = 4, 2, 4
    rows = (heads + 2 * groups) * head_dim
    weight = torch.nn.Parameter(torch.randn(rows, HIDDEN, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(rows, dtype=torch.float64))
    order = torch.tensor(interleaved_qkv_rows(heads, groups, head_dim))
    x = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, rows, dtype=torch.float64)
    y = x @ row_blocks.rows_in_order(weight, order).t() + row_blocks.rows_in_order(bias, order)
    y.backward(dy)
    # reference: TE's own forward, q, k, v read from TE's layout through its view, dy given per q/k/v
    ref_w = weight.detach().clone().requires_grad_()
    ref_b = bias.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ws = _te_interleaved_split(ref_w, heads, groups, head_dim)
    bs = _te_interleaved_split(ref_b.unsqueeze(1), heads, groups, head_dim)
    outs = [ref_x @ w.t() + b.squeeze(1) for w, b in zip(ws, bs)]
    torch.testing.assert_close(y.detach(), torch.cat(outs, dim=1).detach(), rtol=1e-12, atol=1e-12)
    dys = dy.split([heads * head_dim, groups * head_dim, groups * head_dim], dim=1)
    torch.autograd.backward(outs, list(dys))
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weight.grad, ref_w.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bias.grad, ref_b.grad, rtol=1e-12, atol=1e-12)
