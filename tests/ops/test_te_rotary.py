"""Rotary embedding from TE's per-call table (forward(rotary_pos_emb=...), issue 39): the reference
math and run-time checks of generator/ops/attention_rotary_table.py against TE's rope math, written
here in float64 from transformer_engine/pytorch/attention/rope.py (RotaryPositionEmbedding's table,
apply_rotary_pos_emb's rotate-half on the first d features), feature pairs (i, i + d/2) turned by
complex multiplication, the first half's output by table[pos, i], the second's by table[pos, i +
d/2] (TE's formula: t cos + rotate_half(t) sin with the table's d angles), so it shares no code or
form with the code under test and is exact for a general table, whose halves differ.
The generated modules of TE's attention modules (fusegen.eager's too) take it: checked on the host,
then the prep kernels' table variant (tests/runtime/test_attention_prep_table.py: the kernels)."""

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
    """TE's apply_rotary_pos_emb(t, table, 'thd', cu_seqlens) in float64: pairs p = (a_i, b_i) =
    (t_i, t_{i + d/2}) of the first d features, pos restarting at each sequence: the first half
    Re(p e^{j table[pos, i]}), the second Im(p e^{j table[pos, i + d/2]}) (one rotation where TE's
    cat(freqs, freqs) makes the two angles equal)."""
    t = t.double()
    out = t.clone()
    d = table.shape[-1]
    half = d // 2
    angles = table.reshape(table.shape[0], d).double()
    row = 0
    for length in lengths:
        for pos in range(length):
            pair = torch.complex(t[row, :, :half], t[row, :, half:d])
            ones = torch.ones(half, dtype=torch.float64)
            first, second = pair * torch.polar(ones, angles[pos, :half]), pair * torch.polar(ones, angles[pos, half:])
            out[row, :, :half], out[row, :, half:d] = first.real, second.imag
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


def _rotated_mha(table):
    """The layer tests' te_mha_reference with q and k rotated by ``table`` (te_mha_rope_reference),
    for the layer tests' cases' fused [q | k | v] layout."""
    def rotated_mha(p, x, lengths, heads, groups, normalization, zcg, input_layernorm, causal, interleaved=False):
        assert not interleaved
        if input_layernorm:  # TE's LayerNormLinear: the norm, then the qkv projection
            x = layer_tests._norm(p, x, normalization, zcg)
            p = {k.replace("layernorm_qkv.", "qkv."): v for k, v in p.items() if "layer_norm_" not in k}
        return te_mha_rope_reference(p, x, lengths, heads, groups, table, causal)
    return rotated_mha


@pytest.mark.parametrize("case", [layer_tests.CASES[0], layer_tests.CASES[1]], ids=["GPT", "Llama"])
def test_eager_transformer_layer_rotates_by_the_table_as_te(monkeypatch, case):
    """te.TransformerLayer's forward(rotary_pos_emb=...) reaches its self-attention: the layer
    tests' float64 reference of TE's layer with its attention rotating q and k by the table."""
    table = te_table(layer_tests.HIDDEN // case[0], 12, base=500000.0)
    monkeypatch.setattr(layer_tests, "te_mha_reference", _rotated_mha(table))
    checkpoint = layer_tests._checkpoint(layer_tests.te_layer_layout(case), seed=6)
    model = layer_tests._eager(case)
    model.load_state_dict(checkpoint)
    layer_tests._compare(model, lambda m, x: m[0](x, cu_seqlens=offsets(LENGTHS), rotary_pos_emb=table),
                         checkpoint, case)


# --- the generated modules rotate by the table (the prep kernels' table variant; CPU: their math) ---

MHA = ("te.MultiheadAttention(64, 4, num_gqa_groups=2, attention_dropout=0.0, fuse_qkv_params=True, "
       "qkv_weight_interleaved=False, qkv_format={!r})")
GENERATED_SPEC = SPEC_HEAD + (
    f"m_thd = te.Sequential({MHA.format('thd')})\n"
    f"m_sbhd = te.Sequential({MHA.format('sbhd')})\n"
    # the Llama spelling by hand: the QKV Linear, the attention op rotating by a base, the projection
    "hand = te.Sequential(te.Linear(64, 128), te.GroupedQueryAttention(64, 4, 2, te.DotProductAttention, "
    "rotary_base=10000.0), te.Linear(64, 64))\n")
SBHD = (6, 3)  # seq, batch


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    from tests.spec_packages import imported_package
    with imported_package(tmp_path_factory.mktemp("rotary"), "spec.py", GENERATED_SPEC, "rotary_pkg") as package:
        yield package


def general_table(d, max_s, seed=11):
    """A float32 [max_s, 1, 1, d] table whose halves' angles differ (TE's own repeat them)."""
    return (torch.randn(max_s, 1, 1, d, generator=torch.Generator().manual_seed(seed)) * 3).float()


TABLES = {"te": lambda: te_table(16, 12), "general": lambda: general_table(16, 12)}


def _randomized(module, seed=3):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.rand(param.shape, generator=gen) - 0.5)
    return {k.removeprefix("0."): v.detach().double().requires_grad_() for k, v in module.state_dict().items()
            if not k.endswith("_extra_state")}


def _thd_call(module, x, table):
    return module(x, torch.tensor(LENGTHS, dtype=torch.int32), rotary_pos_emb=table)


def _run_format(pkg, qkv_format, table, dtype=torch.float32, device="cpu"):
    """The generated te.MultiheadAttention of ``qkv_format`` called with the table, and TE's
    float64 reference: (y, want, x's grad, its reference's, {name: (grad, reference grad)})."""
    module = getattr(pkg, "MThd" if qkv_format == "thd" else "MSbhd")()
    params64 = _randomized(module)
    module.to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(9)
    shape = (sum(LENGTHS), 64) if qkv_format == "thd" else (*SBHD, 64)
    x, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    x64 = x.double().requires_grad_()
    if qkv_format == "thd":
        want = te_mha_rope_reference(params64, x64, LENGTHS, 4, 2, table)
    else:  # 'sbhd': each batch column a sequence of SBHD[0] tokens, positions from 0 in each
        seq, batch = SBHD
        rows = x64.transpose(0, 1).reshape(seq * batch, 64)
        want = te_mha_rope_reference(params64, rows, [seq] * batch, 4, 2, table).reshape(batch, seq, 64).transpose(0, 1)
    want.backward(dy.double())
    xd = x.to(device=device, dtype=dtype).requires_grad_()
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=device)
    table = table.to(device)
    y = module(xd, lengths, rotary_pos_emb=table) if qkv_format == "thd" else module(xd, rotary_pos_emb=table)
    y.backward(dy.to(device=device, dtype=dtype))
    grads = dict(module.named_parameters())
    assert sorted(grads) == sorted(f"0.{k}" for k in params64)  # every parameter's grad compared
    return y, want.detach(), xd.grad, x64.grad, {k: (grads[f"0.{k}"].grad, p.grad) for k, p in params64.items()}


@pytest.mark.parametrize("table", sorted(TABLES))
@pytest.mark.parametrize("qkv_format", ["thd", "sbhd"])
def test_generated_multihead_attention_rotates_by_the_table_as_te(pkg, qkv_format, table):
    """The generated te.MultiheadAttention with forward(rotary_pos_emb=table): output and the grads
    of x and every parameter against TE's float64 math, for TE's cat(freqs, freqs) table and a
    general one, packed sequences ('thd') and TE's default [seq, batch, hidden] ('sbhd')."""
    y, want, dx, dx64, grads = _run_format(pkg, qkv_format, TABLES[table]())
    assert y.shape == want.shape
    assert_close_to_reference("y", y, want, torch.float32)
    assert_close_to_reference("dx", dx, dx64, torch.float32)
    for name, (got, ref) in grads.items():
        assert_close_to_reference(f"d{name}", got, ref, torch.float32)


def test_generated_table_from_a_base_equals_the_rotary_base_pipeline(pkg):
    """The Llama use: the generated te.MultiheadAttention with TE's table of base b computes what the
    generated hand-written Linear, GroupedQueryAttention(rotary_base=b), Linear pipeline does,
    forward and grads."""
    mha, hand = pkg.MThd(), pkg.Hand()
    _randomized(mha)
    state = mha.state_dict()
    hand.load_state_dict({"0.weight": state["0.qkv.weight"], "0.bias": state["0.qkv.bias"],
                          "2.weight": state["0.proj.weight"], "2.bias": state["0.proj.bias"]})
    x = torch.randn(sum(LENGTHS), 64, generator=torch.Generator().manual_seed(5))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = _thd_call(mha, xa, te_table(16, 9, base=10000.0))
    want = hand(xb, torch.tensor(LENGTHS, dtype=torch.int32))
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(mha._modules["0"].qkv.weight.grad, hand._modules["0"].weight.grad, rtol=1.3e-6,
                               atol=1e-5)


@pytest.mark.parametrize("qkv_format", ["thd", "sbhd"])
def test_generated_module_without_a_table_runs_as_before(pkg, qkv_format):
    """None (TE's default) is the call without the keyword; a table of zero angles (no rotation)
    gives the same through the table's path."""
    module = getattr(pkg, "MThd" if qkv_format == "thd" else "MSbhd")()
    _randomized(module)
    x = torch.randn((sum(LENGTHS), 64) if qkv_format == "thd" else (*SBHD, 64),
                    generator=torch.Generator().manual_seed(6))
    call = (lambda t: _thd_call(module, x, t)) if qkv_format == "thd" else (lambda t: module(x, rotary_pos_emb=t))
    with torch.no_grad():
        plain = module(x, torch.tensor(LENGTHS, dtype=torch.int32)) if qkv_format == "thd" else module(x)
        torch.testing.assert_close(call(None), plain, rtol=0, atol=0)
        torch.testing.assert_close(call(torch.zeros(12, 1, 1, 16)), plain, rtol=1.3e-6, atol=1e-5)
        assert not torch.allclose(call(general_table(16, 12)), plain, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("table, message", [
    (lambda: te_table(16, 12).reshape(12, 16), r"must have shape \[max_s, 1, 1, d\]"),
    (lambda: te_table(16, 12).double(), "must be float32 angles"),
    (lambda: te_table(16, 12).to("meta"), "is on meta, the input on cpu"),
    (lambda: te_table(16, 5), "has 5 positions but the longest sequence has 9 tokens"),
    (lambda: te_table(16, 12, rotary_percent=0.5), r"rotates d = 8 features .* whole heads \(head_dim = 16\).*"
                                                    "fusegen.eager"),
    (lambda: [te_table(16, 12), te_table(16, 12)], "a \\(q, k\\) tuple of two different tables"),
])
def test_generated_module_refuses_a_bad_table(pkg, table, message):
    with pytest.raises(ValueError, match=f"MThd: forward\\(rotary_pos_emb=...\\).*{message}"):
        _thd_call(pkg.MThd(), torch.randn(sum(LENGTHS), 64), table())


def test_generated_sbhd_module_checks_the_table_against_its_sequence_length(pkg):
    x = torch.randn(*SBHD, 64)
    with pytest.raises(ValueError, match=f"MSbhd: .* has 4 positions but the longest sequence has {SBHD[0]} tokens"):
        pkg.MSbhd()(x, rotary_pos_emb=te_table(16, 4))


def test_generated_module_with_a_rotary_base_refuses_a_table(tmp_path):
    """An attention op that rotates by its own rotary_base takes no table: refused, never applied twice."""
    from tests.spec_packages import imported_package
    spec = SPEC_HEAD + ("m = te.Sequential(te.GroupedQueryAttention(64, 4, 2, rotary_base=10000.0, "
                        "qkv_format='thd'))\n")
    with imported_package(tmp_path, "spec.py", spec, "base_pkg") as package:
        module = package.M()
        x = torch.randn(sum(LENGTHS), 128)
        with pytest.raises(ValueError, match="M: rotary_pos_emb .* rotate q and k by their own rotary_base"):
            _thd_call(module, x, te_table(16, 12))


def test_generated_module_under_torch_compile_fullgraph_on_cpu(pkg):
    """torch.compile(fullgraph=True) with a table: the table a tensor argument of the custom ops
    (None an empty one), forward and grads as uncompiled."""
    module = pkg.MThd()
    _randomized(module)
    table = general_table(16, 12)
    x = torch.randn(sum(LENGTHS), 64, generator=torch.Generator().manual_seed(8))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = _thd_call(module, xa, table)
    want.sum().backward()
    grads = {k: p.grad.clone() for k, p in module.named_parameters()}
    module.zero_grad()
    compiled = torch.compile(module, fullgraph=True)
    got = _thd_call(compiled, xb, table)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    got.sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1.3e-6, atol=1e-5)
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1.3e-6, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(_thd_call(compiled, x, None), _thd_call(module, x, None), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("table", sorted(TABLES))
def test_generated_transformer_layer_rotates_by_the_table_as_te(tmp_path, monkeypatch, table):
    """A generated te.TransformerLayer (the layer tests' Llama case: RMSNorm, GQA, SwiGLU) with
    forward(rotary_pos_emb=...): the layer tests' float64 reference of TE's layer with its attention
    rotating q and k by the table, output and every grad."""
    from tests.spec_packages import imported_package
    case = layer_tests.CASES[1]
    angles = (te_table(layer_tests.HIDDEN // case[0], 12, base=500000.0) if table == "te"
              else general_table(layer_tests.HIDDEN // case[0], 12))
    monkeypatch.setattr(layer_tests, "te_mha_reference", _rotated_mha(angles))
    checkpoint = layer_tests._checkpoint(layer_tests.te_layer_layout(case), seed=6)
    with imported_package(tmp_path, "spec.py", layer_tests._spec(case), "layer_pkg") as package:
        module = package.M()
        module.load_state_dict(checkpoint)
        lengths = torch.tensor(LENGTHS, dtype=torch.int32)
        layer_tests._compare(module, lambda m, x: m(x, seq_lens=lengths, rotary_pos_emb=angles), checkpoint, case)


# --- CUDA (bf16, FlashAttention-2, the committed package's kernels) ------------------------------

def _gqa_rope_reference(p, x, lengths, table):
    """specs/te_attention.py's te_gqa_attention (RMSNorm, 8 heads sharing 2 kv heads of 32, no
    biases, causal; its QKV weight fused in TE's qkv_weight_interleaved rows, read through TE's view
    [groups, heads / groups + 2, head_dim] as [q | k | v]) with q and k rotated by the table, float64."""
    from tests.ops.test_te_attention import _norm
    h = _norm(p, x, "RMSNorm", False)
    by_group = p["layernorm_qkv.weight"].reshape(2, 6, 32, -1)
    weight = torch.cat([by_group[:, :4].reshape(-1, 256), by_group[:, 4].reshape(-1, 256),
                        by_group[:, 5].reshape(-1, 256)])
    qkv = {"qkv.weight": weight, "proj.weight": p["proj.weight"]}
    return te_mha_rope_reference(qkv, h, lengths, 8, 2, table)


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [[5, 1, 40, 18], [300, 7, 129]], ids=["few rows (graphs)", "many rows"])
@pytest.mark.parametrize("table", ["te", "general"])
def test_the_shipped_gqa_module_rotates_by_the_table_in_bf16(lengths, table):
    """generated.TeGqaAttention on CUDA in bf16 (the table variant's kernels, FlashAttention-2) with a
    table: output and every grad against float64 (TE's bf16 attention tolerance); at a few rows the
    module replays CUDA graphs, so each call's table of the same shape must be copied in (its own
    result), and None after them runs the no-rotary path."""
    import generated
    from tests.ops.test_te_attention import assert_close_fa2
    module = generated.TeGqaAttention(device="cuda", dtype=torch.bfloat16)
    module.eval()  # TE's attention_dropout=0.1 off: the reference has none
    gen = torch.Generator().manual_seed(2)
    for name, p in module.named_parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 2 else 1))
    params64 = {k.removeprefix("0."): v.detach().double().cpu().requires_grad_()
                for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    x = torch.randn(sum(lengths), 256, generator=gen)
    dy = torch.randn(sum(lengths), 256, generator=gen)
    tables = [te_table(32, max(lengths), base=base) if table == "te" else general_table(32, max(lengths), seed)
              for base, seed in ((500000.0, 1), (10000.0, 2), (1000.0, 3))]
    # three tables of one shape: at a few rows the first call runs as is, the second captures a graph,
    # the third replays it, which must read that call's table (copied into the graph's buffer)
    for angles in tables:
        x64 = x.double().requires_grad_()
        want = _gqa_rope_reference(params64, x64, lengths, angles)
        want.backward(dy.double())
        xc = x.to("cuda", torch.bfloat16).detach().requires_grad_()
        module.zero_grad()
        y = module(xc, seq_lens, rotary_pos_emb=angles.cuda())
        y.backward(dy.to("cuda", torch.bfloat16))
        assert_close_fa2("y", y, want, True)
        assert_close_fa2("dx", xc.grad, x64.grad, True)
        grads = dict(module.named_parameters())
        for name, p in params64.items():
            assert_close_fa2(f"d{name}", grads[f"0.{name}"].grad, p.grad, True)
            p.grad = None
    with torch.no_grad():  # None after tables: the no-rotary path (a graph of its own)
        plain = _gqa_rope_reference(params64, x.double(), lengths, torch.zeros(max(lengths), 1, 1, 32))
        assert_close_fa2("y without a table", module(x.to("cuda", torch.bfloat16), seq_lens), plain, True)


@pytest.mark.cuda
@pytest.mark.parametrize("table", ["te", "general"])
def test_the_shipped_sbhd_stack_rotates_by_the_table_in_bf16(monkeypatch, table):
    """generated.TeGptStack (specs/te_models.py: three te.TransformerLayers reading TE's default
    x [seq, batch, hidden]) on CUDA in bf16 with one table for its layers: output and every grad
    against test_te_models' float64 stack reference with each layer's attention rotating q and k
    by the table (positions from 0 in each batch column)."""
    from tests.ops import test_te_attention, test_te_models as models
    angles = (te_table(64, models.SEQ, base=10000.0) if table == "te" else general_table(64, models.SEQ))

    def rotated(p, x, cfg, lengths):  # test_te_models' _attention with q and k rotated
        qkv = {"qkv.weight": p["layernorm_qkv.weight"], "proj.weight": p["proj.weight"],
               **({"qkv.bias": p["layernorm_qkv.bias"]} if "layernorm_qkv.bias" in p else {}),
               **({"proj.bias": p["proj.bias"]} if "proj.bias" in p else {})}
        return te_mha_rope_reference(qkv, x, lengths, cfg["heads"], cfg["groups"], angles)

    monkeypatch.setattr(models, "_attention", rotated)
    module = generated_module("TeGptStack")
    checkpoint = models.te_checkpoint(models.GPT, seed=5)
    models.load(module, {k: v.cuda().bfloat16() for k, v in checkpoint.items()})
    x, dy, _ = models.inputs("gpt", torch.Generator().manual_seed(6), "cuda", torch.bfloat16)
    xg = x.requires_grad_()
    y = module(xg, rotary_pos_emb=angles.cuda())
    y.backward(dy)
    p64 = {k: v.bfloat16().double().requires_grad_() for k, v in checkpoint.items()}
    x64 = x.detach().cpu().double().requires_grad_()
    want = models.te_stack_reference(p64, x64, models.GPT)
    want.backward(dy.cpu().double())
    test_te_attention.assert_close_fa2("y", y, want, False)
    test_te_attention.assert_close_fa2("dx", xg.grad, x64.grad, False)
    grads = dict(module.named_parameters())
    for names in test_te_attention.grad_groups(p64):  # TE's query, key, value blocks together (why: there)
        got = torch.cat([grads[name].grad for name in names])
        test_te_attention.assert_close_fa2(f"d{'+'.join(names)}", got, torch.cat([p64[n].grad for n in names]), False)


def generated_module(name):
    """A module of the committed package (its kernels compiled) on CUDA in bf16, in eval (TE's
    attention and hidden dropout off: the references have none)."""
    import generated
    return getattr(generated, name)(device="cuda", dtype=torch.bfloat16).eval()
