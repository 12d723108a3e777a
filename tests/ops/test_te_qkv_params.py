"""TE's QKV parameter layouts (issue 39): the runtime's row_blocks (TE's noop_cat semantics: named
row blocks of one parameter joined for the GEMM, one buffer again after a move; TE's
qkv_weight_interleaved rows handed over as [q | k | v]), fusegen.eager's gather, and the
generated modules that hold them (specs/te_attention.py: te_gpt_attention keeps TE's default split
parameters, te_gqa_attention fuses them in TE's interleaved layout). References in float64,
written here from TE's documented semantics (module/_common.py noop_cat, layernorm_linear.py's
parameters_split, attention/multi_head_attention.py's view [groups, heads / groups + 2, head_dim])."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fusegen import eager
from fusegen.ops import HeldRows

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


@pytest.mark.parametrize("join", ["join_rows", "rows_view"])
def test_the_joins_compile_fullgraph_on_cpu_to_a_differentiated_cat(join):
    blocks = _split_parameters(dtype=torch.float32)

    def project(x, *weights):
        return x @ getattr(row_blocks, join)(*weights).t()

    compiled = torch.compile(project, fullgraph=True, backend="aot_eager")
    x = torch.randn(3, HIDDEN, requires_grad=True)
    compiled(x, *blocks).sum().backward()
    ref = [b.detach().clone().requires_grad_() for b in blocks]
    ref_x = x.detach().clone().requires_grad_()
    (ref_x @ torch.cat(ref).t()).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1.3e-6, atol=1e-5)
    for block, r in zip(blocks, ref):
        torch.testing.assert_close(block.grad, r.grad, rtol=1.3e-6, atol=1e-5)


def test_rows_view_is_the_blocks_without_autograd_and_split_rows_their_grads():
    """rows_view (the stages' tensor where the Function takes the blocks themselves): a view of
    adjacent blocks, a copy of others, with no autograd history either way; split_rows hands each
    block its rows of a grad (None: none)."""
    blocks = _split_parameters()
    joined = row_blocks.rows_view(*blocks)
    assert joined.data_ptr() == blocks[0].data_ptr() and joined.grad_fn is None and not joined.requires_grad
    with torch.no_grad():  # (a view made without grad of a tensor that requires it would require it too)
        assert not row_blocks.rows_view(*blocks).requires_grad
    torch.testing.assert_close(joined, torch.cat([b.detach() for b in blocks]), rtol=0, atol=0)
    blocks[1].data = blocks[1].data.clone()
    copied = row_blocks.rows_view(*blocks)
    assert copied.data_ptr() != blocks[0].data_ptr() and copied.grad_fn is None
    torch.testing.assert_close(copied, torch.cat([b.detach() for b in blocks]), rtol=0, atol=0)
    grad = torch.randn(sum(ROWS.values()), HIDDEN, dtype=torch.float64)
    rows = tuple(ROWS.values())
    assert [g.data_ptr() for g in row_blocks.split_rows(grad, rows)] == [
        grad[start:].data_ptr() for start in (0, rows[0], rows[0] + rows[1])]
    assert row_blocks.split_rows(None, rows) == (None, None, None)


def _te_interleaved_split(weight, heads, groups, head_dim):
    """TE's forward on the fused projection's rows, as multi_head_attention.py reads them with
    qkv_weight_interleaved=True: view [groups, heads/groups + 2, head_dim], split (heads/groups, 1, 1)."""
    per_group = heads // groups
    view = weight.reshape(groups, per_group + 2, head_dim, -1)
    q, k, v = view.split((per_group, 1, 1), dim=1)
    return q.reshape(heads * head_dim, -1), k.reshape(groups * head_dim, -1), v.reshape(groups * head_dim, -1)


def test_adjacent_rows_makes_moved_blocks_one_buffer_again_keeping_the_parameters():
    holder = torch.nn.Module()
    for name, block in zip(ROWS, _split_parameters()):
        holder.register_parameter(f"{name}_weight", block)
    names = tuple(f"{name}_weight" for name in ROWS)
    before = [holder._parameters[n] for n in names]
    values = [b.detach().clone() for b in before]
    holder.to(torch.float32)  # Module._apply: each parameter's data cast on its own
    assert not row_blocks._adjacent([holder._parameters[n] for n in names])
    row_blocks.adjacent_rows(holder, names)
    after = [holder._parameters[n] for n in names]
    assert all(a is b for a, b in zip(after, before)), "the same Parameter objects (an optimizer holds them)"
    assert row_blocks._adjacent(after)
    assert row_blocks.join_rows(*after).data_ptr() == after[0].data_ptr()
    for got, want in zip(after, values):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.detach(), want.float(), rtol=0, atol=0)


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 2, 4), (4, 4, 8), (8, 1, 2), (6, 3, 4)])
def test_grouped_rows_and_eager_s_gather_give_te_s_q_k_v(heads, groups, head_dim):
    torch.manual_seed(2)
    rows = (heads + 2 * groups) * head_dim
    te_weight = torch.randn(rows, 3, dtype=torch.float64)
    expected = torch.cat(_te_interleaved_split(te_weight, heads, groups, head_dim))
    held = HeldRows(groups=(groups, heads // groups))
    torch.testing.assert_close(row_blocks.grouped_rows(te_weight, groups, heads // groups), expected, rtol=0, atol=0)
    order = held.gemm_rows(rows)
    assert sorted(order) == list(range(rows)), "a permutation of TE's rows"
    torch.testing.assert_close(te_weight[order], expected, rtol=0, atol=0)
    te_bias = torch.randn(rows, dtype=torch.float64)
    bias_expected = torch.cat(_te_interleaved_split(te_bias[:, None], heads, groups, head_dim))[:, 0]
    torch.testing.assert_close(row_blocks.grouped_rows(te_bias, groups, heads // groups), bias_expected, rtol=0, atol=0)


def test_grouped_rows_grads_land_in_te_s_layout():
    torch.manual_seed(3)
    heads, groups, head_dim = 4, 2, 4
    rows = (heads + 2 * groups) * head_dim
    weight = torch.nn.Parameter(torch.randn(rows, HIDDEN, dtype=torch.float64))
    bias = torch.nn.Parameter(torch.randn(rows, dtype=torch.float64))
    x = torch.randn(5, HIDDEN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, rows, dtype=torch.float64)
    per_group = heads // groups
    y = x @ row_blocks.grouped_rows(weight, groups, per_group).t() + row_blocks.grouped_rows(bias, groups, per_group)
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


# --- the generated modules (specs/te_attention.py) -------------------------------------------------

QKV = "0.layernorm_qkv."
SPLIT = [f"{QKV}{block}_{attr}" for attr in ("weight", "bias") for block in ("query", "key", "value")]


def _gpt_attention(**kwargs):
    import generated
    module = generated.TeGptAttention(**kwargs)
    return module.eval()  # TE's attention_dropout=0.1 off: the comparisons below are of values


def test_the_split_parameters_are_te_s_blocks_of_one_buffer_joined_without_a_copy():
    module = _gpt_attention()
    state = module.state_dict()
    assert [k for k in state if k.startswith(QKV) and "layer_norm" not in k and "extra" not in k] == SPLIT
    assert {k: tuple(state[k].shape) for k in SPLIT} == {
        **{f"{QKV}{b}_weight": (256, 256) for b in ("query", "key", "value")},
        **{f"{QKV}{b}_bias": (256,) for b in ("query", "key", "value")}}
    blocks = [module.get_parameter(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    assert row_blocks._adjacent(blocks), "allocated as TE does: row slices of one buffer"
    module.to(torch.float64)
    blocks = [module.get_parameter(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    assert all(b.dtype == torch.float64 for b in blocks)
    assert row_blocks._adjacent(blocks), "one buffer again after .to() (the module's _apply)"


def test_load_state_dict_with_assign_makes_the_blocks_one_buffer_again():
    """load_state_dict(assign=True) makes each loaded tensor a parameter of its own (as from a meta
    module, or a checkpoint of separate tensors): the module's load hook makes TE's blocks one
    buffer again, keeping the new Parameter objects and their values, so the forward reads them
    as a view (a copy a call otherwise, and a CUDA graph's parameters moved every call); a load
    without assign leaves the buffer as it is."""
    import generated
    source = _gpt_attention(dtype=torch.float64)
    torch.manual_seed(6)
    for p in source.parameters():
        torch.nn.init.normal_(p)
    state = {k: v.clone() for k, v in source.state_dict().items()}  # each its own tensor
    names = [f"{QKV}{b}_{attr}" for attr in ("weight", "bias") for b in ("query", "key", "value")]
    module = generated.TeGptAttention(device="meta", dtype=torch.float64).eval()
    module.load_state_dict(state, assign=True)
    for group in (names[:3], names[3:]):
        blocks = [module.get_parameter(name) for name in group]
        assert row_blocks._adjacent(blocks), f"{group}: one buffer after load_state_dict(assign=True)"
        assert all(type(b) is torch.nn.Parameter and b.requires_grad for b in blocks)
        assert row_blocks.rows_view(*blocks).data_ptr() == blocks[0].data_ptr()
    for name in names:
        torch.testing.assert_close(module.get_parameter(name), state[name], rtol=0, atol=0)
    x = torch.randn(2, 7, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(module(x), source.eval()(x), rtol=0, atol=0)
    memory = module.get_parameter(names[0]).data_ptr()
    module.load_state_dict(state)  # copied into the parameters: the same buffer
    assert module.get_parameter(names[0]).data_ptr() == memory


def test_a_deepcopy_holds_the_blocks_as_one_buffer_of_its_own():
    """copy.deepcopy copies each Parameter on its own (Parameter.__deepcopy__ clones its data): the
    module's __setstate__ makes the copy's blocks one buffer again, the original's untouched."""
    import copy
    module = _gpt_attention(dtype=torch.float64)
    twin = copy.deepcopy(module)
    blocks = [twin.get_parameter(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    originals = [module.get_parameter(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    assert row_blocks._adjacent(blocks) and row_blocks._adjacent(originals)
    assert blocks[0].data_ptr() != originals[0].data_ptr()
    x = torch.randn(2, 7, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(twin(x), module(x), rtol=0, atol=0)


def _run_both(module, eager_model, x, run):
    """y and every parameter's grad of the generated ``module`` and of fusegen.eager's (its float64
    reference math) on the same checkpoint."""
    results = []
    for model, call in ((module, run), (eager_model, lambda m, v: m[0](v, cu_seqlens=torch.tensor([0, 7, 12, 20])))):
        model.zero_grad(set_to_none=True)
        xi = (x if model is module else x.double()).clone().requires_grad_()
        y = call(model, xi)
        y.backward(torch.ones_like(y) / y.numel() ** 0.5)
        results.append((y.detach(), xi.grad, {k: p.grad.clone() for k, p in model.named_parameters()}))
    return results


@pytest.mark.parametrize("kind", ["TeGptAttention", "TeGqaAttention"])
def test_a_te_checkpoint_loads_into_both_and_they_agree_also_after_a_move_and_under_compile(kind):
    """The shipped modules of TE's default split parameters and of TE's interleaved rows: a
    TE-laid-out state_dict loads strictly into the generated module and fusegen.eager's, which
    compute the same (the eager one in float64 by its own gather: HeldRows.gemm_rows), also after
    ``.to(torch.float64)`` and under torch.compile(fullgraph=True) on the CPU."""
    import generated
    module = getattr(generated, kind)().eval()
    arguments = (dict(num_gqa_groups=None, normalization="LayerNorm", bias=True) if kind == "TeGptAttention" else
                 dict(num_gqa_groups=2, normalization="RMSNorm", bias=False, fuse_qkv_params=True))
    heads = 4 if kind == "TeGptAttention" else 8
    eager_model = eager.Sequential(eager.MultiheadAttention(
        256, heads, input_layernorm=True, qkv_format="thd", params_dtype=torch.float64, **arguments)).eval()
    gen = torch.Generator().manual_seed(4)
    checkpoint = {k: v if k.endswith("_extra_state") else torch.randn(v.shape, generator=gen) * 0.1
                  for k, v in module.state_dict().items()}
    assert list(checkpoint) == list(eager_model.state_dict())
    module.load_state_dict(checkpoint)
    eager_model.load_state_dict(checkpoint)
    x = torch.randn(20, 256, generator=gen)
    lengths = torch.tensor([7, 5, 8], dtype=torch.int32)

    def run(m, v):
        return m(v, seq_lens=lengths) if kind == "TeGqaAttention" else torch.cat(
            [m(part[None])[0] for part in v.split(lengths.tolist())])

    (y, dx, grads), (want, want_dx, want_grads) = _run_both(module, eager_model, x, run)
    assert sorted(grads) == sorted(want_grads)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-4, atol=1e-5)
    for name in grads:
        torch.testing.assert_close(grads[name].double(), want_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    module.to(torch.float64)
    (y64, _, grads64), _ = _run_both(module, eager_model, x.double(), run)
    torch.testing.assert_close(y64, want, rtol=1e-10, atol=1e-12)
    for name in grads64:
        torch.testing.assert_close(grads64[name], want_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    module.to(torch.float32)
    compiled = torch.compile(module, fullgraph=True)
    (yc, dxc, gradsc), _ = _run_both(compiled, eager_model, x, run if kind == "TeGqaAttention" else
                                     lambda m, v: m(v.reshape(1, 20, 256)[:, :7])[0])
    if kind == "TeGqaAttention":
        torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-6)
        for name in grads:
            torch.testing.assert_close(gradsc[f"_orig_mod.{name}"], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    else:  # one sequence: the first
        torch.testing.assert_close(yc[0] if yc.dim() == 3 else yc, y[:7], rtol=1e-5, atol=1e-6)


def test_plan_md_shows_what_the_module_holds():
    plan = (Path(__file__).resolve().parents[2] / "generated" / "te_gpt_attention.plan.md").read_text()
    assert "`query_weight`, `key_weight`, `value_weight`: TE's parameters_split, row blocks of one buffer" in plan, plan
    assert "`query_bias`, `key_bias`, `value_bias`: TE's parameters_split" in plan, plan
    plan = (Path(__file__).resolve().parents[2] / "generated" / "te_gqa_attention.plan.md").read_text()
    assert "TE's qkv_weight_interleaved, rows per GQA group (2 of 4 q heads, a k head, a v head)" in plan, plan


@pytest.mark.cuda
def test_interleaved_rows_train_under_cuda_graph_replay_as_without():
    """te_gqa_attention at a few rows on CUDA replays CUDA graphs; the gathered QKV weight is a new
    tensor each call, copied into the graph like x (a per-call argument): replays after a weight
    update give what the graph-free run gives."""
    import generated
    torch.manual_seed(0)
    module = generated.TeGqaAttention(device="cuda", dtype=torch.bfloat16).eval()
    reference = generated.TeGqaAttention(device="cuda", dtype=torch.bfloat16).eval()
    reference.cuda_graphs.max_rows = 0  # no graphs
    lengths = torch.tensor([3, 5], dtype=torch.int32, device="cuda")
    for step in range(4):  # the second call captures, later ones replay
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0, 0.1)
            reference.load_state_dict(module.state_dict())
        x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
        got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = module(got_x, seq_lens=lengths), reference(want_x, seq_lens=lengths)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
        torch.testing.assert_close(got_x.grad, want_x.grad, rtol=0, atol=0)
        for (name, p), q in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"step {step}: {name}")
            p.grad = q.grad = None
    assert module.cuda_graphs.captured >= 1, "the module replayed graphs"


def test_the_weight_grad_gemm_adds_into_the_blocks_grads_in_place(monkeypatch):
    """A second backward adds the QKV weight's grad into the blocks' grads with the GEMM itself
    (beta = 1, as for a weight held whole), in their memory: the sum of two backwards, each
    block's own; not where a backward leaves some block's grad alone (backward(inputs=...))."""
    import generated
    from generated import _reference
    found = []  # what _grad_to_add_into found for the QKV weight (768 rows: the three blocks')
    to_add_into = _reference._grad_to_add_into

    def recorded(ctx, weight, x):
        grad = to_add_into(ctx, weight, x)
        if weight.shape[0] == 768:
            found.append(grad)
        return grad

    monkeypatch.setattr(_reference, "_grad_to_add_into", recorded)
    module = _gpt_attention()
    x = torch.randn(2, 7, 256, generator=torch.Generator().manual_seed(3))
    blocks = [module.get_parameter(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    module(x).sum().backward()
    once = [b.grad.clone() for b in blocks]
    memory = [b.grad.data_ptr() for b in blocks]
    module(x).sum().backward()
    assert found[0] is None and found[-1] is not None, "the second backward's GEMM adds into the grads"
    assert [b.grad.data_ptr() for b in blocks] == memory
    for block, first in zip(blocks, once):
        torch.testing.assert_close(block.grad, 2 * first, rtol=1e-6, atol=1e-6)
    found.clear()
    module(x).sum().backward(inputs=[blocks[0]])  # the key and value grads stay as they are
    assert found[-1] is None
    torch.testing.assert_close(blocks[0].grad, 3 * once[0], rtol=1e-6, atol=1e-6)
    for block, first in zip(blocks[1:], once[1:]):
        torch.testing.assert_close(block.grad, 2 * first, rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
def test_blocks_grads_accumulate_in_place_under_cuda_graph_replay_as_without():
    """te_gpt_attention (TE's split QKV parameters) at a few rows on CUDA replays CUDA graphs; its
    weight-grad GEMMs run after the replayed backward and add into the blocks' grads in place: three
    backwards without zeroing give what the graph-free module gives, bit for bit, each block's grad
    staying in its memory."""
    import generated
    torch.manual_seed(0)
    module = generated.TeGptAttention(device="cuda", dtype=torch.bfloat16).eval()
    reference = generated.TeGptAttention(device="cuda", dtype=torch.bfloat16).eval()
    reference.cuda_graphs.max_rows = 0  # no graphs
    reference.load_state_dict(module.state_dict())
    blocks = [module.get_parameter(f"{QKV}{b}_weight") for b in ("query", "key", "value")]
    memory = None
    for step in range(4):
        x = torch.randn(1, 8, 256, device="cuda", dtype=torch.bfloat16)
        module(x).float().square().sum().backward()
        reference(x).float().square().sum().backward()
        if step == 1:  # the first backward's grads, the second adds into them
            memory = [b.grad.data_ptr() for b in blocks]
    assert module.cuda_graphs.captured >= 1, "the module replayed graphs"
    assert [b.grad.data_ptr() for b in blocks] == memory
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


GATED_SPEC = '''\
import transformer_engine.pytorch as te
from user_gates import Gate

gated_attention = te.Sequential(
    te.MultiheadAttention(256, 4, input_layernorm=True, qkv_format="bshd"),
    Gate(256),
)
'''
GATE = '''\
import torch


class Gate(torch.nn.Module):
    def __init__(self, features):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.linspace(-1, 1, features))

    def forward(self, x):
        return x * torch.tanh(self.gate)
'''


def test_blocks_beside_a_user_module_are_joined_by_autograd(tmp_path):
    """A pipeline running a user module between its Functions (emit/segments.py) joins TE's row
    blocks with join_rows, an autograd node, not by its Functions: it computes what te_gpt_attention
    followed by the module computes, its blocks' grads included, also accumulated over two backwards."""
    from spec_packages import imported_package

    with imported_package(tmp_path, "spec.py", GATED_SPEC, "gated_pkg", files={"user_gates.py": GATE}) as pkg:
        source = Path(pkg.__file__).with_name("gated_attention.py").read_text()
        assert "join_rows(" in source and "rows_view(" not in source
        module = pkg.GatedAttention(dtype=torch.float64).eval()
        attention = _gpt_attention(dtype=torch.float64)
        torch.manual_seed(4)
        for p in attention.parameters():
            torch.nn.init.normal_(p, std=0.05)
        module.load_state_dict({**attention.state_dict(), "1.gate": torch.linspace(-1, 1, 256, dtype=torch.float64)},
                               strict=True)
        x = torch.randn(2, 7, 256, dtype=torch.float64)
        for _ in range(2):
            got, want = module(x), attention(x) * torch.tanh(torch.linspace(-1, 1, 256, dtype=torch.float64))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            dy = torch.randn_like(got)
            got.backward(dy)
            want.backward(dy)
        for name, p in attention.named_parameters():
            torch.testing.assert_close(module.get_parameter(name).grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
