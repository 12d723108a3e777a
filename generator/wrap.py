"""Generated Python at most MAX_COLUMNS wide, wrapped the way a careful hand would wrap it.

The templates write each statement on one line, as it reads best in the template; this pass
breaks a line that is too wide inside its last bracket pair, one level at a time:

    d_x, d_weight = kernels.rmsnorm_bwd_h4096(d_out, x, rstd, weight)   # fits: unchanged
    outputs = PipelineFunction.apply(
        x, norm_weight, linear_weight, linear_bias, ...)                # items filled to the width

A trailing comment moves to its own line above the statement; a bare tuple ("a, b = ...",
"return a, b") gets parentheses to break inside; a long string inside brackets becomes adjacent
literals. A docstring's text is refilled at its own indent; other multi-line strings are values
and stay as they are. Deterministic on every Python (3.12's tokenizer splits f-strings and
refuses unbalanced brackets: both are treated alike here) and idempotent: wrapped text is left
alone.
"""

from __future__ import annotations

import functools
import io
import keyword
import re
import textwrap
import tokenize

MAX_COLUMNS = 100
INDENT = 4
_OPEN, _CLOSE = "([{", ")]}"


@functools.lru_cache(maxsize=1024)
def wrap_python(source: str, width: int = MAX_COLUMNS) -> str:
    """``source`` with each line wider than ``width`` wrapped (see the module's docstring).

    A pure function of its text, remembered: Python's tokenizer makes it a third of a build's time
    outside NVRTC, and a process that builds again (a library user's, the tests') mostly wraps the
    same files again."""
    kinds = _line_kinds(source)
    out: list[str] = []
    for number, line in enumerate(source.split("\n"), start=1):
        kind = kinds.get(number, "code")
        if len(line) <= width or kind == "string":
            out.append(line)
        elif kind == "docstring":
            out.extend(_refill(line, width))
        else:
            out.extend(_wrap_line(line, width, inside_brackets=kind == "continuation"))
    return "\n".join(out)


def _line_kinds(source: str) -> dict[int, str]:
    """{line number: kind} for lines that are not plain code: "docstring" (text of a docstring,
    its first line included), "string" (inside another multi-line string: left as it is) or
    "continuation" (a line that starts inside brackets)."""
    kinds: dict[int, str] = {}
    depth, previous = 0, tokenize.NEWLINE
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.NL and depth:
                kinds.setdefault(token.end[0] + 1, "continuation")
            if token.type == tokenize.STRING and token.end[0] > token.start[0]:
                statement = previous in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
                for number in range(token.start[0], token.end[0] + 1):
                    if statement or number > token.start[0]:
                        kinds[number] = "docstring" if statement else "string"
            if token.type == tokenize.OP and token.string in _OPEN:
                depth += 1
            elif token.type == tokenize.OP and token.string in _CLOSE:
                depth -= 1
            if token.type not in (tokenize.NL, tokenize.COMMENT):
                previous = token.type
    except (tokenize.TokenError, SyntaxError):  # not Python after all: wrap nothing
        return {number: "string" for number in range(1, source.count("\n") + 2)}
    return kinds


def _refill(line: str, width: int) -> list[str]:
    """A docstring's line, broken at spaces into lines of its own indent (text, not code)."""
    indent = line[:len(line) - len(line.lstrip())]
    rows = textwrap.wrap(line.strip(), width - len(indent), break_long_words=False, break_on_hyphens=False)
    return [indent + row for row in rows] or [line]


_SKIPPED = (tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)
# Python 3.12 tokenizes an f-string's pieces, its braces among them: they are not brackets here.
_FSTRING_START, _FSTRING_END = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)


def _tokens(text: str) -> list[tokenize.TokenInfo] | None:
    """The line's tokens, an f-string's inner tokens left out (so every Python tokenizes alike)."""
    kept, fstrings = [], 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == _FSTRING_START:
                fstrings += 1
            elif token.type == _FSTRING_END:
                fstrings -= 1
            elif not fstrings and token.type not in _SKIPPED:
                kept.append(token)
    except (tokenize.TokenError, SyntaxError):
        return None
    depth = 0
    for token in kept:  # unbalanced: Python 3.12's tokenizer refuses what 3.11's accepts; both refuse
        if token.type == tokenize.OP and token.string in _OPEN + _CLOSE:
            depth += 1 if token.string in _OPEN else -1
            if depth < 0:
                return None
    return kept if depth == 0 else None


def _wrap_line(line: str, width: int, inside_brackets: bool = False) -> list[str]:
    indent = line[:len(line) - len(line.lstrip())]
    stripped = line.strip()
    # A line this pass made that starts with a closing bracket (") = call(...)"): tokenized with the
    # closer blanked, so that every Python's tokenizer sees balanced brackets.
    closer = stripped[:1] if stripped[:1] in _CLOSE else ""
    tokens = _tokens(" " * len(closer) + stripped[len(closer):])
    if not tokens:
        return [line]
    if tokens[0].type == tokenize.COMMENT:  # a comment of its own: its text refilled
        text = tokens[0].string.lstrip("#").strip()
        return [indent + "# " + row for row in textwrap.wrap(text, width - len(indent) - 2, break_long_words=False)]
    if len(tokens) <= 2 and tokens[0].type == tokenize.STRING and (len(tokens) == 1 or tokens[1].string == ","):
        after = "," if len(tokens) == 2 else ""
        return _wrap_string(indent, tokens[0].string, after, width, inside_brackets) or [line]
    code_end = len(line.strip())
    comment = ""
    if tokens[-1].type == tokenize.COMMENT:
        comment = tokens[-1].string
        code_end = tokens[-1].start[1]
        tokens = tokens[:-1]
    code = line.strip()[:code_end].rstrip()
    if comment:  # the comment goes above the statement it ends
        head = _wrap_line(indent + comment, width) if len(indent + comment) > width else [indent + comment]
        if len(indent + code) <= width:
            return head + [indent + code]
        return head + _wrap_line(indent + code, width)
    for open_col, close_col in reversed(_bracket_pairs(tokens)):  # the last pair that helps
        lines = _wrap_inside(indent, code, open_col, close_col, width)
        if lines is not None:
            # an item that alone is too wide wraps inside its own brackets, one level down (its
            # line is inside brackets now, the first line stays where the statement was)
            return [wrapped for k, part in enumerate(lines)
                    for wrapped in (_wrap_line(part, width, inside_brackets or k > 0) if len(part) > width else [part])]
    bare = None if inside_brackets else _bare_tuple(tokens)
    if bare is not None:  # "a, b = value", "return a, b", "from m import a, b": parenthesised
        start, end = bare
        return _wrap_line(f"{indent}{code[:start]}({code[start:end].strip()}){code[end:]}", width)
    value_at = None if inside_brackets else _assigned_value(tokens)
    if value_at is not None:  # "name = call(...)" where the name and the callee alone are too wide: the
        # value in parentheses of its own, one level down, wrapped there
        inner = _wrap_line(indent + " " * INDENT + code[value_at:].strip(), width, True)
        return [f"{indent}{code[:value_at].rstrip()} ("] + inner + [indent + ")"]
    items = _split_items(code) if inside_brackets and not closer else []
    if len(items) > 1:  # items of an enclosing bracket: refilled at their indent
        lines, current = [], ""
        ending = "," if code.endswith(",") else ""
        for i, item in enumerate(items):
            piece = item + ("," if i < len(items) - 1 else ending)
            candidate = f"{current} {piece}" if current else indent + piece
            if current and len(candidate) > width:
                lines.append(current)
                candidate = indent + piece
            current = candidate
        lines.append(current)
        return [wrapped for part in lines
                for wrapped in (_wrap_line(part, width, True) if len(part) > width else [part])]
    return [line]


def _wrap_inside(indent: str, code: str, open_col: int, close_col: int, width: int) -> list[str] | None:
    """``code`` broken after the bracket at ``open_col``, its items filled to ``width``; None when
    that does not make the first line fit."""
    inner = code[open_col + 1:close_col]
    items = _split_items(inner)
    before, after = code[:open_col + 1], code[close_col:]
    if not items or len(indent + before) > width:
        return None
    if inner.rstrip().endswith(","):  # keep it: "(x,)" is a tuple, "(x)" is not
        items[-1] += ","
    # a def's parameters one level deeper than its body, as PEP 8 asks
    item_indent = indent + " " * (2 * INDENT if code.startswith("def ") else INDENT)
    lines, current = [indent + before], ""
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        candidate = f"{current} {piece}" if current else item_indent + piece
        if current and len(candidate + (after if i == len(items) - 1 else "")) > width:
            lines.append(current)
            candidate = item_indent + piece
        current = candidate
    last = current + after
    if len(last) > width and after:
        lines += [current, indent + after]
    else:
        lines.append(last)
    return lines


def _bracket_pairs(tokens) -> list[tuple[int, int]]:
    """(column of the opening, column of the closing) of each outermost bracket pair, in order:
    a call's, a def's parameter list, a tuple's, a subscript's."""
    depth, opened, pairs = 0, None, []
    for token in tokens:
        if token.type != tokenize.OP:
            continue
        if token.string in _OPEN:
            if depth == 0:
                opened = token.start[1]
            depth += 1
        elif token.string in _CLOSE and depth > 0:
            depth -= 1
            if depth == 0:
                pairs.append((opened, token.start[1]))
    return pairs


def _bare_tuple(tokens) -> tuple[int, int] | None:
    """(start, end) columns of an unbracketed comma list that parentheses may enclose without
    changing the statement: assignment targets ("a, b = ..."), a return value ("return a, b") or
    imported names ("from m import a, b"); None for anything else."""
    words = [t.string for t in tokens]
    if words[:1] == ["return"] and "," in words:
        return tokens[1].start[1], tokens[-1].end[1]
    if words[:1] == ["from"] and "import" in words and "," in words:
        first = tokens[words.index("import") + 1]
        return first.start[1], tokens[-1].end[1]
    if "=" in words:
        equals = words.index("=")
        before = tokens[:equals]
        if before and "," in words[:equals] and all(t.type == tokenize.NAME or t.string in ",." for t in before):
            return before[0].start[1], before[-1].end[1]
    return None


def _assigned_value(tokens) -> int | None:
    """The column where the value of a one-name assignment ("name = value") starts, or None."""
    words = [t.string for t in tokens]
    if len(tokens) > 2 and tokens[0].type == tokenize.NAME and words[1] == "=" and words[0] not in keyword.kwlist:
        return tokens[2].start[1]
    return None


def _split_items(inner: str) -> list[str]:
    """The comma-separated items at the top level of a bracket's contents, stripped."""
    tokens = _tokens(inner)
    if tokens is None:
        return []
    depth, cuts = 0, []
    for token in tokens:
        if token.type != tokenize.OP:
            continue
        if token.string in _OPEN:
            depth += 1
        elif token.string in _CLOSE:
            depth -= 1
        elif token.string == "," and depth == 0:
            cuts.append(token.start[1])
    pieces, start = [], 0
    for cut in cuts:
        pieces.append(inner[start:cut].strip())
        start = cut + 1
    tail = inner[start:].strip()
    if tail:
        pieces.append(tail)
    return [p for p in pieces if p]


def _wrap_string(indent: str, literal: str, after: str, width: int, inside_brackets: bool) -> list[str] | None:
    """A line that is one string literal: a docstring becomes a multi-line docstring, a plain
    string inside brackets adjacent literals, each split at a space. None: left as is (a prefixed
    or escaped string, whose pieces could mean something else, or one outside brackets, where
    adjacent literals on separate lines would not be one expression)."""
    room = width - len(indent)
    if literal.startswith('"""') and literal.endswith('"""') and not after and "\\" not in literal:
        text = literal[3:-3]
        lines = textwrap.wrap(text, room - 3, break_long_words=False, break_on_hyphens=False)
        if not lines or '"' in text[-1:]:
            return None
        return [indent + '"""' + lines[0]] + [indent + row for row in lines[1:]] + [indent + '"""']
    quote = literal[:1]
    if not inside_brackets or quote not in "\"'" or literal.count(quote) != 2 or "\\" in literal:
        return None
    pieces, current = [], ""
    for word in re.findall(r"\S+\s*|\s+", literal[1:-1]):  # each word with the spaces after it
        # the piece keeps the word's trailing space where another piece follows: count it
        if current and len(current + word.rstrip()) + 2 + max(len(after), len(word) - len(word.rstrip())) > room:
            pieces.append(current)
            current = ""
        current += word
    pieces.append(current)
    out = [indent + quote + piece + quote for piece in pieces]
    out[-1] += after
    return out if len(out) > 1 else None
