"""A spec's own text pasted into generated files (source_text.py): each form reads back as the
text (a string literal exactly; a comment, a docstring and a Markdown cell on one line), whatever
quotes, backslashes, line breaks and characters it holds."""

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
