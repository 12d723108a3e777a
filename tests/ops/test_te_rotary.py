"""Rotary embedding from TE's per-call table (forward(rotary_pos_emb=...), issue 39): the reference
math and run-time checks of generator/ops/attention_rotary_table.py against TE's rope math, written
here in float64 from transformer_engine/pytorch/attention/rope.py (RotaryPositionEmbedding's table,
apply_rotary_pos_emb's rotate-half on the first d features), as a rotation of feature pairs
(i, i + d/2) by complex multiplication, so it shares no code or form with the code under test.
The generated forward takes the keyword and refuses a table (its stage does not read one yet: next
step, then a prep kernel variant)."""

import pytest
import torch

from fusegen import eager
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.ops.attention import attention_rotary, attention_rotary_angles
from fusegen.ops.attention_rotary_table import (
    attention_rotary_partial, attention_rotary_table_angles, rotary_table_of)
from tests.ops import test_te_transformer_layer as layer_tests
from tests.references import assert_close_to_reference

LENGTHS = [3, 1, 9, 5]  # thd: packed sequences, odd, a single token, longer
HEADS, HEAD_DIM = 3, 16


def te_table(dim, max_seq_len, base=10000.0, rotary_percent=1.0):
    """TE's RotaryPositionEmbedding(dim, rotary_percent, rotary_base=base)(max_seq_len), float32."""
    if rotary_percent < 1.0:
        dim = int(dim * rotary_percent)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.einsum("i , j -> i j", torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).reshape(max_seq_len, 1, 1, -1)


def te_rope_reference(t, table, lengths):
    """TE's apply_rotary_pos_emb(t, table, 'thd', cu_seqlens) in float64: pairs (i, i + d/2) of
    the first d features rotated by table[pos, i], pos restarting at each sequence."""
    t = t.double()
    out = t.clone()
    d = table.shape[-1]
    half = d // 2
    angles = table.reshape(table.shape[0], d).double()
    row = 0
    for length in lengths:
        for pos in range(length):
            pair = torch.complex(t[row, :, :half], t[row, :, half:d])
            turned = pair * torch.polar(torch.ones(half, dtype=torch.float64), angles[pos, :half])
            out[row, :, :half], out[row, :, half:d] = turned.real, turned.imag
            row += 1
    return out


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def rotate(t, table4d, lengths, inverse=False):
    table = rotary_table_of(table4d, t.shape[-1], max(lengths), t.device)
    cos, sin = attention_rotary_table_angles(offsets(lengths), t.shape[0], table, t)
    return attention_rotary_partial(t, cos, sin, inverse)


@pytest.mark.parametrize("lengths", [LENGTHS, [6, 6, 6]], ids=["thd", "bshd"])
@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_forward_matches_te_rope(lengths, rotary_percent):
    torch.manual_seed(0)
    t = torch.randn(sum(lengths), HEADS, HEAD_DIM, dtype=torch.float64)
    table = te_table(HEAD_DIM, 12, rotary_percent=rotary_percent)
    expected = te_rope_reference(t, table, lengths)
    torch.testing.assert_close(rotate(t, table, lengths), expected, rtol=1e-12, atol=1e-12)
    if rotary_percent < 1.0:  # the features past d pass unchanged
        assert torch.equal(rotate(t, table, lengths)[..., HEAD_DIM // 2:], t[..., HEAD_DIM // 2:])


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_backward_is_the_transpose(rotary_percent):
    """The backward (inverse=True) is the forward's Jacobian transpose: autograd's grad of
    sum(rotate(t) * g) by t."""
    torch.manual_seed(1)
    t = torch.randn(sum(LENGTHS), HEADS, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    g = torch.randn(sum(LENGTHS), HEADS, HEAD_DIM, dtype=torch.float64)
    table = te_table(HEAD_DIM, 9, rotary_percent=rotary_percent)
    (rotate(t, table, LENGTHS) * g).sum().backward()
    torch.testing.assert_close(rotate(g, table, LENGTHS, inverse=True), t.grad, rtol=1e-12, atol=1e-12)


def test_table_from_a_base_equals_rotary_base():
    """The Llama use: a table built from base b rotates as the op's rotary_base=b (its angles
    computed from the base), in float32 at TE's fp32 tolerance."""
    torch.manual_seed(2)
    base = 500000.0
    t = torch.randn(sum(LENGTHS), HEADS, HEAD_DIM)
    cos, sin = attention_rotary_angles(offsets(LENGTHS), t.shape[0], HEAD_DIM, base, t)
    expected = attention_rotary(t, cos, sin, False)
    torch.testing.assert_close(rotate(t, te_table(HEAD_DIM, 9, base=base), LENGTHS), expected,
                               rtol=1.3e-6, atol=1e-5)


def test_a_tuple_of_one_table_is_that_table():
    table = te_table(HEAD_DIM, 9)
    assert torch.equal(rotary_table_of((table, table), HEAD_DIM, 9, "cpu"), table.reshape(9, HEAD_DIM))


@pytest.mark.parametrize("table, message", [
    (lambda: (te_table(HEAD_DIM, 9), te_table(HEAD_DIM, 9)), "two different tables"),
    (lambda: 0.5, "must be a tensor"),
    (lambda: te_table(HEAD_DIM, 9).reshape(9, HEAD_DIM), "shape \\[max_s, 1, 1, d\\]"),
    (lambda: te_table(HEAD_DIM, 9).double(), "float32"),
    (lambda: te_table(HEAD_DIM, 9).to("meta"), "move the table to the input's device"),
    (lambda: te_table(HEAD_DIM, 8), "longest sequence has 9 tokens"),
    (lambda: te_table(2 * HEAD_DIM, 9), "head_dim = 16"),
    (lambda: te_table(HEAD_DIM, 9)[..., :3], "must be even"),
])
def test_bad_tables_are_refused(table, message):
    with pytest.raises(ValueError, match=message):
        rotary_table_of(table(), HEAD_DIM, max(LENGTHS), "cpu")


# --- rotary_pos_interleaved: refused where it is written -----------------------------------------

SPEC_HEAD = "import torch\nimport transformer_engine.pytorch as te\n"
MHA_OK = "attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False, qkv_format='bshd'"
LAYER_OK = "attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False, attn_input_format='bshd'"


@pytest.mark.parametrize("call", [f"te.MultiheadAttention(64, 4, {MHA_OK}, rotary_pos_interleaved=True)",
                                  f"te.TransformerLayer(64, 96, 4, {LAYER_OK}, rotary_pos_interleaved=True)"],
                         ids=["MultiheadAttention", "TransformerLayer"])
def test_interleaved_rotary_is_refused_at_the_argument(call):
    with pytest.raises(SpecError) as info:
        parse_spec(SPEC_HEAD + f"m = te.Sequential({call})\n", "spec.py")
    err = info.value
    assert "argument 'rotary_pos_interleaved'" in err.message and "interleaved rotary" in err.message, err.message
    assert "leave it False" in err.message, err.message
    assert (err.location.line, err.location.col) == (3, 19 + call.rindex("True)")), str(err)


@pytest.mark.parametrize("call", [f"te.MultiheadAttention(64, 4, {MHA_OK}, rotary_pos_interleaved=False)",
                                  f"te.TransformerLayer(64, 96, 4, {LAYER_OK}, rotary_pos_interleaved=False)"],
                         ids=["MultiheadAttention", "TransformerLayer"])
def test_rotate_half_rotary_is_accepted(call):
    assert parse_spec(SPEC_HEAD + f"m = te.Sequential({call})\n", "spec.py") is not None


# --- fusegen.eager's te.MultiheadAttention takes forward(rotary_pos_emb=...) as TE does ------------

def te_mha_rope_reference(p, x, lengths, heads, groups, table, causal=True):
    """TE's MultiheadAttention forward (qkv Linear, fuse_qkv_params, not interleaved, 'thd') with
    apply_rotary_pos_emb on q and k, float64: the QKV projection viewed as TE views it
    ([(np/ng + 2), ng, hn]), q and k rotated (te_rope_reference), each query head h attending kv
    head h // (np/ng), softmax scale 1/sqrt(hn), the output projection."""
    total, hidden = x.shape
    hn, per_group = hidden // heads, heads // groups
    mixed = (x @ p["qkv.weight"].T + p.get("qkv.bias", 0)).view(total, per_group + 2, groups, hn)
    q = te_rope_reference(mixed[:, :per_group].reshape(total, heads, hn), table, lengths)
    k = te_rope_reference(mixed[:, per_group], table, lengths)
    v = mixed[:, per_group + 1]
    out, start = [], 0
    for n in lengths:
        rows = slice(start, start + n)
        heads_out = []
        for head in range(heads):
            scores = q[rows, head] @ k[rows, head // per_group].T / hn ** 0.5
            if causal:
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            heads_out.append(torch.softmax(scores, dim=-1) @ v[rows, head // per_group])
        out.append(torch.stack(heads_out, dim=1))
        start += n
    return torch.cat(out).reshape(total, hidden) @ p["proj.weight"].T + p.get("proj.bias", 0)


def eager_mha(heads, groups, dtype=torch.float32):
    return eager.MultiheadAttention(64, heads, attention_dropout=0.0, fuse_qkv_params=True,
                                    qkv_weight_interleaved=False, qkv_format="thd", num_gqa_groups=groups,
                                    params_dtype=dtype)


@pytest.mark.parametrize("rotary_percent", [1.0, 0.5])
def test_eager_multihead_attention_rotates_by_the_table_as_te(rotary_percent):
    torch.manual_seed(3)
    heads, groups = 4, 2
    model = eager_mha(heads, groups)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.5, 0.5)
    params64 = {k: v.detach().double().requires_grad_() for k, v in model.state_dict().items() if "extra" not in k}
    x = torch.randn(sum(LENGTHS), 64)
    dy = torch.randn(sum(LENGTHS), 64)
    table = te_table(64 // heads, 12, rotary_percent=rotary_percent)
    x64 = x.double().requires_grad_()
    want = te_mha_rope_reference(params64, x64, LENGTHS, heads, groups, table)
    want.backward(dy.double())
    x = x.requires_grad_()
    y = model(x, cu_seqlens=offsets(LENGTHS), rotary_pos_emb=table)
    y.backward(dy)
    assert_close_to_reference("y", y, want.detach(), torch.float32)
    assert_close_to_reference("dx", x.grad, x64.grad, torch.float32)
    grads = dict(model.named_parameters())
    assert sorted(grads) == sorted(params64)  # every parameter's grad compared
    for name, p in params64.items():
        assert_close_to_reference(f"d{name}", grads[name].grad, p.grad, torch.float32)


def test_eager_table_from_a_base_equals_the_rotary_base_op():
    """The Llama use: te.MultiheadAttention with TE's table of base b computes what the
    hand-written Linear, GroupedQueryAttention(rotary_base=b), Linear pipeline does."""
    torch.manual_seed(4)
    heads, groups, base = 4, 2, 10000.0
    model = eager_mha(heads, groups)
    ops = eager.Sequential(eager.Linear(64, 64 + 2 * 2 * 16), eager.GroupedQueryAttention(64, heads, groups,
                           rotary_base=base), eager.Linear(64, 64))
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-0.5, 0.5)
        ops.load_state_dict({"0.weight": model.qkv.weight, "0.bias": model.qkv.bias,
                             "2.weight": model.proj.weight, "2.bias": model.proj.bias})
    x = torch.randn(sum(LENGTHS), 64)
    got = model(x, cu_seqlens=offsets(LENGTHS), rotary_pos_emb=te_table(16, 9, base=base))
    torch.testing.assert_close(got, _ops_on(ops, x, offsets(LENGTHS)), rtol=1.3e-6, atol=1e-5)


def _ops_on(ops, x, cu):
    """The Sequential's ops one by one with the packed sequences given to the attention op."""
    h = ops[0](x)
    h = ops[1](h, cu_seqlens=cu)
    return ops[2](h)


def test_eager_refuses_a_bad_table_and_a_table_without_attention():
    model = eager_mha(4, 2)
    x = torch.randn(sum(LENGTHS), 64)
    with pytest.raises(ValueError, match="longest sequence has 9 tokens"):
        model(x, cu_seqlens=offsets(LENGTHS), rotary_pos_emb=te_table(16, 5))
    with pytest.raises(ValueError, match="has none; leave it out"):
        eager.Linear(64, 64)(x, rotary_pos_emb=te_table(16, 9))
    ops = eager.GroupedQueryAttention(64, 4, 2, rotary_base=10000.0)
    with pytest.raises(ValueError, match="pass one rotary"):
        ops(torch.randn(9, 128), rotary_pos_emb=te_table(16, 9))


@pytest.mark.parametrize("case", [layer_tests.CASES[0], layer_tests.CASES[1]], ids=["GPT", "Llama"])
def test_eager_transformer_layer_rotates_by_the_table_as_te(monkeypatch, case):
    """te.TransformerLayer's forward(rotary_pos_emb=...) reaches its self-attention: the layer
    tests' float64 reference of TE's layer with its attention rotating q and k by the table."""
    table = te_table(layer_tests.HIDDEN // case[0], 12, base=500000.0)

    def rotated_mha(p, x, lengths, heads, groups, normalization, zcg, input_layernorm, causal, interleaved=False):
        assert not interleaved  # the cases' fused [q | k | v] layout
        if input_layernorm:  # TE's LayerNormLinear: the norm, then the qkv projection
            x = layer_tests._norm(p, x, normalization, zcg)
            p = {k.replace("layernorm_qkv.", "qkv."): v for k, v in p.items() if "layer_norm_" not in k}
        return te_mha_rope_reference(p, x, lengths, heads, groups, table, causal)

    monkeypatch.setattr(layer_tests, "te_mha_reference", rotated_mha)
    checkpoint = layer_tests._checkpoint(layer_tests.te_layer_layout(case), seed=6)
    model = layer_tests._eager(case)
    model.load_state_dict(checkpoint)
    layer_tests._compare(model, lambda m, x: m[0](x, cu_seqlens=offsets(LENGTHS), rotary_pos_emb=table),
                         checkpoint, case)


# --- the generated modules take TE's keyword and refuse a table (their stage does not read one yet) -

@pytest.mark.parametrize("kind", ["TeGqaAttention", "TeLlamaLayer"])
def test_generated_module_refuses_a_table_and_takes_none(kind):
    """The generated te.MultiheadAttention / te.TransformerLayer modules take forward's
    rotary_pos_emb keyword as TE's do: None (TE's default) runs as without it; a table is refused
    with what to do (never dropped: q and k would go unrotated)."""
    import generated
    torch.manual_seed(5)
    module = getattr(generated, kind)()
    module.eval()  # TE's attention_dropout=0.1 off, so two calls agree
    hidden = module.state_dict()["0.proj.weight" if kind == "TeGqaAttention" else
                                 "0.self_attention.proj.weight"].shape[0]
    seq_lens = torch.tensor(LENGTHS, dtype=torch.int32)
    x = torch.randn(sum(LENGTHS), hidden)
    with torch.no_grad():
        want = module(x, seq_lens)
        torch.testing.assert_close(module(x, seq_lens, rotary_pos_emb=None), want, rtol=0, atol=0)
        with pytest.raises(ValueError, match=f"{kind}: rotary_pos_emb .* not supported by fusegen's generated "
                                             "modules yet; run the spec with fusegen.eager"):
            module(x, seq_lens, rotary_pos_emb=te_table(hidden // 8, 12))
