"""Residual(*ops) in a spec: its spellings, nesting, and the errors at the call."""

import textwrap

import pytest

from spec_errors import assert_points_at

from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.ops import RESIDUAL, op_named
from fusegen.pipeline import build_pipeline


def parse(source):
    return parse_spec(textwrap.dedent(source), "spec.py")


@pytest.mark.parametrize("source", [
    "import transformer_engine.pytorch as te\n"
    "m = te.ops.Sequential(te.ops.Residual(te.ops.RMSNorm(8), te.ops.Linear(8, 8)))\n",
    "import transformer_engine.pytorch as te\n"  # the design note's spelling
    "m = te.ops.Sequential(te.Residual(te.ops.RMSNorm(8), te.ops.Linear(8, 8)))\n",
    "from transformer_engine.pytorch.ops import Sequential, Residual as R, RMSNorm, Linear\n"
    "m = Sequential(R(RMSNorm(8), Linear(8, 8)))\n",
    "from fusegen.eager import *\nm = Sequential(Residual(RMSNorm(8), Linear(8, 8)))\n",
])
def test_residual_spellings_read_the_same(source):
    (spec,) = parse(source)
    (call,) = spec.calls
    assert call.op == RESIDUAL and call.args == {}
    assert [c.op for c in call.inner] == ["RMSNorm", "Linear"]
    assert call.inner[1].args["in_features"] == 8
    assert (call.location.line, call.inner[0].location.line) == (2, 2)


def test_residuals_nest_with_their_locations():
    (spec,) = parse("""\
        from fusegen.eager import Sequential, Residual, LayerNorm, Linear, GELU
        m = Sequential(
            Linear(8, 8),
            Residual(
                LayerNorm(8),
                Residual(GELU()),
            ),
        )
        """)
    outer = spec.calls[1]
    assert (outer.op, outer.location.line, outer.location.col) == (RESIDUAL, 4, 5)
    inner = outer.inner[1]
    assert (inner.op, inner.location.line, [c.op for c in inner.inner]) == (RESIDUAL, 6, ["GELU"])


E = "from fusegen.eager import Sequential, Residual, LayerNorm, Linear, GELU, AddExtraInput, MakeExtraOutput\n"


@pytest.mark.parametrize("source, line, col, at, message", [
    (E + "m = Sequential(Residual())\n", 2, 16, "Residual()",
     "Residual() is empty; give it the ops of the residual branch"),
    (E + "m = Sequential(Residual(GELU(), 3))\n", 2, 33, "3", "Residual(...) takes op calls like"),
    (E + "m = Sequential(Residual(GELU(), op=GELU()))\n", 2, 33, "op=", "Residual(...) takes op calls like"),
    (E + "m = Sequential(Residual(Sequential(GELU())))\n", 2, 25, "Sequential(GELU())",
     "Sequential(...) cannot be nested in Residual(...)"),
    (E + "m = Sequential(Residual(GELU(), AddExtraInput()))\n", 2, 33, "AddExtraInput()",
     "Residual(...) cannot hold AddExtraInput() (an extra input or output of the pipeline) yet"),
    (E + "m = Sequential(Residual(Residual(MakeExtraOutput())))\n", 2, 34, "MakeExtraOutput()",
     "Residual(...) cannot hold MakeExtraOutput()"),
    ("import torch\n" + E + "m = Sequential(Residual(torch.nn.Softmax(dim=-1)))\n", 3, 25, "torch.nn.Softmax",
     "Residual(...) cannot hold a module of your code yet"),
    ("from fusegen.eager import Sequential, Residual, Reshape, GELU\n"
     "m = Sequential(Residual(Reshape((-1, 16)), GELU(), Reshape((-1, 8))))\n", 2, 25, "Reshape((-1, 16))",
     "Residual(...) cannot hold Reshape() (a reshape of the running value) yet"),
    (E + "m = Sequential(Residual(LayerNorm(8), Linear(8, 16)))\n", 2, 16, "Residual(",
     "Residual(...) adds its ops' output to its input, so they must give back the 8 features they receive, "
     "but they make 16"),
    (E + "m = Sequential(Residual(Residual(Linear(8, 4))), Linear(4, 4))\n", 2, 25, "Residual(Linear",
     "must give back the 8 features they receive, but they make 4"),
    (E + "m = Sequential(Residual(LayerNorm(8)), Linear(16, 4))\n", 2, 40, "Linear(16",
     "Linear() expects 16 input features, but the op before it"),
])
def test_bad_residuals_are_errors_at_the_call(source, line, col, at, message):
    with pytest.raises(SpecError) as info:
        build_pipeline(parse_spec(source, "spec.py")[0])
    assert message in info.value.message, info.value.message
    assert_points_at(info.value, source, line, col, at)


def test_residual_is_not_spelled_from_torch_nn():
    """torch.nn has no Residual (a class of that name there would be a module run as it is)."""
    assert op_named("torch.nn", "Residual") is None
    assert op_named("transformer_engine.pytorch", "Residual") == RESIDUAL
    assert op_named("fusegen.eager", "Residual") == RESIDUAL
