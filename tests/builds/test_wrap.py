"""Generated Python is at most 100 columns wide (generator/wrap.py), and wrapping never changes
what the code means."""

import ast
from pathlib import Path

import pytest

from fusegen.wrap import MAX_COLUMNS, wrap_python

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [ROOT / "generated", ROOT / "tests/fixtures/plugin_project/generated_ext"]
GENERATED_PY = sorted(p for package in PACKAGES for p in package.glob("*.py"))


def same_meaning(a: str, b: str) -> bool:
    return ast.dump(ast.parse(a)) == ast.dump(ast.parse(b))


def code_meaning(source: str) -> str:
    """The AST without docstrings (whose text wrapping refills)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0].value.value = " ".join(body[0].value.value.split())
    return ast.dump(tree)


@pytest.mark.parametrize("path", GENERATED_PY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_wrapping_generated_code_much_narrower_keeps_its_meaning(path):
    """Every construct the templates emit, wrapped at 60 columns: the same program."""
    text = path.read_text()
    narrow = wrap_python(text, width=60)
    assert narrow != text
    assert code_meaning(narrow) == code_meaning(text)
    assert wrap_python(narrow, width=60) == narrow


@pytest.mark.parametrize("path", GENERATED_PY, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_generated_python_fits_in_100_columns(path):
    text = path.read_text()
    wide = [(n, len(line)) for n, line in enumerate(text.splitlines(), start=1) if len(line) > MAX_COLUMNS]
    assert not wide, f"{path}: lines wider than {MAX_COLUMNS} columns (line, width): {wide[:10]}"
    assert wrap_python(text) == text, "wrapped output wraps to itself"


CASES = {
    "call": "        outputs = PipelineFunction.apply(x, norm_weight, norm_bias, linear_weight, linear_bias, fc2_weight, fc2_bias)",
    "def": "    def forward(ctx, x, layernorm0_weight, layernorm0_bias, linear1_weight, linear1_bias, linear3_weight, linear3_bias):",
    "comment": "        d_x, d_w = kernels.rmsnorm_bwd_h4096(d_out, x, rstd, weight)  # the norm's backward, one kernel and a column sum",
    "tuple of one": "    single = (a_very_long_name_for_a_tensor_that_goes_on_and_on_and_on_and_on_and_on_and_on_and_on_and_on,)",
    "nested": "    launch(dtype, (grid_x, splits, 1), (128, 1, 1), (dy.data_ptr(), x.data_ptr(), bias0.data_ptr(), dx.data_ptr(), partials.data_ptr(), rows), dy.get_device())",
    "f-string": "    raise ValueError(f\"{module}: {name} must have [..., {features}], got {list(t.shape)}\", name, {dict(a=1)[\"a\"]: 2})",
    "long name and callee": "    layer2_layernorm_qkv_layer_norm_pre_make_extra_output = kernels.bias_dropout0p1_add_layernorm_fwd_h256_no_grad(a, b, c)",
    "assignment target": "    x, layernorm0_weight, layernorm0_bias, linear1_weight = ref.to_autocast_dtype(x.device.type, x, layernorm0_weight, layernorm0_bias, linear1_weight)",
}


def in_context(line):
    """``line`` inside a function, at its own indent (a def gets a body)."""
    depth = (len(line) - len(line.lstrip())) // 4
    outer = "".join("    " * d + ("def f():" if d == 0 else "if True:") + "\n" for d in range(depth))
    body = "    " * (depth + 1) + "pass\n" if line.lstrip().startswith("def ") else ""
    return outer + line + "\n" + body


@pytest.mark.parametrize("line", list(CASES.values()), ids=list(CASES))
def test_wrapping_keeps_the_meaning(line):
    source = in_context(line)
    wrapped = wrap_python(source)
    assert wrapped != source
    assert all(len(row) <= MAX_COLUMNS for row in wrapped.splitlines()), wrapped
    assert same_meaning(source, wrapped), wrapped
    assert wrap_python(wrapped) == wrapped


def test_the_shape_of_a_wrapped_call():
    line = "    outputs = PipelineFunction.apply(" + ", ".join(f"argument_{k}" for k in range(12)) + ")"
    assert wrap_python(line).split("\n") == [
        "    outputs = PipelineFunction.apply(",
        "        argument_0, argument_1, argument_2, argument_3, argument_4, argument_5, argument_6,",
        "        argument_7, argument_8, argument_9, argument_10, argument_11)",
    ]


def test_a_trailing_comment_moves_above_its_statement():
    line = "    y = kernels.gelu_fwd_n4096(x)  # " + "why " * 20
    assert wrap_python(line).split("\n") == ["    # " + ("why " * 20).rstrip(), "    y = kernels.gelu_fwd_n4096(x)"]
    long = "    y = kernels.gelu_fwd_n4096(x)  # " + "why " * 30
    assert wrap_python(long).split("\n") == [
        "    # " + ("why " * 23).rstrip(), "    # " + ("why " * 7).rstrip(), "    y = kernels.gelu_fwd_n4096(x)"]


def test_docstring_text_is_refilled_and_other_strings_left_alone():
    words = "word " * 30
    source = f'def f():\n    """Summary.\n\n    {words}\n    """\n    return """\n{words}\n"""\n'
    wrapped = wrap_python(source).split("\n")
    assert wrapped[3:5] == ["    " + ("word " * 19).rstrip(), "    " + ("word " * 11).rstrip()]
    assert wrapped[7] == words, "a string that is not a docstring is a value: left as it is"


def test_a_summary_line_that_is_too_wide_becomes_a_multi_line_docstring():
    source = 'def f():\n    """' + "word " * 25 + 'end."""\n'
    wrapped = wrap_python(source)
    assert all(len(line) <= MAX_COLUMNS for line in wrapped.split("\n"))
    assert wrapped.split("\n")[-2:] == ['    """', ""]
    assert " ".join(ast.get_docstring(ast.parse(wrapped).body[0]).split()) == ("word " * 25 + "end.").strip()


def test_a_string_outside_brackets_stays_whole():
    """Adjacent literals on separate lines are one expression only inside brackets."""
    source = "def f():\n    '" + "word " * 25 + "'\n    return 1\n"
    assert wrap_python(source) == source
    ast.parse(wrap_python(source))
