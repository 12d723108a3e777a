"""A spec's own text pasted into generated files (source_text.py): each form reads back as the
text (a string literal exactly; a comment, a docstring and a Markdown cell on one line), whatever
quotes, backslashes, line breaks and characters it holds."""

import random
import re

import pytest

from fusegen.source_text import comment_text, docstring_text, md_code, one_line, py_string

TEXTS = [
    "Attention(8)",
    'Attention(8, kind="causal")',
    "Attention(8, kind='causal')",
    'A(s="it\'s \\"x\\"")',
    "A(p='C:\\\\dir\\\\')",
    'A(s="""x""")',
    'A(s="ends in a quote"',
    "A(s='tab\there', u='é ü ✓', sep='\u2028', nul='\x00', bell='\x07')",
    "A(\n    8,  # heads\n    kind='a|b`c``d',\r\n)",
    "\\",
    '"',
]


@pytest.mark.parametrize("text", TEXTS)
def test_a_string_literal_holds_the_text_exactly(text):
    literal = py_string(text)
    assert eval(literal) == text
    assert "\n" not in literal and "\r" not in literal and "\u2028" not in literal


def test_a_string_literal_uses_the_quotes_that_need_no_escape():
    assert py_string("Linear(8, 8)") == '"Linear(8, 8)"'
    assert py_string('Attention(8, kind="causal")') == "'Attention(8, kind=\"causal\")'"


@pytest.mark.parametrize("text", TEXTS)
def test_a_comment_stays_on_its_line(text):
    comment = comment_text(text)
    assert comment.splitlines() == [comment] or comment == ""
    assert compile(f"x = 1  # {comment}\n", "c.py", "exec")  # no line break ends it, nothing is refused


@pytest.mark.parametrize("text", TEXTS)
def test_a_docstring_reads_back_as_the_text_on_one_line(text):
    body = docstring_text(text)
    namespace = {}
    exec(f'def f():\n    """Calls {body}"""\n', namespace)
    assert namespace["f"].__doc__ == f"Calls {one_line(text)}"
    assert "\n" not in body and "\u2028" not in body  # and its source is one line


@pytest.mark.parametrize("text", TEXTS)
def test_a_markdown_cell_is_one_code_span_in_one_cell(text):
    cell = md_code(text)
    assert "\n" not in cell and len(re.split(r"(?<!\\)\|", f"| {cell} |")) == 3
    fence = re.match("`+", cell).group()
    assert cell.endswith(fence) and fence not in cell[len(fence):-len(fence)]


def test_random_string_arguments_of_a_user_module_give_packages_that_compile(tmp_path):
    """Calls of a user module with random string literals (quotes, backslashes, escapes, pipes,
    backticks, non-ASCII, line and paragraph separators): every generated Python file compiles,
    and the messages quote the call as the frontend reads it. Seeded, so a failure reproduces."""
    import ast

    from fusegen import build

    pieces = ['"', "'", '"""', "\\", "\\n", "é", "✓", "\u2028", "\t", "\n", "|", "`", "#", "{", "}", "x", " "]
    rng = random.Random(36)
    for case in range(24):
        value = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        literal = repr(value) if case % 3 else '"""' + value.replace("\\", "\\\\").replace('"', '\\"') + '"""'
        spec = (f"import transformer_engine.pytorch as te\nfrom layers import Tag\n\n"
                f"block = te.ops.Sequential(te.ops.Linear(8, 8), Tag(8, label={literal}), te.ops.Linear(8, 8))\n")
        (tmp_path / "spec.py").write_text(spec, encoding="utf-8")
        config = build.Config((tmp_path / "spec.py",), tmp_path / "pkg", archs=(), dtypes=("float32",),
                              root=tmp_path)
        files = build.build_package(config)
        source = files["block.py"].decode("utf-8")
        compile(source, "block.py", "exec")
        messages = [ast.literal_eval(node.args[1]) for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "run_module"]
        assert len(messages) == 2 and all(m.startswith("Tag(8, label=") and " (op 1 at spec.py:4:" in m for m in messages)
