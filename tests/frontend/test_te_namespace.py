"""The design note's spellings: ``import transformer_engine.pytorch as te`` and ``te.Sequential``,
``te.RMSNorm``, ``te.Linear``, ``te.SwiGLU``, ... mean the te.ops ops of the same names, with their
arguments; an argument only TE's monolithic module takes (issue 39) is refused where it is written."""

import pytest

from fusegen.errors import SpecError
from fusegen.frontend import parse_spec

NOTE_MLP = """\
import torch
import transformer_engine.pytorch as te
mlp = te.Sequential(
    te.RMSNorm(64, eps=1e-6),
    te.Linear(64, 2 * 96, bias=False),
    te.SwiGLU(),
    te.Linear(96, 64, bias=False),
    te.LayerNorm(64, zero_centered_gamma=True, dtype=torch.bfloat16),
    te.Linear(64, 64, device="cpu"),
    te.GELU(),
    te.Dropout(0.25),
    te.ConstantScale(0.5),
)
"""


def calls(text):
    (spec,) = parse_spec(text, "spec.py")
    return [(call.op, call.args) for call in spec.calls]


def test_the_note_spelling_means_the_te_ops_ops_with_their_arguments():
    as_te_ops = NOTE_MLP.replace("te.", "te.ops.").replace("te.ops.ops.", "te.ops.")
    assert "te.ops.Sequential(" in as_te_ops and "te.ops.SwiGLU()" in as_te_ops
    got, want = calls(NOTE_MLP), calls(as_te_ops)
    assert got == want
    assert [op for op, _ in got] == ["RMSNorm", "Linear", "SwiGLU", "Linear", "LayerNorm", "Linear", "GELU",
                                     "Dropout", "ConstantScale"]
    assert got[1][1]["bias"] is False and got[1][1]["out_features"] == 192
    assert got[4][1]["zero_centered_gamma"] is True and got[5][1]["device"] == "cpu"


def test_the_note_spelling_imports_by_name_and_by_star():
    named = calls("from transformer_engine.pytorch import Sequential, RMSNorm, Linear, GELU\n"
                  "m = Sequential(RMSNorm(32), Linear(32, 16), GELU())\n")
    star = calls("from transformer_engine.pytorch import *\nm = Sequential(RMSNorm(32), Linear(32, 16), GELU())\n")
    te_ops = calls("import transformer_engine.pytorch as te\n"
                   "m = te.ops.Sequential(te.ops.RMSNorm(32), te.ops.Linear(32, 16), te.ops.GELU())\n")
    assert named == star == te_ops
    assert [op for op, _ in named] == ["RMSNorm", "Linear", "GELU"]


def error(text):
    with pytest.raises(SpecError) as info:
        parse_spec("import transformer_engine.pytorch as te\n" + text, "spec.py")
    return info.value


@pytest.mark.parametrize("call, argument", [
    ("te.Linear(64, 64, return_bias=True)", "return_bias"),
    ("te.Linear(64, 64, parallel_mode='column')", "parallel_mode"),
    ("te.Linear(64, 64, tp_size=1)", "tp_size"),
    ("te.LayerNorm(64, sequence_parallel=False)", "sequence_parallel"),
])
def test_an_argument_of_te_s_monolithic_module_is_refused_at_it(call, argument):
    err = error(f"m = te.Sequential({call})\n")
    assert f"te.{call.split('(')[0][3:]}(): '{argument}' is an argument of Transformer Engine's monolithic module" \
        in err.message
    assert "that fusegen gives no meaning yet" in err.message
    assert err.message.endswith(f"leave '{argument}' out"), err.message
    assert (err.location.line, err.location.col) == (2, 19 + call.index(argument))


def test_te_ops_keeps_its_own_arguments_and_errors():
    # te.ops.Linear takes TE's parallel arguments at their defaults; spelled from te.ops, they are not refused
    assert calls("import transformer_engine.pytorch as te\n"
                 "m = te.ops.Sequential(te.ops.Linear(8, 4, sequence_parallel=False))\n")[0][0] == "Linear"
    # params_dtype is no te.ops argument: the binder's error, not the issue-39 one
    err = error("m = te.ops.Sequential(te.ops.Linear(8, 4, params_dtype=None))\n")
    assert "Linear() got an unexpected keyword argument 'params_dtype'" in err.message


def test_te_linear_s_bias_is_keyword_only_as_in_te_ops():
    # TE's module takes sequence_parallel third: a positional bias would mean something else there
    err = error("m = te.Sequential(te.Linear(64, 64, False))\n")
    assert "Linear() takes 2 positional arguments but 3 were given; pass bias" in err.message
    assert (err.location.line, err.location.col) == (2, 37)


def test_te_module_arguments_with_a_meaning_are_read_as_te_ops_ones():
    """TE's modules' params_dtype is te.ops' dtype, a norm's hidden_size its normalized_shape."""
    got = calls("import torch\nimport transformer_engine.pytorch as te\nm = te.Sequential(\n"
                "    te.RMSNorm(hidden_size=64, params_dtype=torch.bfloat16),\n"
                "    te.LayerNorm(hidden_size=64, eps=1e-6),\n"
                "    te.Linear(64, 32, params_dtype=torch.float16, fuse_wgrad_accumulation=True))\n")
    want = calls("import torch\nimport transformer_engine.pytorch as te\nm = te.Sequential(\n"
                 "    te.RMSNorm(64, dtype=torch.bfloat16),\n"
                 "    te.LayerNorm(64, eps=1e-6),\n    te.Linear(64, 32, dtype=torch.float16, accumulate_into_main_grad=True))\n")
    assert got == want and got[0][1]["dtype"].name == "bfloat16" and got[2][1]["accumulate_into_main_grad"] is True
    err = error("m = te.Sequential(te.RMSNorm(64, hidden_size=64))\n")  # the same argument twice
    assert "got multiple values for argument 'normalized_shape'" in err.message
    assert (err.location.line, err.location.col) == (2, 34)


def test_te_s_modules_not_yet_supported_say_so_at_the_call(monkeypatch):
    """Every TE module is a macro now (te.MultiheadAttention, te.TransformerLayer: tests/ops/
    test_te_attention.py, test_te_transformer_layer.py); the refusal of one that is not stays."""
    from fusegen.ops.te_namespace import MODULES_NOT_YET
    assert not MODULES_NOT_YET
    monkeypatch.setitem(MODULES_NOT_YET, "FutureLayer", "this TE module is not supported yet")
    err = error("m = te.Sequential(te.FutureLayer(64, 64))\n")
    assert err.message.startswith("te.FutureLayer: this TE module is not supported yet")
    assert (err.location.line, err.location.col) == (2, 19)
