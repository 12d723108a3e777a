"""te.MultiheadAttention as a macro (issue 39): in a spec it expands to the te.ops ops it computes,
keeps TE's parameter names and nesting (``layernorm_qkv.weight``, ``proj.bias``, each TE submodule's
``_extra_state``) and computes TE's semantics. The reference below is written from TE's
transformer_engine/pytorch/attention/multi_head_attention.py (MultiheadAttention.forward, self
attention), in float64: the QKV projection viewed as TE views it without interleaving
([(np/ng + 2), ng, hn]) and split along that dim, each query head h attending kv head
h // (np/ng) (DotProductAttention's GQA), softmax scale 1/sqrt(hn), the output projection."""

import math

import pytest
import torch

from fusegen import eager
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from tests.ops.test_attention_ops import fa2_tolerance
from tests.references import assert_close_to_reference
from tests.spec_packages import imported_package

HEAD = "import torch\nimport transformer_engine.pytorch as te\n"
# packed sequences, no attention dropout; TE's QKV layouts: its default (split query, key, value
# parameters), one fused weight with rows per GQA group (TE's default once fused), one [q | k | v]
FUSED = "attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False, qkv_format='thd'"
QKV_LAYOUTS = {"split": "", "interleaved": "fuse_qkv_params=True", "fused": "fuse_qkv_params=True, "
               "qkv_weight_interleaved=False"}
LENGTHS = [3, 1, 9, 5]  # packed sequences: odd, a single token, longer


# --- the float64 reference of TE's semantics ---------------------------------------------------------

def _norm(p, x, normalization, zcg, eps=1e-5):
    gamma = p["layernorm_qkv.layer_norm_weight"] + (1 if zcg else 0)  # TE stores gamma - 1 with zcg
    if normalization == "RMSNorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma + p["layernorm_qkv.layer_norm_bias"]


def _qkv_parameter(p, linear, name):
    """TE's LayerNormLinear/Linear weight (or bias) as its forward reads it: the one parameter, or
    with parameters_split (fuse_qkv_params=False) its query, key and value blocks concatenated
    (noop_cat, module/_common.py); None for a bias the module has not."""
    if f"{linear}.{name}" in p:
        return p[f"{linear}.{name}"]
    if f"{linear}.query_{name}" in p:
        return torch.cat([p[f"{linear}.{block}_{name}"] for block in ("query", "key", "value")])
    return None


def te_mha_reference(p, x, lengths, heads, groups, normalization, zcg, input_layernorm, causal, interleaved=False):
    """TE's MultiheadAttention forward on packed sequences (qkv_format 'thd'), float64;
    ``interleaved``: TE's qkv_weight_interleaved (fuse_qkv_params=True only: TE turns it off for
    split parameters, multi_head_attention.py __init__)."""
    total, hidden = x.shape
    hn = hidden // heads
    if input_layernorm:
        h, linear = _norm(p, x, normalization, zcg), "layernorm_qkv"
    else:
        h, linear = x, "qkv"
    bias = _qkv_parameter(p, linear, "bias")
    mixed = h @ _qkv_parameter(p, linear, "weight").T + (0 if bias is None else bias)
    per_group = heads // groups
    if interleaved:  # TE: [sq, b, ng, (np/ng + 2), hn], split along the second to last dim
        mixed = mixed.view(total, groups, per_group + 2, hn)
        q = mixed[:, :, :per_group].reshape(total, heads, hn)
        k, v = mixed[:, :, per_group], mixed[:, :, per_group + 1]
    else:  # TE: [sq, b, (np/ng + 2), ng, hn]
        mixed = mixed.view(total, per_group + 2, groups, hn)
        q = mixed[:, :per_group].reshape(total, heads, hn)
        k, v = mixed[:, per_group], mixed[:, per_group + 1]
    out = torch.zeros(total, heads, hn, dtype=x.dtype)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        for head in range(heads):
            kv = head // per_group
            scores = q[rows, head] @ k[rows, kv].T / math.sqrt(hn)
            if causal:
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[rows, head] = torch.softmax(scores, dim=-1) @ v[rows, kv]
        start += n
    y = out.reshape(total, hidden) @ p["proj.weight"].T
    return y + p["proj.bias"] if "proj.bias" in p else y


def te_mha_layout(hidden, heads, groups, normalization, bias, input_layernorm, split=False):
    """The state_dict TE's MultiheadAttention has (multi_head_attention.py __init__: layernorm_qkv a
    LayerNormLinear(hidden, hq + 2 hkv) with input_layernorm, else qkv a Linear, with ``split``
    (fuse_qkv_params=False) parameters_split {query: hq, key: hkv, value: hkv}, its weights then
    its biases (layernorm_linear.py); core_attention a DotProductAttention (a
    TransformerEngineBaseModule: its _extra_state, no parameters); proj a Linear(hq, hidden)),
    each TE module's _extra_state last (module/base.py)."""
    hn = hidden // heads
    qkv = (heads + 2 * groups) * hn
    blocks = {"query": heads * hn, "key": groups * hn, "value": groups * hn} if split else {"": qkv}
    layout = {}
    if input_layernorm:
        layout["layernorm_qkv.layer_norm_weight"] = (hidden,)
        if normalization != "RMSNorm":
            layout["layernorm_qkv.layer_norm_bias"] = (hidden,)
    linear = "layernorm_qkv" if input_layernorm else "qkv"
    for name, rows in blocks.items():
        layout[f"{linear}.{name}{'_' if name else ''}weight"] = (rows, hidden)
    for name, rows in blocks.items() if bias else ():
        layout[f"{linear}.{name}{'_' if name else ''}bias"] = (rows,)
    layout[f"{linear}._extra_state"] = (0,)
    layout["core_attention._extra_state"] = (0,)
    layout["proj.weight"] = (hidden, heads * hn)
    if bias:
        layout["proj.bias"] = (hidden,)
    layout["proj._extra_state"] = (0,)
    return layout


CASES = [  # (heads, num_gqa_groups, normalization, zero_centered_gamma, bias, input_layernorm, causal, QKV layout)
    (4, None, "LayerNorm", False, True, True, True, "split"),
    (8, 2, "RMSNorm", True, False, True, True, "interleaved"),
    (4, 1, "LayerNorm", False, True, False, False, "fused"),
    (8, 2, "LayerNorm", False, True, True, True, "split"),
    (4, 2, "RMSNorm", False, True, False, True, "interleaved"),
]


def _spec(heads, groups, normalization, zcg, bias, input_layernorm, causal, qkv):
    mask = "causal" if causal else "no_mask"
    return (HEAD + f"m = te.Sequential(te.MultiheadAttention(64, {heads}, attention_dropout=0.0, qkv_format='thd', "
            f"num_gqa_groups={groups}, normalization={normalization!r}, zero_centered_gamma={zcg}, bias={bias}, "
            f"input_layernorm={input_layernorm}, attn_mask_type={mask!r}, {QKV_LAYOUTS[qkv]}))\n")


def _checkpoint(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    return {f"0.{k}": torch.empty(0, dtype=torch.uint8) if k.endswith("_extra_state")
            else torch.randn(shape, generator=gen) * (0.3 if len(shape) == 2 else 1) for k, shape in layout.items()}


def _compare(module, run, checkpoint, case, seed):
    """y, dx and every parameter's grad of ``run(module, x)`` against te_mha_reference's by autograd."""
    heads, groups, normalization, zcg, bias, input_layernorm, causal, qkv = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENGTHS), 64, generator=gen)
    dy = torch.randn(sum(LENGTHS), 64, generator=gen)
    params64 = {k.removeprefix("0."): v.double().requires_grad_() for k, v in checkpoint.items()
                if not k.endswith("_extra_state")}
    x64 = x.double().requires_grad_()
    want = te_mha_reference(params64, x64, LENGTHS, heads, groups or heads, normalization, zcg, input_layernorm, causal,
                            interleaved=qkv == "interleaved")
    want.backward(dy.double())
    x = x.requires_grad_()
    y = run(module, x)
    y.backward(dy)
    assert_close_to_reference("y", y, want.detach(), torch.float32)
    assert_close_to_reference("dx", x.grad, x64.grad, torch.float32)
    grads = {k: p.grad for k, p in module.named_parameters()}
    assert sorted(grads) == sorted(f"0.{k}" for k in params64)  # every parameter has its grad compared
    for names in grad_groups(params64):
        got = torch.cat([grads[f"0.{name}"] for name in names])
        assert_close_to_reference(f"d{'+'.join(names)}", got, torch.cat([params64[n].grad for n in names]),
                                  torch.float32)


def grad_groups(names) -> list[tuple[str, ...]]:
    """The parameters whose grads are compared together: TE's query, key and value blocks of one
    projection as the one tensor the GEMM reads (the key bias's grad is zero in exact math, as a
    shift of every score of a query leaves its softmax unchanged: its roundoff is judged against
    the projection's grad, as it was while fused), every other parameter on its own."""
    groups = []
    for name in names:
        if ".query_" in name:
            groups.append(tuple(name.replace(".query_", f".{block}_") for block in ("query", "key", "value")))
        elif ".key_" not in name and ".value_" not in name:  # (those go with their query block)
            groups.append((name,))
    return groups


def _lengths():
    return torch.tensor(LENGTHS, dtype=torch.int32)


def _offsets():
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("case", CASES)
def test_multihead_attention_matches_te_s_semantics_names_and_checkpoint(tmp_path, case):
    heads, groups, normalization, zcg, bias, input_layernorm, causal, qkv = case
    layout = te_mha_layout(64, heads, groups or heads, normalization, bias, input_layernorm, split=qkv == "split")
    checkpoint = _checkpoint(layout, seed=5)
    eager_model = eager.Sequential(eager.MultiheadAttention(
        64, heads, attention_dropout=0.0, fuse_qkv_params=qkv != "split", qkv_weight_interleaved=qkv == "interleaved",
        qkv_format="thd", num_gqa_groups=groups, normalization=normalization, zero_centered_gamma=zcg, bias=bias,
        input_layernorm=input_layernorm, attn_mask_type="causal" if causal else "no_mask"))
    with imported_package(tmp_path, "spec.py", _spec(*case), "pkg") as pkg:
        module = pkg.M()
        # TE's keys and shapes, in TE's order; a TE checkpoint loads strictly into both
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {f"0.{k}": s for k, s in layout.items()}
        assert list(module.state_dict()) == list(eager_model.state_dict()) == list(checkpoint)
        module.load_state_dict(checkpoint)
        eager_model.load_state_dict(checkpoint)
        _compare(module, lambda m, x: m(x, seq_lens=_lengths()), checkpoint, case, seed=1)
    _compare(eager_model, lambda m, x: m[0](x, cu_seqlens=_offsets()), checkpoint, case, seed=1)


def test_the_qkv_layout_is_te_s_not_interleaved_one():
    """A weight whose rows are TE's [q heads | k heads | v heads]: the output of query head h is the
    attention of q head h on kv head h // (heads / groups). With v = the rows' own index and one
    token, attention returns v itself: proj = identity shows which kv head each q head read."""
    heads, groups, hn = 4, 2, 8
    model = eager.MultiheadAttention(heads * hn, heads, attention_dropout=0.0, fuse_qkv_params=True,
                                     qkv_weight_interleaved=False, qkv_format="thd", num_gqa_groups=groups,
                                     bias=False, params_dtype=torch.float64)
    with torch.no_grad():
        w = torch.zeros_like(model.qkv.weight)  # [(heads + 2 groups) hn, hidden]
        for g in range(groups):  # v head g's rows: the constant g + 1 read off feature 0
            w[(heads + groups + g) * hn:(heads + groups + g + 1) * hn, 0] = g + 1
        model.qkv.weight.copy_(w)
        model.proj.weight.copy_(torch.eye(heads * hn))
    x = torch.zeros(1, heads * hn, dtype=torch.float64)
    x[0, 0] = 1
    y = model(x, cu_seqlens=torch.tensor([0, 1], dtype=torch.int32)).reshape(heads, hn)
    assert y[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]  # q heads 0, 1 read kv head 0; 2, 3 kv head 1


def error(text):
    with pytest.raises(SpecError) as info:
        parse_spec(HEAD + text, "spec.py")
    return info.value


OK = "fuse_qkv_params=True, qkv_weight_interleaved=False, qkv_format='bshd'"


@pytest.mark.parametrize("call, at, says", [
    ("te.MultiheadAttention(64, 4, fuse_wgrad_accumulation=True, qkv_format='bshd')", "64",
     "fuse_wgrad_accumulation=True adds the QKV weight's grad into one weight's main_grad"),
    ("te.MultiheadAttention(64, 4, fuse_qkv_params=True, fuse_wgrad_accumulation=True, qkv_format='bshd')", "64",
     "with it pass fuse_qkv_params=True, qkv_weight_interleaved=False"),
    ("te.MultiheadAttention(64, 4, fuse_qkv_params=True, qkv_weight_interleaved=False, "
     "qkv_format='bhsd')", "'bhsd'", "must be 'sbhd' (x [seq, batch, hidden], TE's default), 'bshd'"),
    (f"te.MultiheadAttention(64, 4, {OK}, attention_type='cross')", "'cross'", "is cross-attention"),
    (f"te.MultiheadAttention(64, 4, {OK}, attn_mask_type='padding')", "'padding'", "must be 'causal' or 'no_mask'"),
    (f"te.MultiheadAttention(64, 4, {OK}, tp_size=0)", "0)", "must be positive"),
    (f"te.MultiheadAttention(64, 4, {OK}, window_size=(8, 0))", "8, 0", "sliding-window"),
    (f"te.MultiheadAttention(64, 4, {OK}, qk_norm_type='L2Normalization')", "'L2", "normalises q and k"),
    (f"te.MultiheadAttention(64, 4, {OK}, softmax_type='learnable')", "'learnable'", "the softmax"),
    (f"te.MultiheadAttention(64, 4, {OK}, return_bias=True)", "True)", "returns the bias unadded"),
    ("te.MultiheadAttention(64, 4, 32, 1.0, fuse_qkv_params=True, qkv_weight_interleaved=False, qkv_format='bshd')",
     "1.0", "must be a probability in [0, 1)"),  # TE's 4th positional: attention_dropout
])
def test_bad_arguments_are_refused_where_they_are_written(call, at, says):
    """A value's error points at the value; a refused default (not written) at the call."""
    err = error(f"m = te.Sequential({call})\n")
    assert says in err.message, err.message
    assert (err.location.line, err.location.col) == (3, 19 + call.rindex(at) if at != "64" else 19), str(err)


@pytest.mark.parametrize("call, says", [
    (f"te.MultiheadAttention(64, 4, {OK}, num_gqa_groups=3)", "num_gqa_groups=3 must divide num_attention_heads=4"),
    (f"te.MultiheadAttention(64, 4, {OK}, kv_channels=32)", "kv_channels=32"),
    (f"te.MultiheadAttention(60, 8, {OK})", "num_attention_heads=8 must divide hidden_size=60"),
    (f"te.MultiheadAttention(96, 8, {OK})", "multiples of 8 up to 256"),  # head_dim 12: FA2's head sizes
])
def test_inconsistent_sizes_are_refused_at_the_call(call, says):
    err = error(f"m = te.Sequential({call})\n")
    assert says in err.message, err.message
    assert (err.location.line, err.location.col) == (3, 19), str(err)


def test_the_eager_module_refuses_the_same_arguments():
    with pytest.raises(ValueError, match="adds the QKV weight's grad into one weight's main_grad"):
        eager.MultiheadAttention(64, 4, attention_dropout=0.0, fuse_wgrad_accumulation=True, qkv_format="thd")
    with pytest.raises(ValueError, match="is cross-attention"):
        eager.MultiheadAttention(64, 4, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False,
                                 qkv_format="thd", attention_type="cross")


def test_a_te_checkpoint_with_fp8_state_in_a_submodule_is_refused_with_what_to_do():
    model = eager.Sequential(eager.MultiheadAttention(64, 4, attention_dropout=0.0, fuse_qkv_params=True,
                                                      qkv_weight_interleaved=False, qkv_format="thd"))
    state = model.state_dict()
    state["0.proj._extra_state"] = torch.ones(8, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="FP8 scaling state .* strict=False"):
        model.load_state_dict(state)


def assert_close_fa2(what, got, ref, grouped):
    """A bf16 module through FlashAttention-2 against float64: TE's bf16 attention tolerance
    (test_attention_ops.fa2_tolerance, from TE's own attention tests) relative to max |ref|, as the
    attention pipelines' tests check (FA2 rounds P and dP to bf16 inside its kernels, more than 4
    units of the pipeline's roundoff allow)."""
    tol = fa2_tolerance(torch.bfloat16, grouped)
    err = (got.detach().double().cpu() - ref.detach()).abs().max().item()
    scale = ref.abs().max().item()
    assert math.isfinite(err) and err <= tol * scale, f"{what}: max |err| {err:.3e} > {tol} x {scale:.3e}"


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["te_gpt_attention", "te_gqa_attention"])
def test_the_shipped_te_attention_specs_in_bf16_against_float64(kind):
    """The shipped specs (specs/te_attention.py) on CUDA in bf16 (FlashAttention-2) against float64."""
    import generated
    module = getattr(generated, "".join(w.capitalize() for w in kind.split("_")))(device="cuda", dtype=torch.bfloat16)
    module.eval()  # TE's attention_dropout=0.1 off: the reference has none (tests/ops/test_attention_dropout.py)
    spec = "specs/te_attention.py"
    # te_gpt_attention: TE's split QKV parameters; te_gqa_attention: fused, TE's interleaved rows
    heads, groups, norm, bias = (4, 4, "LayerNorm", True) if kind == "te_gpt_attention" else (8, 2, "RMSNorm", False)
    layout = te_mha_layout(256, heads, groups, norm, bias, True, split=kind == "te_gpt_attention")
    assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {f"0.{k}": s for k, s in layout.items()}, spec
    gen = torch.Generator().manual_seed(2)
    for name, p in module.named_parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 2 else 1))
    lengths = [5, 1, 40, 18]
    x = torch.randn(sum(lengths), 256, generator=gen)
    dy = torch.randn(sum(lengths), 256, generator=gen)
    params64 = {k.removeprefix("0."): v.detach().double().cpu().requires_grad_()
                for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    x64 = x.double().requires_grad_()
    want = te_mha_reference(params64, x64, lengths, heads, groups, norm, False, True, True,
                            interleaved=kind == "te_gqa_attention")
    want.backward(dy.double())
    xc = x.to("cuda", torch.bfloat16).requires_grad_()
    if kind == "te_gpt_attention":  # qkv_format 'bshd': one sequence a batch row; run each alone
        y = torch.cat([module(part[None])[0] for part in xc.split(lengths)])
    else:
        y = module(xc, seq_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
    y.backward(dy.to("cuda", torch.bfloat16))
    grouped = groups != heads
    assert_close_fa2("y", y, want, grouped)
    assert_close_fa2("dx", xc.grad, x64.grad, grouped)
    grads = dict(module.named_parameters())
    for names in grad_groups(params64):  # TE's query, key, value blocks together (grad_groups says why)
        got = torch.cat([grads[f"0.{name}"].grad for name in names])
        assert_close_fa2(f"d{'+'.join(names)}", got, torch.cat([params64[n].grad for n in names]), grouped)


def test_return_layernorm_output_hands_out_the_norm_s_output_as_te():
    """TE returns (out, ln_out) with input_layernorm and return_layernorm_output; without the norm
    it has none to return and returns out alone (multi_head_attention.py, forward's end)."""
    model = eager.MultiheadAttention(64, 4, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False,
                                     qkv_format="thd", input_layernorm=True, return_layernorm_output=True,
                                     params_dtype=torch.float64)
    x = torch.randn(6, 64, dtype=torch.float64)
    y, ln = model(x, cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32))
    torch.testing.assert_close(ln, torch.nn.functional.layer_norm(x, (64,), model.layernorm_qkv.layer_norm_weight,
                                                                  model.layernorm_qkv.layer_norm_bias))
    p = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.testing.assert_close(y, te_mha_reference(p, x, [2, 4], 4, 4, "LayerNorm", False, True, True))
    plain = eager.MultiheadAttention(64, 4, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False,
                                     qkv_format="thd", return_layernorm_output=True)
    assert plain(x.float(), cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)).shape == (6, 64)
