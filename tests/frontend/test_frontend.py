"""The spec frontend: spellings, aliases, constant folding, and every SpecError with its location."""

import textwrap

import pytest

from spec_errors import assert_points_at

from fusegen.ops import NOT_YET, OPS
from fusegen.ops.linear import MAIN_GRAD
from fusegen.ops.opdef import (CACHE_QUANTIZED_INPUT, LINEAR_PARALLEL, MODULE_PARALLEL_MODE, SM_MARGIN, TENSOR_PARALLEL,
                               TP_SIZE, TorchDtype)
from fusegen.errors import SpecError
from fusegen.frontend import OpCall, SequentialSpec, parse_spec, parse_spec_file
from fusegen.pipeline import build_pipeline

EAGER = "from fusegen.eager import Sequential, Linear, LayerNorm, GELU, ConstantScale, AddExtraInput\n"
KNOWN = "known ops: " + ", ".join(sorted({op.attribute for op in OPS.values() if op.modules}))


def parse(source):
    return parse_spec(textwrap.dedent(source), "spec.py")


# TE's no-op performance hints and parameter placement, at their defaults
# TE arguments with no effect at their defaults: hints, placement, and the parallelism and
# main-grad options of linears and biases
HINTS = {CACHE_QUANTIZED_INPUT.name: False, SM_MARGIN.name: 0, "device": None, "dtype": None,
         **{a.name: a.default for a in (*LINEAR_PARALLEL, TENSOR_PARALLEL, MAIN_GRAD, MODULE_PARALLEL_MODE, TP_SIZE)}}
LINEAR_DEFAULTS = {a.name: a.default for a in (*LINEAR_PARALLEL, MAIN_GRAD, MODULE_PARALLEL_MODE, TP_SIZE)}


def ops(spec):
    """(op, args) of each call, TE's no-op hints left out where they are at their defaults
    (test_te_hints_are_accepted checks them)."""
    return [(c.op, {k: v for k, v in c.args.items() if HINTS.get(k, object()) != v}) for c in spec.calls]


# --- spellings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("source", [
    """
    import transformer_engine.pytorch as te
    m = te.ops.Sequential(te.ops.Linear(8, 4), te.ops.GELU())
    """,
    """
    import transformer_engine.pytorch
    m = transformer_engine.pytorch.ops.Sequential(transformer_engine.pytorch.ops.Linear(8, 4),
                                                  transformer_engine.pytorch.ops.GELU())
    """,
    """
    from transformer_engine.pytorch import ops
    m = ops.Sequential(ops.Linear(8, 4), ops.GELU())
    """,
    """
    from transformer_engine.pytorch import ops as teo
    m = teo.Sequential(teo.Linear(8, 4), teo.GELU())
    """,
    """
    import transformer_engine.pytorch.ops as ops
    m = ops.Sequential(ops.Linear(8, 4), ops.GELU())
    """,
    """
    from transformer_engine import pytorch as te
    m = te.ops.Sequential(te.ops.Linear(8, 4), te.ops.GELU())
    """,
    """
    from transformer_engine.pytorch.ops import Linear as L, GELU, Sequential as Seq
    m = Seq(L(8, 4), GELU())
    """,
    """
    from fusegen.eager import Sequential, Linear, GELU
    m = Sequential(Linear(8, 4), GELU())
    """,
    """
    import fusegen.eager as fg
    m = fg.Sequential(fg.Linear(in_features=8, out_features=4), fg.GELU())
    """,
    """
    from fusegen import eager
    m = eager.Sequential(eager.Linear(8, 4, bias=True), eager.GELU())
    """,
    """
    try:  # imports inside module-level compound statements count
        import transformer_engine.pytorch as te
    except ImportError:
        te = None
    m = te.ops.Sequential(te.ops.Linear(8, 4), te.ops.GELU())
    """,
])
def test_spellings(source):
    (spec,) = parse(source)
    assert spec.name == "m" and spec.file == "spec.py"
    assert ops(spec) == [("Linear", {"in_features": 8, "out_features": 4, "bias": True}), ("GELU", {})]


def test_op_alias_resolves_to_catalog_name_and_locations():
    source = "from transformer_engine.pytorch.ops import Linear as L, Sequential\nmlp = Sequential(\n    L(8, out_features=4),\n)\n"
    (spec,) = parse_spec(source, "specs/mlp.py")
    assert isinstance(spec, SequentialSpec) and spec.name == "mlp" and spec.file == "specs/mlp.py"
    assert (spec.location.line, spec.location.col, spec.location.source_line) == (2, 7, "mlp = Sequential(")
    (call,) = spec.calls
    assert isinstance(call, OpCall) and call.op == "Linear"
    assert (call.location.file, call.location.line, call.location.col) == ("specs/mlp.py", 3, 5)
    assert call.location.source_line == "    L(8, out_features=4),"
    # only explicitly given arguments have locations; the default `bias` has none
    assert {k: (v.line, v.col) for k, v in call.arg_locations.items()} == {"in_features": (3, 7), "out_features": (3, 23)}
    assert call.args == {"in_features": 8, "out_features": 4, "bias": True, "device": None, "dtype": None,
                         **LINEAR_DEFAULTS}


def test_non_op_statements_are_ignored_and_pipelines_keep_file_order():
    specs = parse('''
        """A docstring."""
        import torch
        from fusegen.eager import Sequential, Linear, AddExtraInput

        def helper(x):
            return torch.relu(x)  # function bodies are not run

        class Config:
            pass

        if __name__ == "__main__":
            print(torch.ones(1))
        b = Sequential(Linear(4, 4))
        a = Sequential(Linear(4, 4), AddExtraInput())
    ''')
    assert [s.name for s in specs] == ["b", "a"]
    assert ops(specs[1])[1] == ("AddExtraInput", {"in_place": False})


# --- constants, defaults, keyword-only ------------------------------------------------------------

def test_constants_arithmetic_defaults_and_order():
    (spec,) = parse("""
        from fusegen.eager import Sequential, LayerNorm, Linear, ConstantScale
        H = 1_024
        H = H * 2          # a later assignment wins for later uses
        F: int = 4 * H     # annotated
        EPS = 1e-6
        blk = Sequential(LayerNorm(H, eps=EPS), Linear(H, F // 2, bias=False), ConstantScale(-(2 ** -1)))
    """)
    assert ops(spec) == [
        ("LayerNorm", {"normalized_shape": 2048, "eps": 1e-6, "zero_centered_gamma": False}),
        ("Linear", {"in_features": 2048, "out_features": 4096, "bias": False}),
        ("ConstantScale", {"scale": -0.5}),
    ]
    assert (spec.calls[0].location.line, spec.calls[0].location.col) == (7, 18)
    assert (spec.calls[0].arg_locations["eps"].line, spec.calls[0].arg_locations["eps"].col) == (7, 35)


def test_reassignment_applies_only_to_later_pipelines():
    first, second = parse("""
        from fusegen.eager import Sequential, Linear
        H = 8
        first = Sequential(Linear(H, H))
        H = 16
        H += 4 * 2         # augmented assignment folds too
        second = Sequential(Linear(H, H))
    """)
    assert first.calls[0].args["in_features"] == 8
    assert second.calls[0].args["in_features"] == 24


def test_value_kinds_literals_and_operators():
    (spec,) = parse("""
        from fusegen.eager import Sequential, Linear, LayerNorm, ConstantScale
        USE_BIAS = False
        A = 0x10 + 0b1 + 0o7 - 8   # 16
        m = Sequential(
            Linear(+A, A % 5 + 2 ** 3, bias=USE_BIAS),    # 16 -> 9
            LayerNorm(9, eps=1, zero_centered_gamma=True),
            ConstantScale(7 / 2),
            ConstantScale(-1),
        )
    """)
    assert ops(spec) == [
        ("Linear", {"in_features": 16, "out_features": 9, "bias": False}),
        ("LayerNorm", {"normalized_shape": 9, "eps": 1.0, "zero_centered_gamma": True}),
        ("ConstantScale", {"scale": 3.5}),
        ("ConstantScale", {"scale": -1.0}),
    ]
    # "float" arguments are always python floats, even when written as ints
    assert type(spec.calls[1].args["eps"]) is float and type(spec.calls[3].args["scale"]) is float


def test_defaults_filled_and_keyword_only_by_name():
    (spec,) = parse("""
        from fusegen.eager import Sequential, RMSNorm, LayerNorm, MakeExtraOutput, Identity
        m = Sequential(RMSNorm(8), LayerNorm(normalized_shape=8, zero_centered_gamma=True), MakeExtraOutput(), Identity())
    """)
    assert ops(spec) == [
        ("RMSNorm", {"normalized_shape": 8, "eps": 1e-5, "zero_centered_gamma": False}),
        ("LayerNorm", {"normalized_shape": 8, "eps": 1e-5, "zero_centered_gamma": True}),
        ("MakeExtraOutput", {"in_place": False}),
        ("Identity", {}),
    ]
    assert spec.calls[0].arg_locations.keys() == {"normalized_shape"}
    assert spec.calls[1].arg_locations.keys() == {"normalized_shape", "zero_centered_gamma"}


def test_parse_spec_file(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(EAGER + "mlp = Sequential(Linear(4, 4))\n", encoding="utf-8")
    (spec,) = parse_spec_file(path)
    assert spec.file == str(path) and spec.calls[0].location.file == str(path)
    (spec,) = parse_spec_file(path, "specs/mlp.py")
    assert spec.file == "specs/mlp.py"
    path.write_bytes(b"x = '\xff'\n")
    with pytest.raises(SpecError, match="not valid UTF-8") as info:
        parse_spec_file(path, "specs/mlp.py")
    assert (info.value.location.file, info.value.location.line, info.value.location.col) == ("specs/mlp.py", 1, 1)


# --- errors ----------------------------------------------------------------------------------------

ERRORS = [
    # (source, line, col, text at the location, message fragment)
    ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Foo(4))\n",
     2, 23, "te.ops.Foo", f"unknown op 'te.ops.Foo'; {KNOWN}"),
    ("import torch\nimport transformer_engine.pytorch as te\nm = te.ops.Sequential(torch.nn.utils(4))\n",
     3, 23, "torch.nn.utils", "unknown op 'torch.nn.utils' (torch.nn modules stand for te.ops where fusegen has "
                              "the op: Linear, LayerNorm, RMSNorm, GELU, SiLU, ReLU, Dropout, Identity, and other torch.nn "
                              f"modules run as they are; torch.nn.utils is not a module class); {KNOWN}"),
    ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.Linaer(4, 4))\n",
     2, 23, "te.Linaer", "unknown op 'te.Linaer'; did you mean 'te.Linear'?"),
    ("import transformer_engine.pytorch as te\nm = te.Sequential(te.TransformerLayer(4, 4, 1))\n",
     2, 19, "te.TransformerLayer", "TransformerLayer(): head_dim = hidden / heads = 4: the attention kernels"),
    (EAGER + "m = Sequential(RMSNorm(4))\n",
     2, 16, "RMSNorm", "unknown op 'RMSNorm' ('RMSNorm' is not imported from transformer_engine.pytorch.ops or "
                       "transformer_engine.pytorch or fusegen.eager or torch.nn); import it: from transformer_engine.pytorch.ops import RMSNorm"),
    # a mistyped op name: the op it most likely means (issue 36), case aside
    ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Linaer(4, 4))\n",
     2, 23, "te.ops.Linaer", "unknown op 'te.ops.Linaer'; did you mean 'te.ops.Linear'?"),
    ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.layernorm(4))\n",
     2, 23, "te.ops.layernorm", "unknown op 'te.ops.layernorm'; did you mean 'te.ops.LayerNorm'?"),
    (EAGER + "m = Sequential(SwiGlu())\n",
     2, 16, "SwiGlu", "unknown op 'SwiGlu' ('SwiGlu' is not imported from transformer_engine.pytorch.ops or "
                      "transformer_engine.pytorch or fusegen.eager or torch.nn); did you mean 'SwiGLU'?"),
    # a misspelt, unimported or foreign container beside a pipeline: not skipped without a word (issue 36)
    ("import transformer_engine.pytorch as te\nfc1 = te.ops.Sequential(te.ops.Linear(4, 4))\n"
     "fc2 = te.ops.Sequental(te.ops.Linear(4, 4))\n",
     3, 7, "te.ops.Sequental", "'te.ops.Sequental(...)' is not a Sequential (transformer_engine.pytorch.ops has no "
                               "'Sequental'), so fusegen would skip this pipeline; did you mean 'te.ops.Sequential'?"),
    ("from fusegen.eager import Linear\nfc1 = Sequential(Linear(4, 4))\n",
     2, 7, "Sequential", "'Sequential(...)' is not a Sequential ('Sequential' is not imported), so fusegen would skip "
                         "this pipeline; import it: from transformer_engine.pytorch.ops import Sequential"),
    ("import transformer_engine.pytorch as te\nfc1 = te.ops.Sequential(te.ops.Linear(4, 4))\n"
     "fc2: object = te.nn.Sequential(te.ops.Linear(4, 4))\n",
     3, 15, "te.nn.Sequential", "'te.nn.Sequential(...)' is not a Sequential (it is transformer_engine.pytorch.nn.Sequential, "
                                "not the Sequential of transformer_engine.pytorch.ops or transformer_engine.pytorch or "
                                "fusegen.eager or torch.nn)"),
    ("import transformer_engine.pytorch as te\nfrom transformer_engine.pytorch.ops import Sequential\n"
     "fc1 = te.ops.Sequential(te.ops.Linear(4, 4))\nif True:\n    Sequential = None\nfc2 = Sequential(te.ops.GELU())\n",
     6, 7, "Sequential(te", "'Sequential(...)' is not a Sequential ('Sequential' is not imported here: line 4 binds "
                           "it inside 'if', which fusegen does not run), so fusegen would skip this pipeline"),
    ("import transformer_engine.pytorch as te\nfc1 = te.ops.Sequential(te.ops.Linear(4, 4))\n"
     "fc2 = te.ops.Pipeline(te.ops.Linear(4, 4), te.ops.GELU())\n",
     3, 7, "te.ops.Pipeline", "'te.ops.Pipeline(...)' is not a Sequential (transformer_engine.pytorch.ops has no "
                              "'Pipeline'), so fusegen would skip this pipeline; did you mean 'te.ops.Sequential'?"),
    (EAGER + "m = Sequential(Linear(4))\n",
     2, 16, "Linear(4)",
     "Linear() missing required argument 'out_features'; signature: Linear(in_features, out_features, *, bias=True, "
     "device=None, dtype=None, accumulate_into_main_grad=False)"),
    (EAGER + "m = Sequential(Linear(4, 4, devices='cuda'))\n",
     2, 29, "devices", "Linear() got an unexpected keyword argument 'devices'; did you mean 'device'? signature: "),
    (EAGER + "m = Sequential(Linear(4, 4, True))\n",
     2, 29, "True", "Linear() takes 2 positional arguments but 3 were given; pass bias, device, dtype, accumulate_into_main_grad by keyword; signature: "),
    (EAGER + "m = Sequential(GELU(4))\n",
     2, 21, "4", "GELU() takes 0 positional arguments but 1 was given; pass cache_quantized_input by keyword; "
                 "signature: GELU(*, cache_quantized_input=False)"),
    (EAGER + "m = Sequential(LayerNorm(8, 1e-6))\n",
     2, 29, "1e-6", "LayerNorm() takes 1 positional argument but 2 were given; pass eps, device, dtype, zero_centered_gamma, sm_margin by keyword"),
    (EAGER + "m = Sequential(Linear(4, 4, bias=1))\n",
     2, 34, "1", "argument 'bias' of Linear must be True or False, got int 1"),
    (EAGER + "m = Sequential(Linear(8 / 2, 4))\n",
     2, 23, "8 / 2", "argument 'in_features' of Linear must be an int, got float 4.0; use // for integer division"),
    (EAGER + "m = Sequential(Linear(True, 4))\n",
     2, 23, "True", "argument 'in_features' of Linear must be an int, got bool True"),
    (EAGER + "m = Sequential(ConstantScale(True))\n",
     2, 30, "True", "argument 'scale' of ConstantScale must be a number, got bool True"),
    (EAGER + "m = Sequential(Linear(0, 4))\n",
     2, 23, "0", "argument 'in_features' of Linear must be positive"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=-1.0))\n",
     2, 33, "-1.0", "argument 'eps' of LayerNorm must be positive"),
    (EAGER + "m = Sequential(AddExtraInput(in_place=1))\n",
     2, 39, "1", "argument 'in_place' of AddExtraInput must be True or False"),
    (EAGER + "m = Sequential(ConstantScale(1e308 * 10))\n",
     2, 30, "1e308", "argument 'scale' of ConstantScale must be finite"),
    (EAGER + "m = Sequential(Linear(HIDDEN, 4))\n",
     2, 23, "HIDDEN", "'HIDDEN' is not a module-level constant defined before this line; "
                      "define it above this line as HIDDEN = <number>"),
    (EAGER + "m = Sequential(Linear(H, 4))\nH = 4\n",
     2, 23, "H", "'H' is not a module-level constant defined before this line"),
    (EAGER + "X = 5 % 0\nm = Sequential(Linear(X, 4))\n",
     3, 23, "X", "'X' is not a module-level constant defined before this line (line 2 assigns it a value fusegen "
                 "cannot evaluate: division by zero in constant 'X')"),
    (EAGER + "import torch\nW = torch.ones(4)\nm = Sequential(Linear(W, 4))\n",
     4, 23, "W", "(line 3 assigns it a value fusegen cannot evaluate: unsupported expression in constant 'W'"),
    (EAGER + "H = 4\nif True:\n    H = 8\nm = Sequential(Linear(H, 4))\n",
     5, 23, "H", "(line 3 binds it inside 'if', which fusegen does not run)"),
    (EAGER + "H = 4\ndef H():\n    pass\nm = Sequential(Linear(H, 4))\n",
     5, 23, "H", "(line 3 binds it inside 'def', which fusegen does not run)"),
    (EAGER + "H, G = 4, 4\nm = Sequential(Linear(H, 4))\n",
     2, 1, "H, G", "fusegen does not evaluate unpacking assignments (they would bind H, G); write H = 4; G = 4, "
                   "one assignment per line"),
    (EAGER + "H = 4\ndel H\nm = Sequential(Linear(H, 4))\n",
     4, 23, "H", "(line 3 deletes it)"),
    (EAGER + "p = Sequential(Linear(4, 4))\nm = Sequential(Linear(p, 4))\n",
     3, 23, "p", "(line 2 makes it a pipeline)"),
    (EAGER + "m = Sequential(Linear(len('ab'), 4))\n",
     2, 23, "len('ab')", "unsupported expression in argument 'in_features' of Linear: only literals (numbers, True/False, None, strings, "
     "tuples), torch dtypes, module-level "
                         "constants and + - * / // % ** are allowed"),
    (EAGER + "m = Sequential(Linear('4', 4))\n", 2, 23, "'4'", "argument 'in_features' of Linear must be an int, got str '4'"),
    (EAGER + "m = Sequential(LayerNorm((8, 0)))\n", 2, 27, "8, 0)",
     "argument 'normalized_shape' of LayerNorm must hold positive sizes"),
    (EAGER + "m = Sequential(LayerNorm(()))\n", 2, 27, ")",
     "argument 'normalized_shape' of LayerNorm must be an int or a non-empty tuple of ints, got tuple ()"),
    (EAGER + "m = Sequential(LayerNorm((512, 256)))\n", 2, 27, "512, 256)",
     "argument 'normalized_shape' of LayerNorm must be at most 65536 (2**16), got 131072; a norm kernel keeps its whole "
     "row in registers, and wider rows spill to memory and compile for minutes (the product of its sizes, which "
     "the kernels normalise as one row)"),
    (EAGER + "m = Sequential(Linear(cfg.hidden, 4))\n", 2, 23, "cfg.hidden", "unsupported expression"),
    (EAGER + "S = (4,)\nm = Sequential(Linear(S[0], 4))\n", 3, 23, "S[0]", "unsupported expression"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=None))\n", 2, 33, "None",
     "argument 'eps' of LayerNorm must be a number, got NoneType None"),
    (EAGER + "m = Sequential(Linear(4 * 'a', 4))\n", 2, 27, "'a'", "arithmetic on str 'a' in argument 'in_features'"),
    (EAGER + "m = Sequential(Linear(4 // 0, 4))\n",
     2, 23, "4 // 0", "division by zero in argument 'in_features' of Linear"),
    (EAGER + "m = Sequential(Linear(True + 1, 4))\n",
     2, 23, "True", "arithmetic on bool True in argument 'in_features' of Linear; use a number"),
    (EAGER + "m = Sequential(ConstantScale((-8) ** 0.5))\n",
     2, 30, "(-8) ** 0.5", "result is a complex number in argument 'scale' of ConstantScale"),
    (EAGER + "m = Sequential(Linear(10 ** 10 ** 10, 4))\n",
     2, 23, "10 ** 10", "exponent 10000000000 is too large in argument 'in_features' of Linear"),
    (EAGER + "m = Sequential(Linear(4, 4, bias=True, bias=False))\n",
     2, 40, "bias=False", "Linear() got multiple values for argument 'bias'"),
    (EAGER + "m = Sequential(Linear(4, 4, in_features=4))\n",
     2, 29, "in_features", "Linear() got multiple values for argument 'in_features'"),
    (EAGER + "args = (4, 4)\nm = Sequential(Linear(*args))\n",
     3, 23, "*args", "Linear() arguments cannot be unpacked with *; write each argument out"),
    (EAGER + "kw = {}\nm = Sequential(Linear(4, 4, **kw))\n",
     3, 29, "**kw", "Linear() arguments cannot be unpacked with **"),
    (EAGER + "x = 3\nm = Sequential(x)\n",
     3, 16, "x", "Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got 'x'"),
    (EAGER + "ops = []\nm = Sequential(*ops)\n",
     3, 16, "*ops", "Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got '*ops'"),
    (EAGER + "m = Sequential(Linear(4, 4), name='x')\n",
     2, 30, "name=", "Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got 'name='x''"),
    (EAGER + "m = Sequential(Sequential(Linear(4, 4)))\n",
     2, 16, "Sequential(Linear", "Sequential(...) cannot be nested"),
    (EAGER + "m = Sequential(Linear(4, 4))\nm = Sequential(Linear(4, 4))\n",
     3, 1, "m =", "pipeline 'm' is defined twice in this file (first at line 2)"),
    (EAGER + "a = b = Sequential(Linear(4, 4))\n",
     2, 1, "a =", "a pipeline must be assigned to one plain name: NAME = Sequential(...)"),
    (EAGER + "a, b = Sequential(Linear(4, 4))\n",
     2, 1, "a, b", "a pipeline must be assigned to one plain name"),
    (EAGER + "a, b = Sequential(Linear(4, 4)), Sequential(GELU())\n",
     2, 8, "Sequential(Linear", "a pipeline must be written as NAME = Sequential(...) at module level"),
    (EAGER + "m = Sequential(Linear(4, 4)).cuda()\n",
     2, 5, "Sequential(", "a pipeline must be written as NAME = Sequential(...)"),
    (EAGER + "Sequential(Linear(4, 4))\n",
     2, 1, "Sequential(", "a pipeline must be written as NAME = Sequential(...)"),
    (EAGER + "m = Sequential(Linear(4, 4)\n", 2, 15, "(", "syntax error: '(' was never closed"),
    (EAGER + "x = 1\ny = )\n", 3, 5, ")", "syntax error: unmatched ')'"),
    ("HIDDEN = 4\n", 1, 1, "HIDDEN", "no 'NAME = Sequential(...)' pipeline found in spec.py"),
    ("import transformer_engine.pytorch as te\nm = te.ops.Linear(4, 4)\n",
     1, 1, "import", "no 'NAME = Sequential(...)' pipeline found in spec.py"),
]


@pytest.mark.parametrize("source,line,col,at,message", ERRORS)
def test_errors_point_at_the_problem(source, line, col, at, message):
    with pytest.raises(SpecError) as info:
        parse_spec(source, "spec.py")
    assert message in info.value.message
    assert_points_at(info.value, source, line, col, at)


def test_empty_file():
    with pytest.raises(SpecError) as info:
        parse_spec("", "spec.py")
    assert str(info.value) == "spec.py:1:1: error: no 'NAME = Sequential(...)' pipeline found in spec.py"


# --- errors found when the parsed spec becomes a pipeline (generator/pipeline.py) -------------------

@pytest.mark.parametrize("source,line,col,at,message", [
    ("from fusegen.eager import Sequential, Linear\nm = Sequential(\n    Linear(4, 8),\n    Linear(6, 2),\n)\n",
     4, 5, "Linear(6", "Linear() expects 6 input features, but the op before it (Linear at line 3) produces 8"),
    ("from fusegen.eager import Sequential, Linear, SwiGLU\nm = Sequential(Linear(4, 7), SwiGLU())\n",
     2, 30, "SwiGLU", "SwiGLU() splits its input into two halves, but it receives 7 features (odd)"),
    ("from fusegen.eager import Sequential\nm = Sequential()\n",
     2, 5, "Sequential", "pipeline 'm' is empty"),
])
def test_pipeline_errors_use_frontend_locations(source, line, col, at, message):
    (spec,) = parse_spec(source, "spec.py")
    with pytest.raises(SpecError) as info:
        build_pipeline(spec)
    assert message in info.value.message
    assert_points_at(info.value, source, line, col, at)


def test_sizes_flow_backwards_to_ops_without_their_own():
    (spec,) = parse("""
        from fusegen.eager import Sequential, GELU, SwiGLU, Linear
        m = Sequential(GELU(), SwiGLU(), Linear(16, 4))
    """)
    pipeline = build_pipeline(spec)
    assert [(op.in_features, op.out_features) for op in pipeline.ops] == [(32, 32), (32, 16), (16, 4), (4, 4)]


# --- hostile text: always a SpecError inside the file, never another exception (issue 10) -----------

DEEP_CALLS = "f(" * 60 + "1" + ")" * 60


@pytest.mark.parametrize("source,line,col,at,message", [
    # nesting: bounded before libcst sees it (libcst recurses per level; its native parser can crash)
    (EAGER + "H = " + DEEP_CALLS + "\nm = Sequential(Linear(4, 4))\n",
     2, 5 + 2 * 48, "f(", "expression nested too deeply (more than 50 levels: each call, bracket and operator of a "
                          "chain counts one); a spec needs only constants and op calls, so split long expressions "
                          "into named constants, one per line"),
    (EAGER + "m = Sequential(Linear(" + " + ".join(["1"] * 60) + ", 4))\n",
     2, 23, "1 + 1", "expression nested too deeply (more than 50 levels"),
    (EAGER + "x = 1\nH = " + "+".join(["1"] * 3000) + "\n",  # Python's parser itself runs out of stack
     3, 1, "H = 1+1", "statement too deeply nested for Python's parser; a spec needs only constants and op calls"),
    (EAGER + "H = " + "-" * 10000 + "1\n",  # ast.parse raises MemoryError here
     2, 1, "H = --", "statement too deeply nested for Python's parser"),
    (EAGER + "x = (" + "(" * 250 + ")" * 251 + "\n", 2, 205, "(", "syntax error: too many nested parentheses"),
    (EAGER + "m = Sequential(Linear(4, 4))\n" + "#" * 100_000 + "\n",
     3, 100_000 - len(EAGER) - 29 + 1, "#",
     f"spec file is too large ({len(EAGER) + 29 + 100_001} characters; fusegen reads at most 100000); "
     "a spec declares pipelines, so move anything else to another file"),
    # literals: bounded before they are converted
    (EAGER + "m = Sequential(ConstantScale(1e999))\n",
     2, 30, "1e999", "number too large in argument 'scale' of ConstantScale: 1e999 is beyond the float range "
                     "(about 1.8e308)"),
    (EAGER + "m = Sequential(Linear(4, 1" + "0" * 5000 + "))\n",
     2, 26, "10000", "number too large: a literal of 5001 digits; sizes and constants stay far below 2**256"),
    (EAGER + "m = Sequential(Linear(" + "9" * 300 + ", 4))\n",
     2, 23, "999", "number too large in argument 'in_features' of Linear: 99999999999999999... has more than 256 "
                   "bits; sizes and constants stay far below that"),
    (EAGER + "m = Sequential(Linear(0x" + "f" * 65 + ", 4))\n", 2, 23, "0xfff", "has more than 256 bits"),
    (EAGER + "X = 1e999\nm = Sequential(Linear(X, 4))\n",
     3, 23, "X", "(line 2 assigns it a value fusegen cannot evaluate: number too large in constant 'X'"),
    (EAGER + "m = Sequential(ConstantScale(2 ** 200 * 2 ** 100))\n",
     2, 30, "2 ** 200", "number too large in argument 'scale' of ConstantScale"),
    (EAGER + "m = Sequential(ConstantScale(1e200 ** 2))\n", 2, 30, "1e200", "number too large"),  # OverflowError
    # sizes: a bound real models never reach, given or inferred
    (EAGER + "m = Sequential(Linear(2 ** 62, 4))\n",
     2, 23, "2 ** 62", "argument 'in_features' of Linear must be at most 16777216 (2**24), got 4611686018427387904; "
                       "that is fusegen's bound on feature sizes, far above any model's"),
    (EAGER + "m = Sequential(Linear(4, 2 ** 24 + 1))\n", 2, 26, "2 ** 24", "'out_features' of Linear must be at most"),
    ("from fusegen.eager import Sequential, Bias, BasicLinear\nm = Sequential(Bias(16777217))\n",
     2, 21, "16777217", "argument 'size' of Bias must be at most 16777216 (2**24)"),
    ("from fusegen.eager import Sequential, BasicLinear\nm = Sequential(BasicLinear(4, 10 ** 8))\n",
     2, 31, "10 ** 8", "argument 'out_features' of BasicLinear must be at most 16777216"),
    ("from fusegen.eager import Sequential, RMSNorm\nm = Sequential(RMSNorm(10 ** 6))\n",
     2, 24, "10 ** 6", "argument 'normalized_shape' of RMSNorm must be at most 65536 (2**16), got 1000000; a norm "
                       "kernel keeps its whole row in registers, and wider rows spill to memory and compile for "
                       "minutes"),
    (EAGER + "m = Sequential(LayerNorm(65537))\n",
     2, 26, "65537", "'normalized_shape' of LayerNorm must be at most 65536"),
    # eps and scale: finite, and usable as float32 constants in the kernels
    (EAGER + "m = Sequential(LayerNorm(8, eps=1e308 * 10))\n",
     2, 33, "1e308", "argument 'eps' of LayerNorm must be finite, got float inf"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=1e308 * 10 - 1e308 * 10))\n",
     2, 33, "1e308", "argument 'eps' of LayerNorm must be finite, got float nan"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=0.0))\n", 2, 33, "0.0", "argument 'eps' of LayerNorm must be positive"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=1e-300))\n",
     2, 33, "1e-300", "argument 'eps' of LayerNorm must be between 1.175494e-38 and 3.402823e+38 (the kernels add "
                      "it in float32, where it would become 0 or inf)"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=1e39))\n", 2, 33, "1e39", "must be between 1.175494e-38 and"),
    (EAGER + "m = Sequential(ConstantScale(-1e308 * 10))\n",
     2, 30, "-1e308", "argument 'scale' of ConstantScale must be finite, got float -inf"),
    (EAGER + "m = Sequential(ConstantScale(-3.5e38))\n",
     2, 30, "-3.5e38", "argument 'scale' of ConstantScale must be at most 3.402823e+38 in magnitude (the kernels "
                       "multiply in float32, where it would be inf)"),
    # names bound in ways fusegen does not evaluate are errors where they are bound
    (EAGER + "A = (H := 16)\nm = Sequential(Linear(H, 4))\n",
     2, 6, "H := 16", "fusegen does not evaluate ':=' (here it would bind 'H'); write H = 16 on a line of its own"),
    (EAGER + "print(Y := 2 * 4)\n", 2, 7, "Y :=", "write Y = 2 * 4 on a line of its own"),
    (EAGER + "xs = [y := 1 for _ in range(3)]\n",  # a comprehension's := binds in the module
     2, 7, "y :=", "fusegen does not evaluate ':=' (here it would bind 'y')"),
    (EAGER + "f = lambda x=(d := 3): x\n", 2, 15, "d :=", "here it would bind 'd'"),  # defaults run at module level
    (EAGER + "m = Sequential(Linear(H := 4, 4))\n", 2, 23, "H :=", "fusegen does not evaluate ':='"),
    (EAGER + "[A] = [4]\n", 2, 1, "[A]", "fusegen does not evaluate unpacking assignments (they would bind A); "
                                         "write A = 4, one assignment per line"),
    (EAGER + "*A, B = 1, 2, 3\n", 2, 1, "*A, B", "(they would bind A, B); assign each name on a line of its own"),
    (EAGER + "x = A, B = 1, 2\n", 2, 5, "A, B", "fusegen does not evaluate unpacking assignments"),
    (EAGER + "for i in range(3):\n    pass\nm = Sequential(Linear(i, 4))\n",
     4, 23, "i", "(line 2 binds it inside 'for', which fusegen does not run)"),
    (EAGER + "if (n := 10) > 5:\n    pass\nm = Sequential(Linear(n, 4))\n",
     4, 23, "n", "(line 2 binds it inside 'if', which fusegen does not run)"),
    # a pipeline only code would build is never silently missing
    (EAGER + "if True:\n    m = Sequential(Linear(4, 4))\n",
     3, 9, "Sequential(", "a pipeline must be defined at module level: fusegen does not run the 'if' at line 2, so it "
                          "would never see this one; write NAME = Sequential(...) at the top level of the file"),
    (EAGER + "m = Sequential(Linear(4, 4))\nfor i in range(2):\n    m2 = Sequential(Linear(4, 4))\n",
     4, 10, "Sequential(", "fusegen does not run the 'for' at line 3"),
    (EAGER + "while False:\n    m = Sequential(Linear(4, 4))\n", 3, 9, "Sequential(", "does not run the 'while' at line 2"),
    (EAGER + "try:\n    m = Sequential(Linear(4, 4))\nexcept Exception:\n    pass\n",
     3, 9, "Sequential(", "does not run the 'try' at line 2"),
    (EAGER + "with x:\n    m = Sequential(Linear(4, 4))\n", 3, 9, "Sequential(", "does not run the 'with' at line 2"),
    (EAGER + "def build():\n    return Sequential(Linear(4, 4))\n", 3, 12, "Sequential(", "does not run the 'def' at line 2"),
    (EAGER + "@dec\nclass C:\n    m = Sequential(Linear(4, 4))\n", 4, 9, "Sequential(", "does not run the 'class' at line 3"),
    (EAGER + "match x:\n    case 1:\n        m = Sequential(Linear(4, 4))\n",
     4, 13, "Sequential(", "does not run the 'match' at line 2"),
    ("try:\n    import transformer_engine.pytorch as te\nexcept ImportError:\n    te = None\nelse:\n"
     "    m = te.ops.Sequential(te.ops.Linear(4, 4))\n", 6, 9, "te.ops.Sequential", "does not run the 'try' at line 1"),
    (EAGER + "build = lambda: Sequential(Linear(4, 4))\n",
     2, 17, "Sequential(", "a pipeline must be written as NAME = Sequential(...) at module level; fusegen does not run "
                           "code that builds it"),
    # text no spec is made of
    (EAGER + "m = Sequential(Linear(4, 4))  # \0\n", 2, 33, "\0", "spec file contains a NUL character; save it as "
                                                                 "plain UTF-8 text"),
    (EAGER + "if True:\n", 2, 9, "", "syntax error: expected an indented block after 'if' statement on line 2"),
    (EAGER + "m = Sequential(" + "GELU(), " * 1000 + "Linear(4, 4))\n",
     2, 16 + 8 * 1000, "Linear(4, 4)", "pipeline 'm' has 1001 ops; fusegen plans at most 1000 ops per pipeline, so "
                                       "split it into several pipelines"),
])
def test_hostile_text_gives_a_located_error(source, line, col, at, message):
    with pytest.raises(SpecError) as info:
        spec = parse_spec(source, "spec.py")
        build_pipeline(spec[0])
    assert message in info.value.message
    assert_points_at(info.value, source, line, col, at)


def test_inferred_sizes_are_bounded_too():
    source = ("from fusegen.eager import Sequential, SwiGLU, GEGLU, Linear\n"
              "m = Sequential(SwiGLU(), GEGLU(), Linear(2 ** 23, 4))\n")
    (spec,) = parse_spec(source, "spec.py")
    with pytest.raises(SpecError) as info:
        build_pipeline(spec)
    assert info.value.message == ("SwiGLU() would need 33554432 input features to produce the 16777216 that follow "
                                  "it, more than fusegen's bound of 16777216 (2**24); give the pipeline fewer GLUs or "
                                  "smaller sizes")
    assert_points_at(info.value, source, 2, 16, "SwiGLU()")


def test_largest_sizes_are_accepted():
    (spec,) = parse("""
        from fusegen.eager import Sequential, Linear, RMSNorm, SwiGLU, ConstantScale, LayerNorm
        m = Sequential(SwiGLU(), Linear(2 ** 23, 65536), RMSNorm(65536, eps=2.0 ** -126), ConstantScale(-3.4e38),
                       LayerNorm(65536, eps=3.4e38))
    """)
    assert [(op.in_features, op.out_features) for op in build_pipeline(spec).ops][:2] == [(2 ** 24, 2 ** 23),
                                                                                          (2 ** 23, 65536)]


def test_recursion_in_libcst_is_a_last_resort_error(monkeypatch):
    import fusegen.frontend as frontend

    monkeypatch.setattr(frontend, "MAX_NESTING", 10 ** 6)  # let a depth through that libcst cannot walk
    source = EAGER + "H = " + "-" * 1200 + "1\n"
    with pytest.raises(SpecError) as info:
        parse_spec(source, "spec.py")
    assert info.value.message.startswith("expression nested too deeply for fusegen; a spec needs only constants")
    assert (info.value.location.line, info.value.location.source_line) == (2, source.splitlines()[1])


def test_lone_surrogate_is_shown_as_a_question_mark():
    with pytest.raises(SpecError) as info:
        parse_spec(EAGER + "m = Sequential(Linear(4, 4))  # \ud800\n", "spec.py")
    assert info.value.message.startswith("spec text contains U+D800, a lone surrogate")
    assert (info.value.location.line, info.value.location.col) == (2, 33)
    assert info.value.location.source_line == "m = Sequential(Linear(4, 4))  # ?"
    str(info.value).encode("utf-8")  # printable


def test_names_are_read_as_python_reads_them():
    (spec,) = parse("""
        from fusegen.eager import *
        \ufb01 = 8                               # Python reads the ligature as 'fi'
        m = Sequential(Linear(fi, 4, \uff42ias=False), \uff27ELU())
    """)
    assert ops(spec) == [("Linear", {"in_features": 8, "out_features": 4, "bias": False}), ("GELU", {})]


def test_bindings_fusegen_can_follow_are_still_accepted():
    (spec,) = parse("""
        import torch
        from transformer_engine.pytorch.ops import *
        a = b = 8                 # chained assignment to names
        x = torch.randn(3)        # not a constant: only an error if an op used it
        x.y = 3                   # binds no module-level name
        x[0] = 3
        f = lambda: (z := 1)      # a lambda body is its own scope
        for i in range(2):
            pass
        m = Sequential(Linear(a, b), GELU())
    """)
    assert ops(spec)[0] == ("Linear", {"in_features": 8, "out_features": 8, "bias": True})


def test_line_endings_and_warnings_do_not_matter(tmp_path):
    import warnings

    source = EAGER + 'PATTERN = "\\d+"\nm = Sequential(Linear(4, 4))\n'  # an invalid escape: Python warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fusegen reads the file; warnings are Python's to give when it runs
        for text in (source, source.replace("\n", "\r\n"), source.replace("\n", "\r")):
            (spec,) = parse_spec(text, "spec.py")
            assert (spec.name, spec.location.line, spec.location.source_line) == ("m", 3, "m = Sequential(Linear(4, 4))")
    path = tmp_path / "bom.py"
    path.write_bytes(b"\xef\xbb\xbf" + source.encode())  # Windows editors write a byte-order mark
    assert [s.name for s in parse_spec_file(path)] == ["m"]


def test_registry_checks_guard_the_eager_modules_too():
    from fusegen import eager

    with pytest.raises(ValueError, match="argument 'eps' of LayerNorm must be finite"):
        eager.LayerNorm(8, eps=float("inf"))
    with pytest.raises(ValueError, match="argument 'in_features' of Linear must be at most 16777216"):
        eager.Linear(2 ** 62, 4)


def test_deepest_accepted_nesting_leaves_most_of_the_stack():
    """MAX_NESTING keeps libcst's recursion shallow: the deepest text it lets through (nested calls,
    what libcst recurses on most) reads within 500 frames of Python's default 1000."""
    import inspect
    import sys

    def source(n):
        return EAGER + "H = " + "f(" * n + "1" + ")" * n + "\nm = Sequential(Linear(4, 4))\n"

    n = 1
    while True:
        try:
            parse_spec(source(n + 1), "spec.py")
        except SpecError as err:
            assert "nested too deeply (more than" in err.message
            break
        n += 1
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 500)
    try:
        (spec,) = parse_spec(source(n), "spec.py")
    finally:
        sys.setrecursionlimit(limit)
    assert spec.name == "m"


def test_te_hints_are_accepted():
    """TE's spellings compile unchanged: a tuple normalized_shape, and the performance hints that
    do nothing in fusegen's kernels (sm_margin, cache_quantized_input; README lists them)."""
    (spec,) = parse(
        "import transformer_engine.pytorch as te\n"
        "m = te.ops.Sequential(te.ops.LayerNorm((64,), sm_margin=8), te.ops.RMSNorm([64]), "
        "te.ops.GELU(cache_quantized_input=True), te.ops.SwiGLU(cache_quantized_input=False))\n")
    assert [c.args for c in spec.calls] == [
        {"normalized_shape": 64, "eps": 1e-5, "device": None, "dtype": None, "zero_centered_gamma": False,
         "sm_margin": 8},
        {"normalized_shape": 64, "eps": 1e-5, "device": None, "dtype": None, "zero_centered_gamma": False,
         "sm_margin": 0},
        {"cache_quantized_input": True}, {"glu_interleave_size": None, "cache_quantized_input": False}]
    plan = build_pipeline(spec)
    assert [op.describe() for op in plan.ops] == [
        "LayerNorm(64, sm_margin=8)", "RMSNorm(64)", "GELU(cache_quantized_input=True)", "SwiGLU()"]



@pytest.mark.parametrize("name", sorted(NOT_YET))
def test_te_ops_fusegen_does_not_generate_say_so(name):
    source = f"import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Linear(8, 8), te.ops.{name}())\n"
    with pytest.raises(SpecError) as info:
        parse(source)
    assert info.value.message.startswith(f"{name} is a te.ops operation fusegen does not generate: {NOT_YET[name]}")
    assert (info.value.location.line, info.value.location.col) == (2, 44)
    assert name not in OPS  # an op that is generated leaves this table


def test_device_and_dtype_as_te_spells_them():
    (spec,) = parse(
        "import torch\nimport transformer_engine.pytorch as te\nDT = torch.bfloat16\n"
        "m = te.ops.Sequential(te.ops.Linear(8, 8, device='cuda', dtype=DT), te.ops.RMSNorm(8, dtype=torch.half),"
        " te.ops.Bias(8, device=None, dtype=None))\n")
    assert [(c.args["device"], c.args["dtype"]) for c in spec.calls] == [
        ("cuda", TorchDtype("bfloat16")), (None, TorchDtype("float16")), (None, None)]
    p = build_pipeline(spec)
    assert [op.describe() for op in p.ops] == [
        "BasicLinear(8, 8, device='cuda', dtype=torch.bfloat16)", "Bias(8, device='cuda', dtype=torch.bfloat16)",
        "RMSNorm(8, dtype=torch.float16)", "Bias(8)"]
    assert p.ops[0].describe(kernel=True) == "BasicLinear(8, 8)"  # kernels do not see placement


@pytest.mark.parametrize("call, message", [
    ("te.ops.Linear(8, 8, dtype='bf16')", "argument 'dtype' of Linear must be None or a torch dtype like "
                                          "torch.bfloat16, got str 'bf16'"),
    ("te.ops.Bias(8, device='tpu')", "argument 'device' of Bias must be None or a device name like 'cuda', "
                                     "'cuda:1' or 'cpu', got str 'tpu'"),
    ("te.ops.Bias(8, dtype=torch.int8)", "unsupported expression in argument 'dtype' of Bias"),
    ("te.ops.GELU(device='cuda')", "GELU() got an unexpected keyword argument 'device'"),
])
def test_bad_device_and_dtype_are_errors_at_them(call, message):
    with pytest.raises(SpecError) as info:
        parse(f"import torch\nimport transformer_engine.pytorch as te\nm = te.ops.Sequential({call})\n")
    assert message in info.value.message



def test_l2_normalization_takes_te_arguments():
    (spec,) = parse("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Linear(8, 8), "
                    "te.ops.L2Normalization(eps=1e-5, seq_length=None, micro_batch_size=4))\n")
    assert spec.calls[1].args == {"eps": 1e-5, "seq_length": None, "micro_batch_size": 4}
    assert [op.describe(kernel=True) for op in build_pipeline(spec).ops][-1] == "L2Normalization(eps=1e-05)"


def test_calls_that_are_not_pipelines_are_left_alone():
    """Only a callee spelled like Sequential, or one of fusegen's modules holding op calls, is taken
    for a lost pipeline: other module-level calls (a tensor, the user's classes, one op) are not."""
    specs = parse_spec(
        "import torch\nimport transformer_engine.pytorch as te\nfrom mylib import Wrapper\n"
        "X = torch.ones(1)\nw = Wrapper(te.ops.Linear(4, 4))\nnorm = te.ops.LayerNorm(4)\nseq = te.ops.Sequential\n"
        "from mylib import essential, sequence\ne = essential(4)\ns = sequence(4)\n"
        "m = te.ops.Sequential(te.ops.Linear(4, 4))\n", "spec.py")
    assert [spec.name for spec in specs] == ["m"]
