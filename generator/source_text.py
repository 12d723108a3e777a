"""A spec's own text (a user module's call as written, a file name) pasted into generated files.

That text may hold anything a Python source can: quotes, backslashes, line breaks (a call over
several lines), characters outside ASCII. Each place it lands has its own escaping: a string
literal, a comment, a docstring, a Markdown code span in a plan's table. Every template and stage
that pastes such text goes through these.
"""

from __future__ import annotations

import re

_LINE_BREAK = re.compile(r"[ \t]*(?:\r\n|\r|\n)\s*")


def _escape_unprintable(text: str) -> str:
    """Characters a reader cannot see or that end a line (tabs, U+2028, control characters) as
    Python's escapes; the printable ones, non-ASCII included, as they are."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def one_line(text: str) -> str:
    """A call written over several lines on one: each line break with the indentation around it
    becomes one space."""
    return _LINE_BREAK.sub(" ", text)


def py_string(text: str) -> str:
    """A Python string literal whose value is exactly ``text``: in double quotes, or in single
    ones where that saves escaping (``'kind="causal"'``)."""
    quote = "'" if '"' in text and "'" not in text else '"'
    escaped = text.replace("\\", "\\\\").replace(quote, "\\" + quote)
    return f"{quote}{_escape_unprintable(escaped)}{quote}"


def comment_text(text: str) -> str:
    """``text`` for a ``#`` comment: on one line, nothing unprintable."""
    return _escape_unprintable(one_line(text))


def docstring_text(text: str) -> str:
    """``text`` for the inside of a triple-double-quoted docstring, which reads back as ``text``
    on one line: backslashes doubled, quotes escaped only where three would close it."""
    escaped = comment_text(text.replace("\\", "\\\\"))
    if '"""' in escaped:
        return escaped.replace('"', '\\"')
    return escaped[:-1] + '\\"' if escaped.endswith('"') else escaped  # a quote before the closing three


def md_code(text: str) -> str:
    """``text`` as a Markdown code span in a table cell: on one line, fenced with more backticks
    than it holds in a row, its pipes escaped (a table would split the cell at them)."""
    text = comment_text(text).replace("|", "\\|")
    fence = "`" * (1 + max((len(run) for run in re.findall("`+", text)), default=0))
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"
