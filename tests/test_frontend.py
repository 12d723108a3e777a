"""The spec frontend: spellings, aliases, constant folding, and every SpecError with its location."""

import textwrap

import pytest

from generator.errors import SpecError
from generator.frontend import parse_spec
from generator.pipeline import build_pipeline


def parse(source):
    return parse_spec(textwrap.dedent(source), "spec.py")


def error(source):
    with pytest.raises(SpecError) as info:
        for spec in parse(source):
            build_pipeline(spec)
    return info.value


def ops(spec):
    return [(c.op, c.args) for c in spec.calls]


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
    from transformer_engine.pytorch import ops as teo
    m = teo.Sequential(teo.Linear(8, 4), teo.GELU())
    """,
    """
    import transformer_engine.pytorch.ops as ops
    m = ops.Sequential(ops.Linear(8, 4), ops.GELU())
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
])
def test_spellings(source):
    (spec,) = parse(source)
    assert spec.name == "m"
    assert ops(spec) == [("Linear", {"in_features": 8, "out_features": 4, "bias": True}), ("GELU", {})]


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
    assert spec.calls[0].location.line == 7 and spec.calls[0].location.col == 18
    assert spec.calls[0].arg_locations["eps"].col == 35


def test_several_pipelines_in_file_order():
    specs = parse("""
        from generator.eager import Sequential, Linear, AddExtraInput
        b = Sequential(Linear(4, 4))
        a = Sequential(Linear(4, 4), AddExtraInput())
    """)
    assert [s.name for s in specs] == ["b", "a"]


@pytest.mark.parametrize("source,line,col,message", [
    ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Foo(4))\n",
     2, 23, "unknown op 'te.ops.Foo'; known ops: AddExtraInput, BasicLinear, Bias"),
    ("import torch\nimport transformer_engine.pytorch as te\nm = te.ops.Sequential(torch.nn.Linear(4, 4))\n",
     3, 23, "unknown op 'torch.nn.Linear'"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4))\n",
     2, 16, "Linear() missing required argument 'out_features'; signature: Linear(in_features, out_features, *, bias=True)"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4, 4, device='cuda'))\n",
     2, 29, "Linear() got an unexpected keyword argument 'device'"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4, 4, True))\n",
     2, 29, "Linear() takes 2 positional arguments but more were given"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4, 4, bias=1))\n",
     2, 34, "argument 'bias' of Linear must be True or False, got 1"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(8 / 2, 4))\n",
     2, 23, "argument 'in_features' of Linear must be an int, got float 4.0"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(0, 4))\n",
     2, 23, "argument 'in_features' of Linear must be positive"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(HIDDEN, 4))\n",
     2, 23, "'HIDDEN' is not a module-level constant defined before this line"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(len('ab'), 4))\n",
     2, 23, "unsupported expression in argument 'in_features' of Linear"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4 // 0, 4))\n",
     2, 23, "division by zero"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4, 4, bias=True, bias=False))\n",
     2, 40, "got multiple values for argument 'bias'"),
    ("from generator.eager import Sequential, Linear\nargs = (4, 4)\nm = Sequential(Linear(*args))\n",
     3, 23, "arguments cannot be unpacked"),
    ("from generator.eager import Sequential, Linear\nx = 3\nm = Sequential(x)\n",
     3, 16, "Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got 'x'"),
    ("from generator.eager import Sequential, AddExtraInput\nm = Sequential(AddExtraInput(in_place=True))\n",
     2, 39, "argument 'in_place' of AddExtraInput must be False"),
    ("from generator.eager import Sequential, LayerNorm\nm = Sequential(LayerNorm(8, eps=-1.0))\n",
     2, 33, "argument 'eps' of LayerNorm must be positive"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4, 4))\nm = Sequential(Linear(4, 4))\n",
     3, 1, "pipeline 'm' is defined twice"),
    ("from generator.eager import Sequential, Linear\na = b = Sequential(Linear(4, 4))\n",
     2, 1, "a pipeline must be assigned to one plain name"),
    ("from generator.eager import Sequential, Linear\nm = Sequential(Linear(4, 4)\n",
     2, 1, "syntax error"),
    ("HIDDEN = 4\n", 1, 1, "no 'NAME = Sequential(...)' pipeline found in spec.py"),
    # feature sizes between neighbouring ops
    ("from generator.eager import Sequential, Linear\nm = Sequential(\n    Linear(4, 8),\n    Linear(6, 2),\n)\n",
     4, 5, "Linear() expects 6 input features, but the op before it (Linear at line 3) produces 8"),
    ("from generator.eager import Sequential, Linear, SwiGLU\nm = Sequential(Linear(4, 7), SwiGLU())\n",
     2, 30, "SwiGLU() splits its input into two halves, but it receives 7 features (odd)"),
    ("from generator.eager import Sequential, GELU\nm = Sequential(GELU())\n",
     2, 5, "pipeline 'm' has no op that fixes the feature size"),
    ("from generator.eager import Sequential\nm = Sequential()\n",
     2, 5, "pipeline 'm' is empty"),
])
def test_errors_point_at_the_problem(source, line, col, message):
    err = error(source)
    assert message in err.message
    assert (err.location.line, err.location.col) == (line, col), str(err)
    first, text, caret = str(err).splitlines()
    assert first.startswith(f"spec.py:{line}:{col}: error: ")
    assert text.strip() == source.splitlines()[line - 1].strip()
    assert caret.index("^") == text.index(text.strip()) + col - 1 - (len(source.splitlines()[line - 1]) - len(source.splitlines()[line - 1].lstrip()))


def test_sizes_flow_backwards_to_ops_without_their_own():
    (spec,) = parse("""
        from generator.eager import Sequential, GELU, SwiGLU, Linear
        m = Sequential(GELU(), SwiGLU(), Linear(16, 4))
    """)
    pipeline = build_pipeline(spec)
    assert [(op.in_features, op.out_features) for op in pipeline.ops] == [(32, 32), (32, 16), (16, 4), (4, 4)]
