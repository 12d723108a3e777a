"""The spec frontend: spellings, aliases, constant folding, and every SpecError with its location."""

import textwrap

import pytest

from generator.catalog import OPS
from generator.errors import SpecError
from generator.frontend import OpCall, SequentialSpec, parse_spec, parse_spec_file
from generator.pipeline import build_pipeline

EAGER = "from generator.eager import Sequential, Linear, LayerNorm, GELU, ConstantScale, AddExtraInput\n"
KNOWN = "known ops: " + ", ".join(sorted(OPS))


def parse(source):
    return parse_spec(textwrap.dedent(source), "spec.py")


def ops(spec):
    return [(c.op, c.args) for c in spec.calls]


def assert_points_at(err: SpecError, source: str, line: int, col: int, at: str) -> None:
    """The error's location is (line, col), the text there starts with ``at``, and str() shows it."""
    src_line = source.splitlines()[line - 1] if source else ""
    assert (err.location.file, err.location.line, err.location.col) == ("spec.py", line, col), str(err)
    assert err.location.source_line == src_line
    assert src_line[col - 1:].startswith(at), str(err)
    rendered = str(err).splitlines()
    assert rendered[0] == f"spec.py:{line}:{col}: error: {err.message}"
    if src_line:
        assert rendered[1:] == ["    " + src_line, "    " + " " * (col - 1) + "^"]


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
    from generator.eager import Sequential, Linear, GELU
    m = Sequential(Linear(8, 4), GELU())
    """,
    """
    import generator.eager as fg
    m = fg.Sequential(fg.Linear(in_features=8, out_features=4), fg.GELU())
    """,
    """
    from generator import eager
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
    assert call.args == {"in_features": 8, "out_features": 4, "bias": True}


def test_non_op_statements_are_ignored_and_pipelines_keep_file_order():
    specs = parse('''
        """A docstring."""
        import torch
        from generator.eager import Sequential, Linear, AddExtraInput

        def helper(x):
            return Sequential(Linear(1, 1))  # function bodies are not declarations

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
        from generator.eager import Sequential, LayerNorm, Linear, ConstantScale
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
        from generator.eager import Sequential, Linear
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
        from generator.eager import Sequential, Linear, LayerNorm, ConstantScale
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
        from generator.eager import Sequential, RMSNorm, LayerNorm, MakeExtraOutput, Identity
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
    ("import torch\nimport transformer_engine.pytorch as te\nm = te.ops.Sequential(torch.nn.Linear(4, 4))\n",
     3, 23, "torch.nn.Linear", "unknown op 'torch.nn.Linear' (it is torch.nn.Linear, not an op of "
                               f"transformer_engine.pytorch.ops or generator.eager); {KNOWN}"),
    ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.Linear(4, 4))\n",
     2, 23, "te.Linear", "unknown op 'te.Linear' (it is transformer_engine.pytorch.Linear, not an op of"),
    (EAGER + "m = Sequential(RMSNorm(4))\n",
     2, 16, "RMSNorm", "unknown op 'RMSNorm' ('RMSNorm' is not imported from transformer_engine.pytorch.ops or "
                       f"generator.eager); {KNOWN}"),
    (EAGER + "m = Sequential(Linear(4))\n",
     2, 16, "Linear(4)",
     "Linear() missing required argument 'out_features'; signature: Linear(in_features, out_features, *, bias=True)"),
    (EAGER + "m = Sequential(Linear(4, 4, device='cuda'))\n",
     2, 29, "device", "Linear() got an unexpected keyword argument 'device'; signature: Linear(in_features, "),
    (EAGER + "m = Sequential(Linear(4, 4, True))\n",
     2, 29, "True", "Linear() takes 2 positional arguments but 3 were given; pass bias by keyword; signature: "),
    (EAGER + "m = Sequential(GELU(4))\n",
     2, 21, "4", "GELU() takes 0 positional arguments but 1 was given; signature: GELU()"),
    (EAGER + "m = Sequential(LayerNorm(8, 1e-6))\n",
     2, 29, "1e-6", "LayerNorm() takes 1 positional argument but 2 were given; pass eps, zero_centered_gamma by keyword"),
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
    (EAGER + "m = Sequential(AddExtraInput(in_place=True))\n",
     2, 39, "True", "argument 'in_place' of AddExtraInput must be False"),
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
     3, 23, "H", "(line 2 assigns it by unpacking)"),
    (EAGER + "H = 4\ndel H\nm = Sequential(Linear(H, 4))\n",
     4, 23, "H", "(line 3 deletes it)"),
    (EAGER + "p = Sequential(Linear(4, 4))\nm = Sequential(Linear(p, 4))\n",
     3, 23, "p", "(line 2 makes it a pipeline)"),
    (EAGER + "m = Sequential(Linear(len('ab'), 4))\n",
     2, 23, "len('ab')", "unsupported expression in argument 'in_features' of Linear: only literals, module-level "
                         "constants and + - * / // % ** are allowed"),
    (EAGER + "m = Sequential(Linear('4', 4))\n", 2, 23, "'4'", "unsupported expression in argument 'in_features'"),
    (EAGER + "m = Sequential(Linear(cfg.hidden, 4))\n", 2, 23, "cfg.hidden", "unsupported expression"),
    (EAGER + "S = (4,)\nm = Sequential(Linear(S[0], 4))\n", 3, 23, "S[0]", "unsupported expression"),
    (EAGER + "m = Sequential(LayerNorm(8, eps=None))\n", 2, 33, "None", "unsupported expression in argument 'eps'"),
    (EAGER + "m = Sequential(Linear(4 * 'a', 4))\n", 2, 27, "'a'", "unsupported expression"),
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
    ("from generator.eager import Sequential, Linear\nm = Sequential(\n    Linear(4, 8),\n    Linear(6, 2),\n)\n",
     4, 5, "Linear(6", "Linear() expects 6 input features, but the op before it (Linear at line 3) produces 8"),
    ("from generator.eager import Sequential, Linear, SwiGLU\nm = Sequential(Linear(4, 7), SwiGLU())\n",
     2, 30, "SwiGLU", "SwiGLU() splits its input into two halves, but it receives 7 features (odd)"),
    ("from generator.eager import Sequential, GELU\nm = Sequential(GELU())\n",
     2, 5, "Sequential", "pipeline 'm' has no op that fixes the feature size"),
    ("from generator.eager import Sequential\nm = Sequential()\n",
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
        from generator.eager import Sequential, GELU, SwiGLU, Linear
        m = Sequential(GELU(), SwiGLU(), Linear(16, 4))
    """)
    pipeline = build_pipeline(spec)
    assert [(op.in_features, op.out_features) for op in pipeline.ops] == [(32, 32), (32, 16), (16, 4), (4, 4)]
