"""TE's input formats for its attention modules (issue 39): qkv_format / attn_input_format "sbhd"
(TE's default: x [seq, batch, hidden], attention within each batch column), "bshd" (x [batch, seq,
hidden]) and "thd" (packed tokens [total, hidden]). An "sbhd" module runs batch-major rows inside
and returns a contiguous [seq, batch, hidden], as TE does. The float64 reference runs TE's
attention per batch column (tests/ops/test_te_attention.te_mha_reference on one sequence each)."""

import pytest
import torch

from fusegen import eager
from fusegen.errors import SpecError
from tests.ops.test_te_attention import assert_close_fa2, te_mha_layout, te_mha_reference
from tests.references import assert_close_to_reference
from tests.spec_packages import imported_package

HEAD = "import torch\nimport transformer_engine.pytorch as te\n"
SEQ, BATCH, HIDDEN, HEADS, GROUPS = 6, 3, 64, 4, 2
# TE's defaults but those other helpers of issue 39 own (dropout, separate q/k/v, interleaving)
FUSED = "attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False"


def _mha(fmt: str | None) -> str:
    form = "" if fmt is None else f", qkv_format={fmt!r}"  # None: TE's default, 'sbhd'
    return f"te.MultiheadAttention({HIDDEN}, {HEADS}, {FUSED}, num_gqa_groups={GROUPS}, input_layernorm=True{form})"


def _spec(fmt: str | None) -> str:
    return HEAD + f"m = te.Sequential({_mha(fmt)})\n"


def _checkpoint(seed=3):
    layout = te_mha_layout(HIDDEN, HEADS, GROUPS, "LayerNorm", True, True)
    gen = torch.Generator().manual_seed(seed)
    return {f"0.{k}": torch.empty(0, dtype=torch.uint8) if k.endswith("_extra_state")
            else torch.randn(shape, generator=gen) * (0.3 if len(shape) == 2 else 1) for k, shape in layout.items()}


def _params64(checkpoint):
    return {k.removeprefix("0."): v.double().requires_grad_() for k, v in checkpoint.items()
            if not k.endswith("_extra_state")}


def _reference_sbhd(params64, x64):
    """TE's attention on x [seq, batch, hidden]: each batch column one causal sequence, float64."""
    columns = [te_mha_reference(params64, x64[:, b], [SEQ], HEADS, GROUPS, "LayerNorm", False, True, True)
               for b in range(x64.shape[1])]
    return torch.stack(columns, dim=1)


def _check(module, x, dy, want, params64, x64):
    """y and the grads of x and every parameter of ``module`` at ``x`` against the float64 ones."""
    x = x.clone().requires_grad_()
    y = module(x)
    assert y.shape == want.shape and y.is_contiguous()
    y.backward(dy)
    assert_close_to_reference("y", y, want.detach(), torch.float32)
    assert_close_to_reference("dx", x.grad, x64.grad, torch.float32)
    grads = {k: p.grad for k, p in module.named_parameters()}
    assert sorted(grads) == sorted(f"0.{k}" for k in params64)
    for name, p in params64.items():
        assert_close_to_reference(f"d{name}", grads[f"0.{name}"], p.grad, torch.float32)
    return y, x.grad


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats")
    with imported_package(folder, "sbhd_spec.py", _spec(None), "sbhd_pkg") as sbhd, \
            imported_package(folder, "bshd_spec.py", _spec("bshd"), "bshd_pkg") as bshd, \
            imported_package(folder, "thd_spec.py", _spec("thd"), "thd_pkg") as thd:
        yield sbhd, bshd, thd


def test_te_s_default_sbhd_equals_bshd_on_the_transpose_and_the_reference(packages):
    sbhd_pkg, bshd_pkg, _ = packages
    checkpoint = _checkpoint()
    sbhd, bshd = sbhd_pkg.M(), bshd_pkg.M()
    sbhd.load_state_dict(checkpoint)
    bshd.load_state_dict(checkpoint)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    params64 = _params64(checkpoint)
    x64 = x.double().requires_grad_()
    want = _reference_sbhd(params64, x64)
    want.backward(dy.double())
    y_s, dx_s = _check(sbhd, x, dy, want, params64, x64)
    # the bshd module on the transpose: the same, transposed (fresh float64 grads for its parameters)
    params64 = _params64(checkpoint)
    x64 = x.double().requires_grad_()
    want = _reference_sbhd(params64, x64)
    want.backward(dy.double())
    y_b, dx_b = _check(lambda_module(bshd), x, dy, want, params64, x64)
    torch.testing.assert_close(y_s, y_b, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(dx_s, dx_b, rtol=1.3e-6, atol=1e-5)


class lambda_module(torch.nn.Module):
    """A bshd module called on x [seq, batch, hidden] transposed, its result transposed back."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.transpose(0, 1)).transpose(0, 1).contiguous()

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)


def test_the_eager_module_reads_sbhd_as_te_does():
    checkpoint = _checkpoint()
    model = eager.Sequential(eager.MultiheadAttention(
        HIDDEN, HEADS, attention_dropout=0.0, fuse_qkv_params=True, qkv_weight_interleaved=False,
        num_gqa_groups=GROUPS, input_layernorm=True))  # qkv_format left at TE's 'sbhd'
    model.load_state_dict(checkpoint)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    params64 = _params64(checkpoint)
    x64 = x.double().requires_grad_()
    want = _reference_sbhd(params64, x64)
    want.backward(dy.double())
    _check(model, x, dy, want, params64, x64)


@pytest.mark.parametrize("which, shape, seq_lens, says", [
    (0, (SEQ * BATCH, HIDDEN), None, r"qkv_format='sbhd' takes a 3-D x \[seq, batch, hidden\], as TE does, got \[18, 64\]"),
    (1, (SEQ * BATCH, HIDDEN), None, r"qkv_format='bshd' takes a 3-D x \[batch, seq, hidden\], as TE does"),
    (2, (BATCH, SEQ, HIDDEN), None, r"qkv_format='thd' takes a 2-D x \[total_tokens, hidden\] .*pass the lengths"),
    (0, (SEQ, BATCH, HIDDEN), [SEQ] * BATCH, r"seq_lens \(packed sequences\) takes qkv_format='thd'; this module's is 'sbhd'"),
])
def test_a_wrong_x_for_the_format_is_a_clear_error(packages, which, shape, seq_lens, says):
    module = packages[which].M()
    lengths = None if seq_lens is None else torch.tensor(seq_lens, dtype=torch.int32)
    with pytest.raises(ValueError, match=says):
        module(torch.randn(*shape), lengths)


def test_thd_reads_packed_sequences(packages):
    module = packages[2].M()
    checkpoint = _checkpoint()
    module.load_state_dict(checkpoint)
    lengths = [4, 1, 6]
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(sum(lengths), HIDDEN, generator=gen)
    params64 = _params64(checkpoint)
    want = te_mha_reference(params64, x.double(), lengths, HEADS, GROUPS, "LayerNorm", False, True, True)
    with torch.no_grad():
        y = module(x, torch.tensor(lengths, dtype=torch.int32))
    assert_close_to_reference("y", y, want.detach(), torch.float32)


def test_sbhd_compiles_without_graph_breaks(packages):
    module = packages[0].M()
    module.load_state_dict(_checkpoint())
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = module(x)
        torch.testing.assert_close(compiled(x), want, rtol=0, atol=0)
    y = compiled(x.clone().requires_grad_())
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert y.shape == (SEQ, BATCH, HIDDEN) and y.is_contiguous()


def test_attention_of_two_formats_in_one_pipeline_is_a_located_spec_error(tmp_path):
    spec = HEAD + f"m = te.Sequential(\n    {_mha('sbhd')},\n    {_mha('bshd')},\n)\n"
    with pytest.raises(SpecError) as info:
        with imported_package(tmp_path, "mixed.py", spec, "mixed_pkg"):
            pass
    err = info.value
    assert "must read x in one format (qkv_format)" in err.message and "'sbhd'" in err.message, err.message
    assert "'bshd'" in err.message and "give them all the same qkv_format" in err.message
    assert (err.location.file.endswith("mixed.py"), err.location.line, err.location.col) == (True, 5, 5), str(err)


# On CUDA in bf16, TE's default "sbhd" runs through the shipped specs/te_models.py GPT stack
# (tests/ops/test_te_models.py::test_te_stack_in_bf16_on_cuda: against float64, and trained as the
# hand-written Sequential): a package generated in a test has no binaries to launch there.


# --- TE's forward keywords (MultiheadAttention.forward / TransformerLayer.forward) ---------------

LENGTHS = [4, 1, 6]


def _offsets(lengths=LENGTHS):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("keywords", [
    dict(cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets()),
    dict(cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets(), max_seqlen_q=6, max_seqlen_kv=6),
    dict(cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets(), max_seqlen_q=8, max_seqlen_kv=8,
         attention_mask=None, self_attn_mask_type="causal", attn_mask_type="causal", window_size=(-1, 0)),
])
def test_te_s_keyword_call_form_equals_fusegen_s_and_the_reference(packages, keywords):
    module = packages[2].M()
    checkpoint = _checkpoint()
    module.load_state_dict(checkpoint)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(sum(LENGTHS), HIDDEN, generator=gen)
    dy = torch.randn(sum(LENGTHS), HIDDEN, generator=gen)
    params64 = _params64(checkpoint)
    x64 = x.double().requires_grad_()
    want = te_mha_reference(params64, x64, LENGTHS, HEADS, GROUPS, "LayerNorm", False, True, True)
    want.backward(dy.double())
    y_te, dx_te = _check(_Keywords(module, keywords), x, dy, want, params64, x64)
    module.zero_grad()
    params64 = _params64(checkpoint)
    x64 = x.double().requires_grad_()
    want = te_mha_reference(params64, x64, LENGTHS, HEADS, GROUPS, "LayerNorm", False, True, True)
    want.backward(dy.double())
    y_fg, dx_fg = _check(_Keywords(module, dict(seq_lens=torch.tensor(LENGTHS))), x, dy, want, params64, x64)
    torch.testing.assert_close(y_te, y_fg, rtol=0, atol=0)
    torch.testing.assert_close(dx_te, dx_fg, rtol=0, atol=0)


class _Keywords(torch.nn.Module):
    """``inner(x, **keywords)``, its parameters inner's."""

    def __init__(self, inner, keywords):
        super().__init__()
        self.inner, self.keywords = inner, keywords

    def forward(self, x):
        return self.inner(x, **self.keywords)

    def named_parameters(self, *args, **kwargs):
        return self.inner.named_parameters(*args, **kwargs)


@pytest.mark.parametrize("keywords, error, says", [
    (dict(cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets([4, 2, 5])), RuntimeError,
     "cu_seqlens_q and cu_seqlens_kv must be the same offsets"),
    (dict(cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets([11])), ValueError,
     r"must be the same offsets in self-attention \(pass both, or neither\), got \[4\] and \[2\]"),
    (dict(cu_seqlens_q=_offsets()), ValueError, r"pass both, or neither"),
    (dict(cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets(), max_seqlen_q=6, max_seqlen_kv=7), ValueError,
     r"max_seqlen_q \(6\) and max_seqlen_kv \(7\) must be equal"),
    (dict(cu_seqlens_q=_offsets() + 1, cu_seqlens_kv=_offsets() + 1), ValueError, "must start at 0"),
    (dict(attention_mask=torch.ones(3, 1, 6, 6, dtype=torch.bool)), ValueError, "attention_mask must be None"),
    (dict(self_attn_mask_type="no_mask"), ValueError,
     r"self_attn_mask_type='no_mask', but the module was built with \['causal'\]"),
    (dict(attn_mask_type="padding_causal"), ValueError, r"attn_mask_type='padding_causal', but the module"),
    (dict(window_size=(128, 0)), ValueError, r"no sliding window; leave it None or pass \[\(-1, 0\)\]"),
    (dict(seq_lens=torch.tensor(LENGTHS), cu_seqlens_q=_offsets(), cu_seqlens_kv=_offsets()), ValueError,
     "either fusegen's seq_lens / max_seqlen or TE's cu_seqlens_q"),
    (dict(max_seqlen=6, max_seqlen_q=6, max_seqlen_kv=6), ValueError, "not both"),
])
def test_te_s_keywords_refuse_what_fusegen_cannot_honour(packages, keywords, error, says):
    module = packages[2].M()
    x = torch.randn(sum(LENGTHS), HIDDEN)
    with pytest.raises(error, match=says):
        module(x, **keywords)


def test_te_s_keywords_name_the_mask_of_an_sbhd_module(packages):
    module = packages[0].M()
    module.load_state_dict(_checkpoint())
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        want = module(x)
        got = module(x, attention_mask=None, attn_mask_type="causal", window_size=(-1, 0))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
