"""te.TransformerLayer as a macro (issue 39): an encoder layer expands to its self-attention and
MLP in residual branches, keeps TE's nested parameter names and computes TE's semantics. The
float64 reference is written from TE's transformer_engine/pytorch/transformer.py
(TransformerLayer.forward, an encoder: bias_dropout_add(block output, residual) after each block,
the residual being the block's input, or its norm's output with
apply_residual_connection_post_layernorm; output_layernorm: no input norm in the attention, a last
norm on the output), with te.MultiheadAttention's reference (test_te_attention.py)."""

import pytest
import torch

from fusegen import eager
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from tests.ops.test_te_attention import (LENGTHS, QKV_LAYOUTS, _norm, assert_close_fa2, grad_groups, te_mha_layout,
                                        te_mha_reference)
from tests.ops.test_te_modules import _activation, te_layernorm_mlp_layout
from tests.references import assert_close_to_reference
from tests.spec_packages import imported_package

HEAD = "import torch\nimport transformer_engine.pytorch as te\n"
FUSED = "attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False, attn_input_format='thd'"
PACKED = "attention_dropout=0.0, attn_input_format='thd'"  # with one of QKV_LAYOUTS' QKV arguments
HIDDEN, FFN = 64, 96


def _sub(p, prefix):
    return {k.removeprefix(prefix): v for k, v in p.items() if k.startswith(prefix)}


def _mlp(p, h, normalization, activation, zcg, with_norm=True):
    """te.LayerNormMLP (layernorm_mlp.py): norm, fc1, activation, fc2; also the norm's output."""
    gamma = p["layer_norm_weight"] + (1 if zcg else 0)
    if normalization == "RMSNorm":
        ln = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-5) * gamma
    else:
        ln = torch.nn.functional.layer_norm(h, (h.shape[-1],), gamma, p["layer_norm_bias"], 1e-5)
    t = ln @ p["fc1_weight"].T + p.get("fc1_bias", 0)
    return _activation(activation, t) @ p["fc2_weight"].T + p.get("fc2_bias", 0), ln


def te_layer_reference(p, x, case, lengths=tuple(LENGTHS), interleaved=False):
    """TE's TransformerLayer forward in float64 (``interleaved``: fused QKV rows per GQA group)."""
    heads, groups, normalization, activation, zcg, bias, post, output_ln, causal = case
    attn = _sub(p, "self_attention.")
    mha = dict(interleaved=interleaved)
    if output_ln:  # the attention has no input norm (input_layernorm=not output_layernorm)
        h = x + te_mha_reference(attn, x, lengths, heads, groups, normalization, zcg, False, causal, **mha)
    elif post:  # the residual is the norm's output
        n1 = _norm(attn, x, normalization, zcg)
        plain = {k.replace("layernorm_qkv.", "qkv."): v for k, v in attn.items() if "layer_norm_" not in k}
        h = n1 + te_mha_reference(plain, n1, lengths, heads, groups, normalization, zcg, False, causal, **mha)
    else:
        h = x + te_mha_reference(attn, x, lengths, heads, groups, normalization, zcg, True, causal, **mha)
    m, ln2 = _mlp(_sub(p, "layernorm_mlp."), h, normalization, activation, zcg)
    y = (ln2 if post else h) + m
    if output_ln:
        gamma = p["layernorm.weight"] + (1 if zcg else 0)
        if normalization == "RMSNorm":
            y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + 1e-5) * gamma
        else:
            y = torch.nn.functional.layer_norm(y, (HIDDEN,), gamma, p["layernorm.bias"], 1e-5)
    return y


def te_layer_layout(case, split=False):
    """TE's TransformerLayer state_dict (transformer.py __init__: self_attention a MultiheadAttention
    with input_layernorm=not output_layernorm; layernorm_mlp a LayerNormMLP; with output_layernorm
    layernorm a te.LayerNorm or RMSNorm: weight, bias unless RMSNorm, its _extra_state)."""
    heads, groups, normalization, activation, zcg, bias, post, output_ln, causal = case
    layout = {f"self_attention.{k}": s for k, s in te_mha_layout(HIDDEN, heads, groups, normalization, bias,
                                                                 not output_ln, split).items()}
    layout.update({f"layernorm_mlp.{k}": s for k, s in te_layernorm_mlp_layout(HIDDEN, FFN, normalization, activation,
                                                                                bias).items()})
    if output_ln:
        layout["layernorm.weight"] = (HIDDEN,)
        if normalization != "RMSNorm":
            layout["layernorm.bias"] = (HIDDEN,)
        layout["layernorm._extra_state"] = (0,)
    return layout


CASES = [  # heads, groups, normalization, activation, zcg, bias, post-LN residual, output_layernorm, causal
    (4, 4, "LayerNorm", "gelu", False, True, False, False, True),  # GPT
    (8, 2, "RMSNorm", "swiglu", True, False, False, False, True),  # Llama (no rotary)
    (4, 1, "LayerNorm", "relu", False, True, True, False, False),  # post-layernorm residuals
    (4, 2, "RMSNorm", "gelu", False, True, False, True, True),  # output_layernorm
]
CASE_QKV = ["split", "interleaved", "fused", "split"]  # each case's QKV layout (test_te_attention.QKV_LAYOUTS)


def _keywords(case):
    heads, groups, normalization, activation, zcg, bias, post, output_ln, causal = case
    return dict(num_gqa_groups=groups, normalization=normalization, activation=activation, zero_centered_gamma=zcg,
                bias=bias, apply_residual_connection_post_layernorm=post, output_layernorm=output_ln,
                self_attn_mask_type="causal" if causal else "no_mask")


def _spec(case, dropout=0.0, qkv="fused"):
    keywords = ", ".join(f"{k}={v!r}" for k, v in _keywords(case).items())
    layout = f", {QKV_LAYOUTS[qkv]}" if QKV_LAYOUTS[qkv] else ""
    return HEAD + (f"m = te.Sequential(te.TransformerLayer({HIDDEN}, {FFN}, {case[0]}, hidden_dropout={dropout}, "
                   f"{PACKED}, {keywords}{layout}))\n")


def _eager(case, dropout=0.0, qkv="fused"):
    return eager.Sequential(eager.TransformerLayer(
        HIDDEN, FFN, case[0], hidden_dropout=dropout, attention_dropout=0.0, fuse_qkv_params=qkv != "split",
        qkv_weight_interleaved=qkv == "interleaved", attn_input_format="thd", **_keywords(case)))


def _checkpoint(layout, seed):
    gen = torch.Generator().manual_seed(seed)
    return {f"0.{k}": torch.empty(0, dtype=torch.uint8) if k.endswith("_extra_state")
            else torch.randn(shape, generator=gen) * (0.2 if len(shape) == 2 else 1) for k, shape in layout.items()}


def _compare(module, run, checkpoint, case, qkv="fused"):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(LENGTHS), HIDDEN, generator=gen)
    dy = torch.randn(sum(LENGTHS), HIDDEN, generator=gen)
    params64 = {k.removeprefix("0."): v.double().requires_grad_() for k, v in checkpoint.items()
                if not k.endswith("_extra_state")}
    x64 = x.double().requires_grad_()
    want = te_layer_reference(params64, x64, case, interleaved=qkv == "interleaved")
    want.backward(dy.double())
    x = x.requires_grad_()
    y = run(module, x)
    y.backward(dy)
    assert_close_to_reference("y", y, want.detach(), torch.float32)
    assert_close_to_reference("dx", x.grad, x64.grad, torch.float32)
    grads = {k: p.grad for k, p in module.named_parameters()}
    assert sorted(grads) == sorted(f"0.{k}" for k in params64)
    for names in grad_groups(params64):  # TE's query, key, value blocks together (grad_groups says why)
        got = torch.cat([grads[f"0.{name}"] for name in names])
        assert_close_to_reference(f"d{'+'.join(names)}", got, torch.cat([params64[n].grad for n in names]),
                                  torch.float32)


def _offsets():
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("case, qkv", zip(CASES, CASE_QKV))
def test_transformer_layer_matches_te_s_semantics_names_and_checkpoint(tmp_path, case, qkv):
    layout = te_layer_layout(case, split=qkv == "split")
    checkpoint = _checkpoint(layout, seed=6)
    eager_model = _eager(case, qkv=qkv)
    with imported_package(tmp_path, "spec.py", _spec(case, qkv=qkv), "pkg") as pkg:
        module = pkg.M()
        assert {k: tuple(v.shape) for k, v in module.state_dict().items()} == {f"0.{k}": s for k, s in layout.items()}
        assert list(module.state_dict()) == list(eager_model.state_dict()) == list(checkpoint)
        module.load_state_dict(checkpoint)  # strict: TE's keys, no other
        eager_model.load_state_dict(checkpoint)
        lengths = torch.tensor(LENGTHS, dtype=torch.int32)
        _compare(module, lambda m, x: m(x, seq_lens=lengths), checkpoint, case, qkv)
    _compare(eager_model, lambda m, x: m[0](x, cu_seqlens=_offsets()), checkpoint, case, qkv)


def test_hidden_dropout_drops_each_block_s_output_in_training_and_nothing_in_eval(tmp_path):
    """hidden_dropout: a Dropout after each block, before its residual add (TE's bias_dropout_add)."""
    case = CASES[0]
    checkpoint = _checkpoint(te_layer_layout(case), seed=2)
    with imported_package(tmp_path, "spec.py", _spec(case, dropout=0.5), "pkg") as pkg:
        plan = (tmp_path / "pkg" / "m.plan.md").read_text()
        assert plan.count("`Dropout(0.5)`") == 2, plan
        module = pkg.M()
        module.load_state_dict(checkpoint)
        module.eval()  # no dropout: the reference
        _compare(module, lambda m, x: m(x, seq_lens=torch.tensor(LENGTHS, dtype=torch.int32)), checkpoint, case)
        module.train()
        x = torch.randn(sum(LENGTHS), HIDDEN)
        with torch.no_grad():
            trained = module(x, seq_lens=torch.tensor(LENGTHS, dtype=torch.int32))
            module.eval()
            evaluated = module(x, seq_lens=torch.tensor(LENGTHS, dtype=torch.int32))
        assert not torch.allclose(trained, evaluated)


def error(text):
    with pytest.raises(SpecError) as info:
        parse_spec(HEAD + text, "spec.py")
    return info.value


OK = "fuse_qkv_params=True, qkv_weight_interleaved=False, attn_input_format='bshd'"


@pytest.mark.parametrize("call, at, says", [
    (f"te.TransformerLayer(64, 96, 4, {OK}, layer_type='decoder')", "'decoder'", "is a decoder layer"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, parallel_attention_mlp=True)", "True", "Falcon"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, drop_path_rate=0.1)", "0.1", "stochastic depth"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, tp_size=0)", "0)", "must be positive"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, self_attn_mask_type='padding')", "'padding'", "must be 'causal'"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, activation='tanh')", "'tanh'", "must be one of TE's activations"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, hidden_dropout=1.0)", "1.0", "must be in [0, 1)"),
    ("te.TransformerLayer(64, 96, 4, 2, 1e-5, 0.1, 1.0, fuse_qkv_params=True, qkv_weight_interleaved=False, "
     "attn_input_format='bshd')", "1.0, fuse", "must be a probability in [0, 1)"),  # TE's 7th positional
    ("te.TransformerLayer(64, 96, 4, fuse_qkv_params=True, qkv_weight_interleaved=False, "
     "attn_input_format='bhsd')", "'bhsd'", "must be 'sbhd' (x [seq, batch, hidden], TE's default), 'bshd'"),
    ("te.TransformerLayer(64, 96, 4, fuse_wgrad_accumulation=True, attn_input_format='thd')",
     "64", "fuse_wgrad_accumulation=True adds the QKV weight's grad into one weight's main_grad"),
    (f"te.TransformerLayer(64, 96, 4, {OK}, num_gqa_groups=3)", "64", "num_gqa_groups=3 must divide"),
])
def test_bad_arguments_are_refused_where_they_are_written(call, at, says):
    """A value's error at the value; a refused default or sizes that do not fit at the call."""
    err = error(f"m = te.Sequential({call})\n")
    assert says in err.message, err.message
    want = 19 if at == "64" else 19 + call.rindex(at)
    assert (err.location.line, err.location.col) == (3, want), str(err)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["te_gpt_layer", "te_llama_layer"])
def test_the_shipped_te_layer_specs_in_bf16_against_float64(kind):
    """specs/te_transformer_layer.py on CUDA in bf16 (FlashAttention-2) against float64, every
    parameter's grad (eval: te_gpt_layer's dropout off)."""
    import generated
    module = getattr(generated, "".join(w.capitalize() for w in kind.split("_")))(device="cuda", dtype=torch.bfloat16)
    module.eval()
    heads, groups, norm, act, bias = (4, 4, "LayerNorm", "gelu", True) if kind == "te_gpt_layer" else (
        8, 2, "RMSNorm", "swiglu", False)
    gen = torch.Generator().manual_seed(2)
    for p in module.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if p.dim() == 2 else 1))
    lengths = [5, 1, 40, 18]
    x = torch.randn(sum(lengths), 256, generator=gen)
    dy = torch.randn(sum(lengths), 256, generator=gen)
    params64 = {k.removeprefix("0."): v.detach().double().cpu().requires_grad_()
                for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    x64 = x.double().requires_grad_()
    # te_gpt_layer: TE's split QKV parameters; te_llama_layer: fused, TE's interleaved rows
    want = te_layer_reference(params64, x64, (heads, groups, norm, act, False, bias, False, False, True), lengths,
                              interleaved=kind == "te_llama_layer")
    want.backward(dy.double())
    xc = x.to("cuda", torch.bfloat16).requires_grad_()
    if kind == "te_gpt_layer":  # attn_input_format 'bshd': each sequence a batch of one
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


def _stage_rows(plan_md):
    """The plan's stage tables without their op numbers: (rule, runs as, bytes/token) per stage."""
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in plan_md.splitlines()
            if line.startswith("| ")]
    return [row[2:] for row in rows if len(row) == 5 and row[0].isdigit()]


@pytest.mark.parametrize("module, chain", [
    (f"te.TransformerLayer(64, 96, 4, hidden_dropout=0.0, {FUSED})",
     "te.Residual(te.LayerNorm(64), te.Linear(64, 192), te.GroupedQueryAttention(64, 4, 4, qkv_format='thd'), te.Linear(64, 64)), "
     "te.Residual(te.LayerNorm(64), te.Linear(64, 96), te.GELU(), te.Linear(96, 64))"),
    (f"te.TransformerLayer(64, 128, 8, num_gqa_groups=2, hidden_dropout=0.0, {FUSED}, bias=False, "
     "normalization='RMSNorm', activation='swiglu')",
     "te.Residual(te.RMSNorm(64), te.Linear(64, 96, bias=False), te.GroupedQueryAttention(64, 8, 2, qkv_format='thd'), "
     "te.Linear(64, 64, bias=False)), te.Residual(te.RMSNorm(64), te.Linear(64, 256, bias=False), te.SwiGLU(), "
     "te.Linear(128, 64, bias=False))"),
    (f"te.MultiheadAttention(64, 4, input_layernorm=True, {FUSED.replace('attn_input_format', 'qkv_format')})",
     "te.LayerNorm(64), te.Linear(64, 192), te.GroupedQueryAttention(64, 4, 4, qkv_format='thd'), "
     "te.Linear(64, 64)"),
])
def test_a_te_layer_plans_as_the_hand_written_chain_of_its_ops(tmp_path, module, chain):
    """The macro fuses exactly as the te.ops chain (with te.Residual) it stands for (its attention op
    reading x as the module does, so both take TE's per-call rotary table)."""
    from fusegen import build
    (tmp_path / "spec.py").write_text(HEAD + f"a = te.Sequential({module})\nb = te.Sequential({chain})\n")
    config = build.Config((tmp_path / "spec.py",), tmp_path / "pkg", archs=(), dtypes=("float32",), root=tmp_path)
    plans = build.plan_documents(config)
    assert _stage_rows(plans["a"]) == _stage_rows(plans["b"]) and len(_stage_rows(plans["a"])) >= 6
