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


@pytest.mark.parametrize("call, argument, value, says", [
    ("te.Linear(64, 64, return_bias=True)", "return_bias", "True", "returns the bias unadded"),
    ("te.Linear(64, 64, init_method=torch.nn.init.zeros_)", "init_method", "torch.nn.init.zeros_", "initialiser"),
    ("te.Linear(64, 64, delay_wgrad_compute=True)", "delay_wgrad_compute", "True", "backward_dw"),
    ("te.Linear(64, 64, False, False, None, 1, None, None, None, True, True)", "return_bias", "True",
     "returns the bias unadded"),  # TE's 11th positional
])
def test_an_argument_of_te_s_monolithic_module_is_refused_at_its_value(call, argument, value, says):
    """te.Linear's module-only arguments at another value than TE's default (module/linear.py)."""
    err = error(f"m = te.Sequential({call})\n")
    assert err.message.startswith(f"te.Linear(): argument '{argument}' is "), err.message
    assert says in err.message, err.message
    at = call.rindex(value) if "False, None" in call else call.index(value, call.index(argument))
    assert (err.location.line, err.location.col) == (2, 19 + at)


def test_te_s_module_spellings_take_te_s_positional_order_and_its_no_ops():
    """te.Linear(in, out, sequence_parallel, fuse_wgrad_accumulation, tp_group, tp_size, ...,
    params_dtype, parallel_mode, parameters_split, device) and te.LayerNorm/RMSNorm(normalized_shape,
    eps, sequence_parallel, params_dtype, zero_centered_gamma) as TE's modules order them; the
    module-only arguments at TE's defaults, and those TE ignores without parallelism at any value."""
    te_spelled = calls(
        "import torch\nimport transformer_engine.pytorch as te\n"
        "m = te.Sequential(te.LayerNorm(64, 1e-6, True, torch.float32, True),\n"
        "    te.Linear(64, 32, False, True, None, 1, None, 'stream', None, False, False, torch.float32, None, None,\n"
        "              'cpu', ub_overlap_ag=True, ub_name='qkv', name='fc', save_original_input=True),\n"
        "    te.RMSNorm(32, 1e-5, False))\n")
    as_te_ops = calls(
        "import torch\nimport transformer_engine.pytorch as te\n"
        "m = te.ops.Sequential(te.ops.LayerNorm(64, eps=1e-6, dtype=torch.float32, zero_centered_gamma=True),\n"
        "    te.ops.Linear(64, 32, bias=False, dtype=torch.float32, device='cpu', accumulate_into_main_grad=True),\n"
        "    te.ops.RMSNorm(32, eps=1e-5))\n")
    assert te_spelled == as_te_ops
    err = error("m = te.Sequential(te.LayerNorm(64, 1e-6, None, None, False, None, 7))\n")
    assert "te.LayerNorm() takes at most 6 positional arguments (TE's module: normalized_shape, eps" in err.message
    assert (err.location.line, err.location.col) == (2, 67)


def test_te_dot_product_attention_is_no_op_of_a_sequential():
    err = error("m = te.Sequential(te.DotProductAttention(4, 64))\n")
    assert err.message.startswith("te.DotProductAttention: TE's core attention takes query, key and value")
    assert "write te.MultiheadAttention" in err.message and (err.location.line, err.location.col) == (2, 19)


def test_te_ops_keeps_its_own_arguments_and_errors():
    # te.ops.Linear takes TE's parallel arguments at their defaults; spelled from te.ops, they are not refused
    assert calls("import transformer_engine.pytorch as te\n"
                 "m = te.ops.Sequential(te.ops.Linear(8, 4, sequence_parallel=False))\n")[0][0] == "Linear"
    # params_dtype is no te.ops argument: the binder's error, not the issue-39 one
    err = error("m = te.ops.Sequential(te.ops.Linear(8, 4, params_dtype=None))\n")
    assert "Linear() got an unexpected keyword argument 'params_dtype'" in err.message


def test_te_linear_s_third_positional_is_sequence_parallel_as_in_te_s_module():
    # TE's module takes sequence_parallel third (module/linear.py), not bias: read as TE reads it, and
    # its parallel arguments by TE's module's names and places (tensor_parallel.py splits them)
    for given in ("False", "True"):
        args = calls(f"import transformer_engine.pytorch as te\nm = te.Sequential(te.Linear(64, 64, {given}))\n")[0][1]
        assert (args["bias"], args["sequence_parallel"]) == (True, given == "True")
    args = calls("import transformer_engine.pytorch as te\ng = None\n"
                 "m = te.Sequential(te.Linear(64, 64, True, False, g, 2, parallel_mode='row'))\n")[0][1]
    assert (args["tensor_parallel_group"], args["tp_size"], args["parallel_mode"]) == ("g", 2, "row")


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
    test_te_attention.py, test_te_transformer_layer.py) but te.DotProductAttention, which is no op
    of a Sequential; the refusal of one that is not stays."""
    from fusegen.ops.te_namespace import MODULES_NOT_YET
    assert list(MODULES_NOT_YET) == ["DotProductAttention"]
    monkeypatch.setitem(MODULES_NOT_YET, "FutureLayer", "this TE module is not supported yet")
    err = error("m = te.Sequential(te.FutureLayer(64, 64))\n")
    assert err.message.startswith("te.FutureLayer: this TE module is not supported yet")
    assert (err.location.line, err.location.col) == (2, 19)
