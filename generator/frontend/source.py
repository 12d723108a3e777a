"""A spec's text: bounded before any parser sees it, parsed, and pointed into by locations.

``SpecSource`` refuses text no spec is made of (too large, a NUL, a lone surrogate), parses it
with Python's parser and then libcst, and refuses syntax trees deeper than the nesting limit
before libcst recurses over them. Every SpecError of the frontend is placed through it: a line
and column in the file, with the line's text for the caret.
"""

from __future__ import annotations

import ast
import bisect
import io
import re
import tokenize
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import libcst as cst
from libcst.metadata import CodePosition, CodeRange, MetadataWrapper, PositionProvider
from libcst.metadata.position_provider import PositionProvidingCodegenState

from ..errors import Location, SpecError

# A spec declares pipelines: the largest shipped one is about 1,200 characters. libcst reads some
# 40,000 characters a second, so this bound reads any file in a few seconds.
MAX_SOURCE_CHARS = 100_000
# Syntax-tree depth (each call, bracket of a list and operator of a chain is a level; real specs
# stay under 15). libcst and its visitors recurse up to 7 Python frames a level, so 50 levels use
# about 350 of Python's default 1000; its native parser even overflows the C stack (a crash, not
# an exception) on a few thousand levels. Deeper files are refused before libcst sees them.
MAX_NESTING = 50
_MAX_INT_BITS = 256  # keeps `10 ** 10 ** 10` from hanging the compiler; no size gets near this


def _short(text: str, limit: int = 60) -> str:
    """Source text quoted in a message, cut so a huge expression cannot flood the terminal."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def nesting_hint() -> str:
    return ("a spec needs only constants and op calls, so split long expressions into named "
            "constants, one per line")


class _OffsetCodegenState(PositionProvidingCodegenState):
    """libcst's position pass (PositionProvider's code generation, the same hooks) keeping each
    node's start and end as character offsets into the text: building a line-and-column object
    pair per node and splitting every token on newlines was four fifths of the pass's time."""

    def __init__(self, module: cst.Module):
        super().__init__(default_indent=module.default_indent, default_newline=module.default_newline,
                         provider=None)
        self.offset = 0
        self.spans: dict[cst.CSTNode, tuple[int, int]] = {}
        self._starts: list[int] = []
        self.dropped = ""  # the file's last newline: gone from the code, counted in the offsets

    def text(self) -> str:
        """The text the offsets count: the code generated, its dropped last newline included."""
        return "".join(self.tokens) + self.dropped

    def pop_trailing_newline(self) -> None:
        if self.tokens:
            self.dropped = self.tokens.pop()

    def add_indent_tokens(self) -> None:
        self.tokens.extend(self.indent_tokens)
        self.offset += sum(map(len, self.indent_tokens))

    def add_token(self, value: str) -> None:
        self.tokens.append(value)
        self.offset += len(value)

    def before_codegen(self, node: cst.CSTNode) -> None:
        self._starts.append(self.offset)

    def after_codegen(self, node: cst.CSTNode) -> None:
        start = self._starts.pop()
        if node not in self.spans:  # a syntactic position recorded inside it stands
            self.spans[node] = (start, self.offset)

    @contextmanager
    def record_syntactic_position(self, node: cst.CSTNode, *, start_node: cst.CSTNode | None = None,
                                  end_node: cst.CSTNode | None = None) -> Iterator[None]:
        start = self.offset
        try:
            yield
        finally:
            self.spans[node] = (start if start_node is None else self.spans[start_node][0],
                                self.offset if end_node is None else self.spans[end_node][1])


class NodePositions(Mapping[cst.CSTNode, CodeRange]):
    """Every node's position, as libcst's PositionProvider gives it (line 1-based, column 0-based,
    the syntactic range), from character offsets: a CodeRange is made only for a node asked about."""

    def __init__(self, spans: dict[cst.CSTNode, tuple[int, int]], text: str):
        self._spans = spans
        # libcst's lines end at \n, \r\n or \r; the text it generated is the module's own
        self._line_starts = [0] + [m.end() for m in re.finditer(r"\r\n?|\n", text)]

    def _position(self, offset: int) -> CodePosition:
        line = bisect.bisect_right(self._line_starts, offset)
        return CodePosition(line, offset - self._line_starts[line - 1])

    def __getitem__(self, node: cst.CSTNode) -> CodeRange:
        start, end = self._spans[node]
        return CodeRange(self._position(start), self._position(end))

    def __iter__(self) -> Iterator[cst.CSTNode]:
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


def node_positions(module: cst.Module) -> Mapping[cst.CSTNode, CodeRange]:
    """Every node's position: libcst's PositionProvider pass run on its own, with offsets
    (_OffsetCodegenState). MetadataWrapper.resolve runs the same pass, then walks the whole tree
    once more for batchable providers even when none is asked (libcst/metadata/wrapper.py:
    _resolve_impl). Where a libcst release lays its code generation out otherwise, the wrapper's
    way (tests/frontend/test_positions.py holds the two equal)."""
    try:
        state = _OffsetCodegenState(module)
        module._codegen(state)
        return NodePositions(state.spans, state.text())
    except (AttributeError, TypeError):
        # the module is fresh and not shared, so the wrapper need not deep-copy it
        return MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)


class SpecSource:
    """One spec file's text and, once ``parse`` has run, its libcst module and node positions."""

    def __init__(self, source: str, display_path: str):
        self.display = display_path
        # Python reads \r\n and a lone \r as \n (libcst fails on a lone \r); lines and columns stay.
        self.source = re.sub(r"\r\n?", "\n", source)
        # Split like Python counts lines (str.splitlines also splits on \f, \x1c, ...).
        self.lines = re.split(r"\r\n|\r|\n", source)
        # Where a RecursionError from libcst is reported, should one slip past the nesting limit.
        self.deepest = self.location_at(1, 1)
        # Lines where a call or a := starts: only statements touching one need a scan for
        # Sequential(...) and :=, which would otherwise be most of the reading time of a long file;
        # a pipeline's own statement needs one only where a := starts (walrus_lines).
        self.scan_lines: set[int] = set()
        self.walrus_lines: set[int] = set()

    def parse(self, max_nesting: int) -> None:
        """Check the text, then parse it: first with Python's parser, then with libcst."""
        self.check_text()
        # Python's own parser reports syntax errors precisely (libcst's native parser often says
        # 1:1); ast.parse only parses, it never runs anything. It also guards libcst: it fails
        # cleanly on nesting that would crash libcst's native parser.
        try:
            with warnings.catch_warnings():  # e.g. "invalid escape sequence": Python's to give when the file runs
                warnings.simplefilter("ignore")
                tree = ast.parse(self.source, filename=self.display)
        except SyntaxError as err:
            self.reject_long_literal()
            raise SpecError(f"syntax error: {err.msg}", self.location_at(err.lineno or 1, err.offset or 1)) from None
        except (RecursionError, MemoryError):  # Python's parser ran out of stack on this nesting
            line, col = self.busiest_statement()
            raise SpecError(f"statement too deeply nested for Python's parser; {nesting_hint()}",
                            self.location_at(line, col)) from None
        self.check_nesting(tree, max_nesting)
        try:
            module = cst.parse_module(self.source)
        except cst.ParserSyntaxError as err:  # syntax Python accepts but libcst does not
            raise SpecError(f"syntax error: {err.message}",
                            self.location_at(err.editor_line, err.editor_column)) from None
        self.positions = node_positions(module)
        self.module = module

    # --- bounds ---------------------------------------------------------------------------------

    def check_text(self) -> None:
        """Refuse text no spec is made of, before any parser sees it."""
        if len(self.source) > MAX_SOURCE_CHARS:
            raise SpecError(f"spec file is too large ({len(self.source)} characters; fusegen reads at most "
                            f"{MAX_SOURCE_CHARS}); a spec declares pipelines, so move anything else to "
                            "another file", self.location_at_index(MAX_SOURCE_CHARS))
        if "\0" in self.source:
            raise SpecError("spec file contains a NUL character; save it as plain UTF-8 text",
                            self.location_at_index(self.source.index("\0")))
        try:
            self.source.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate: only a str built in memory has one
            # The message quotes the line, and printing a surrogate fails: show it as '?'.
            self.lines = [line.encode("utf-8", errors="replace").decode("utf-8") for line in self.lines]
            raise SpecError(f"spec text contains U+{ord(self.source[err.start]):04X}, a lone surrogate, "
                            "which is not a character; fix the text's encoding",
                            self.location_at_index(err.start)) from None

    def reject_long_literal(self) -> None:
        """Python refuses decimal literals of over 4300 digits (sys.int_info.str_digits_check_threshold)
        with a syntax error at the statement; say what is wrong, at the literal."""
        literal = re.search(r"(?<![\w.])[0-9][0-9_]{4299,}", self.source)
        if literal is not None:
            raise SpecError(f"number too large: a literal of {len(literal.group().replace('_', ''))} digits; sizes and "
                            f"constants stay far below 2**{_MAX_INT_BITS}", self.location_at_index(literal.start()))

    def check_nesting(self, tree: ast.AST, max_nesting: int) -> None:
        """Refuse syntax trees deeper than ``max_nesting``, at the first node too deep.

        Iterative, in source order: the check itself must not recurse.
        """
        stack: list[tuple[ast.AST, int]] = [(tree, 0)]
        deepest = 0
        while stack:
            node, depth = stack.pop()
            if isinstance(node, (ast.Call, ast.NamedExpr)):
                self.scan_lines.add(node.lineno)
            if isinstance(node, ast.NamedExpr):
                self.walrus_lines.add(node.lineno)
            if hasattr(node, "lineno"):  # statements, expressions, arguments; not Load or Add
                depth += 1
                if depth > deepest:
                    deepest, self.deepest = depth, self.ast_location(node)
                if depth > max_nesting:
                    raise SpecError(f"expression nested too deeply (more than {max_nesting} levels: each call, bracket "
                                    f"and operator of a chain counts one); {nesting_hint()}",
                                    self.ast_location(node))
            stack.extend((child, depth) for child in reversed(list(ast.iter_child_nodes(node))))

    def busiest_statement(self) -> tuple[int, int]:
        """(line, col) of the statement with the most tokens: where Python's parser gave up.

        Python's tokenizer is iterative, so it copes with any nesting; it stops at the first
        token error, keeping the busiest statement seen so far.
        """
        best, best_count, start, count = (1, 1), -1, None, 0
        try:
            for token in tokenize.generate_tokens(io.StringIO(self.source, newline=None).readline):
                if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                    if start is not None and count > best_count:
                        best, best_count = start, count
                    start, count = None, 0
                elif token.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
                    if start is None:
                        start = (token.start[0], token.start[1] + 1)
                    count += 1
        except (tokenize.TokenError, SyntaxError):
            if start is not None and count > best_count:
                best = start
        return best

    # --- locations ------------------------------------------------------------------------------

    def location_at(self, line: int, col: int) -> Location:
        """A location inside the file: a line past the end (Python reports some errors at end of
        file there) becomes the end of the last line."""
        last = len(self.lines) - 1 if len(self.lines) > 1 and self.lines[-1] == "" else len(self.lines)
        if line > last:
            line, col = last, len(self.lines[last - 1]) + 1
        line = max(line, 1)
        return Location(self.display, line, max(col, 1), self.lines[line - 1])

    def location_at_index(self, index: int) -> Location:
        """The location of ``self.source[index]``."""
        before = self.source[:index]
        newlines = list(re.finditer(r"\r\n|\r|\n", before))
        line_start = newlines[-1].end() if newlines else 0
        return self.location_at(len(newlines) + 1, index - line_start + 1)

    def ast_location(self, node: ast.AST) -> Location:
        """An ast node's start; ast columns count UTF-8 bytes, ours count characters."""
        line = getattr(node, "lineno", 1)
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        prefix = text.encode("utf-8")[:getattr(node, "col_offset", 0)].decode("utf-8", errors="ignore")
        return self.location_at(line, len(prefix) + 1)

    def loc(self, node: cst.CSTNode) -> Location:
        start = self.positions[node].start
        return self.location_at(start.line, start.column + 1)  # libcst columns are 0-based

    def code(self, node: cst.CSTNode) -> str:
        return _short(self.module.code_for_node(node).strip().rstrip(",").strip())
