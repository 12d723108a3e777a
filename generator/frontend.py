"""The spec frontend: reads a spec file with libcst, never importing or running it.

Every module-level ``NAME = Sequential(...)`` becomes a ``SequentialSpec``: the op calls in order,
their arguments bound to the op registry's signatures (defaults filled in) and source locations for
error messages. Spellings follow Transformer Engine (``te.ops.Linear``, ``from
transformer_engine.pytorch.ops import Linear as L``) or fusegen's eager module (``fusegen.eager``).
Arguments may be literals, module-level constants defined earlier, and arithmetic on them.

The file is read top to bottom like Python would run it, so a constant means the value of its
latest assignment above the use. Anything fusegen cannot evaluate makes the name unusable rather
than silently keeping an older value; a statement that would bind a name in a way fusegen cannot
follow (``:=``, unpacking) is an error, and so is a Sequential(...) that only code would build.

Whatever the text, the result is specs or a SpecError inside the file, never another exception:
the file's size, its nesting depth and every number in it are bounded before anything recurses
over it or converts it.
"""

from __future__ import annotations

import ast
import io
import math
import operator
import re
import tokenize
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .ops import OPS, REQUIRED, SEQUENTIAL, Arg, OpDef
from .errors import Location, SpecError
from .names import NameTable

OP_MODULES = ("transformer_engine.pytorch.ops", "fusegen.eager")

_BINARY = {
    cst.Add: operator.add, cst.Subtract: operator.sub, cst.Multiply: operator.mul,
    cst.Divide: operator.truediv, cst.FloorDivide: operator.floordiv, cst.Modulo: operator.mod,
    cst.Power: operator.pow,
}
# `H *= 2` is `H = H * 2`.
_AUGMENTED = {
    cst.AddAssign: operator.add, cst.SubtractAssign: operator.sub, cst.MultiplyAssign: operator.mul,
    cst.DivideAssign: operator.truediv, cst.FloorDivideAssign: operator.floordiv,
    cst.ModuloAssign: operator.mod, cst.PowerAssign: operator.pow,
}
_MAX_INT_BITS = 256  # keeps `10 ** 10 ** 10` from hanging the compiler; no size gets near this
_ALLOWED = "only literals, module-level constants and + - * / // % ** are allowed"
# A spec declares pipelines: the largest shipped one is about 1,200 characters. libcst reads some
# 40,000 characters a second, so this bound reads any file in a few seconds.
MAX_SOURCE_CHARS = 100_000
# Syntax-tree depth (each call, bracket of a list and operator of a chain is a level; real specs
# stay under 15). libcst and its visitors recurse up to 7 Python frames a level, so 50 levels use
# about 350 of Python's default 1000; its native parser even overflows the C stack (a crash, not
# an exception) on a few thousand levels. Deeper files are refused before libcst sees them.
MAX_NESTING = 50
# Ops in one Sequential (Linear counts once; real pipelines have tens). The planner slides each
# rule over the ops, quadratic in their number, so this keeps planning well under a second.
MAX_OPS = 1000


@dataclass(frozen=True)
class OpCall:
    op: str  # registry name (ops.OPS), aliases resolved
    args: dict[str, object]  # every argument of the op by name, defaults filled in
    location: Location  # the call
    arg_locations: dict[str, Location]  # where each explicitly given argument is written


@dataclass(frozen=True)
class SequentialSpec:
    name: str  # the module-level variable
    file: str  # display path
    location: Location  # the Sequential(...) call
    calls: tuple[OpCall, ...]
    name_location: Location  # the NAME of NAME = Sequential(...)


def _dotted(node: cst.BaseExpression) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return _ident(node.value)
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return f"{base}.{_ident(node.attr.value)}" if base else None
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _ident(name: str) -> str:
    """A name as Python binds it: identifiers are NFKC-normalised ('ﬁ' is 'fi'); libcst gives the raw text."""
    return unicodedata.normalize("NFKC", name)


def _short(text: str, limit: int = 60) -> str:
    """Source text quoted in a message, cut so a huge expression cannot flood the terminal."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Bindings(cst.CSTVisitor):
    """Names a compound statement (if/for/try/with...) binds at module scope, and its imports.

    Function and class bodies are their own scopes: only the def/class name itself is bound.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.imports: list[cst.Import | cst.ImportFrom] = []

    def add_target(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Name):
            self.names.append(_ident(node.value))
        elif isinstance(node, (cst.Tuple, cst.List)):
            for element in node.elements:
                self.add_target(element.value)
        elif isinstance(node, cst.StarredElement):
            self.add_target(node.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.names.append(_ident(node.name.value))
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.names.append(_ident(node.name.value))
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self.add_target(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self.add_target(node.target)

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self.add_target(node.target)

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        self.add_target(node.target)

    def visit_For(self, node: cst.For) -> None:
        self.add_target(node.target)

    def visit_AsName(self, node: cst.AsName) -> None:  # with ... as x, except E as x
        self.add_target(node.name)

    def visit_Del(self, node: cst.Del) -> None:
        self.add_target(node.target)

    def visit_Import(self, node: cst.Import) -> bool:
        self.imports.append(node)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        self.imports.append(node)
        return False


class _Scan(cst.CSTVisitor):
    """One pass over a module-level statement for what the reader must refuse in it.

    Calls to Sequential anywhere (to reject ones that are not NAME = ...), function and lambda
    bodies too: fusegen never runs them, so a pipeline built there would be silently missing.
    And ``:=`` expressions that bind a module-level name: not those in a lambda body, its own
    scope (its parameter defaults are evaluated where it stands).
    """

    def __init__(self, reader: _SpecReader) -> None:
        self.reader = reader
        self.sequential: list[cst.Call] = []
        self.walruses: list[cst.NamedExpr] = []
        self.lambda_bodies = 0

    def visit_Lambda_body(self, node: cst.Lambda) -> None:
        self.lambda_bodies += 1

    def leave_Lambda_body(self, node: cst.Lambda) -> None:
        self.lambda_bodies -= 1

    def visit_NamedExpr(self, node: cst.NamedExpr) -> None:
        if not self.lambda_bodies:
            self.walruses.append(node)

    def visit_Call(self, node: cst.Call) -> None:
        if self.reader.op_name(node) == SEQUENTIAL:
            self.sequential.append(node)


# What a compound statement is called in messages, by its type.
_KEYWORDS = {
    cst.If: "if", cst.For: "for", cst.While: "while", cst.Try: "try", cst.TryStar: "try", cst.With: "with",
    cst.Match: "match", cst.FunctionDef: "def", cst.ClassDef: "class",
}


class _SpecReader:
    def __init__(self, source: str, display_path: str):
        self.display = display_path
        # Python reads \r\n and a lone \r as \n (libcst fails on a lone \r); lines and columns stay.
        self.source = re.sub(r"\r\n?", "\n", source)
        # Split like Python counts lines (str.splitlines also splits on \f, \x1c, ...).
        self.lines = re.split(r"\r\n|\r|\n", source)
        # Where a RecursionError from libcst is reported, should one slip past MAX_NESTING.
        self.deepest = self.location_at(1, 1)
        # Lines where a call or a := starts: only statements touching one need a _Scan, which
        # would otherwise be most of the reading time of a long file.
        self.scan_lines: set[int] = set()
        self.aliases: dict[str, str] = {}  # local name -> dotted import path
        self.constants: dict[str, object] = {}  # module-level constant -> current value
        self.not_constant: dict[str, str] = {}  # name -> why it cannot be used as a constant
        self.names = NameTable()  # pipelines of this file

    def parse(self) -> None:
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
            raise SpecError(f"statement too deeply nested for Python's parser; {self.nesting_hint()}",
                            self.location_at(line, col)) from None
        self.check_nesting(tree)
        try:
            module = cst.parse_module(self.source)
        except cst.ParserSyntaxError as err:  # syntax Python accepts but libcst does not
            raise SpecError(f"syntax error: {err.message}",
                            self.location_at(err.editor_line, err.editor_column)) from None
        # The fresh module is not shared, so the wrapper need not deep-copy it (the copy would
        # be most of the reading time).
        self.wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        self.positions = self.wrapper.resolve(PositionProvider)
        self.module = self.wrapper.module

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

    @staticmethod
    def nesting_hint() -> str:
        return ("a spec needs only constants and op calls, so split long expressions into named "
                "constants, one per line")

    def check_nesting(self, tree: ast.AST) -> None:
        """Refuse syntax trees deeper than MAX_NESTING, at the first node too deep.

        Iterative, in source order: the check itself must not recurse.
        """
        stack: list[tuple[ast.AST, int]] = [(tree, 0)]
        deepest = 0
        while stack:
            node, depth = stack.pop()
            if isinstance(node, (ast.Call, ast.NamedExpr)):
                self.scan_lines.add(node.lineno)
            if hasattr(node, "lineno"):  # statements, expressions, arguments; not Load or Add
                depth += 1
                if depth > deepest:
                    deepest, self.deepest = depth, self.ast_location(node)
                if depth > MAX_NESTING:
                    raise SpecError(f"expression nested too deeply (more than {MAX_NESTING} levels: each call, bracket "
                                    f"and operator of a chain counts one); {self.nesting_hint()}",
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

    # --- names: imports, constants --------------------------------------------------------------

    def forget(self, name: str, why: str) -> None:
        """``name`` was rebound to something that is neither an import we track nor a constant."""
        self.aliases.pop(name, None)
        self.constants.pop(name, None)
        self.not_constant[name] = why

    def set_constant(self, name: str, value: object) -> None:
        self.aliases.pop(name, None)
        self.not_constant.pop(name, None)
        self.constants[name] = value

    def record_import(self, node: cst.Import | cst.ImportFrom) -> None:
        line = self.loc(node).line
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = _dotted(alias.name) or ""
                # `import a.b.c as x` binds x to a.b.c; `import a.b.c` binds only `a`.
                local, target = (_ident(alias.asname.name.value), full) if alias.asname else (full.split(".")[0],) * 2
                self.forget(local, f"line {line} imports it")
                self.aliases[local] = target
            return
        base = _dotted(node.module) if node.module is not None and not node.relative else None
        if isinstance(node.names, cst.ImportStar):
            # An op module exports its ops and Sequential; what any other module binds is unknown,
            # and names it would bind stay unresolved ("unknown op").
            if base in OP_MODULES:
                for name in (*OPS, SEQUENTIAL):
                    self.forget(name, f"line {line} imports it")
                    self.aliases[name] = f"{base}.{name}"
            return
        for alias in node.names:
            name = _ident(alias.name.value) if isinstance(alias.name, cst.Name) else _dotted(alias.name) or ""
            local = _ident(alias.asname.name.value) if alias.asname is not None else name
            self.forget(local, f"line {line} imports it")
            if base is not None:  # relative imports are never op modules
                self.aliases[local] = f"{base}.{name}"

    def resolve(self, node: cst.BaseExpression) -> tuple[str, str] | None:
        """(module, attribute) that a callee names, through the file's imports."""
        dotted = _dotted(node)
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head not in self.aliases:
            return None
        full = self.aliases[head] + (f".{rest}" if rest else "")
        module, _, attr = full.rpartition(".")
        return module, attr

    def op_name(self, call: cst.Call) -> str | None:
        """The op (or SEQUENTIAL) a call constructs, or None if it is not from an op module."""
        target = self.resolve(call.func)
        if target is None or target[0] not in OP_MODULES:
            return None
        return target[1] if target[1] in OPS or target[1] == SEQUENTIAL else None

    # --- argument values ------------------------------------------------------------------------

    def evaluate(self, node: cst.BaseExpression, what: str):
        if isinstance(node, cst.Integer):
            return self.integer(node, what)
        if isinstance(node, cst.Float):
            value = float(node.value.replace("_", ""))
            if math.isinf(value):  # Python reads 1e999 as inf without a word
                raise SpecError(f"number too large in {what}: {_short(node.value, 20)} is beyond the float range "
                                "(about 1.8e308)", self.loc(node))
            return value
        if isinstance(node, cst.Name) and node.value != "None":
            if node.value in ("True", "False"):
                return node.value == "True"
            name = _ident(node.value)
            if name in self.constants:
                return self.constants[name]
            why = self.not_constant.get(name)
            hint = f" ({why})" if why else f"; define it above this line as {_short(name, 40)} = <number>"
            raise SpecError(f"'{_short(name, 40)}' is not a module-level constant defined before this line{hint}",
                            self.loc(node))
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
            value = self.evaluate(node.expression, what)
            self.require_number(value, node.expression, what)
            return -value if isinstance(node.operator, cst.Minus) else +value
        if isinstance(node, cst.BinaryOperation) and type(node.operator) in _BINARY:
            left, right = self.evaluate(node.left, what), self.evaluate(node.right, what)
            self.require_number(left, node.left, what)
            self.require_number(right, node.right, what)
            return self.apply(_BINARY[type(node.operator)], left, right, node, what)
        raise SpecError(f"unsupported expression in {what}: {_ALLOWED}", self.loc(node))

    def integer(self, node: cst.Integer, what: str) -> int:
        """An integer literal, refused before conversion when it is beyond _MAX_INT_BITS (Python
        refuses to convert decimal strings of over 4300 digits, and nothing needs them)."""
        text = node.value.replace("_", "").lower()
        digits = text[2:] if text[:2] in ("0x", "0o", "0b") else text
        if len(digits.lstrip("0")) <= _MAX_INT_BITS:  # every digit adds at least one bit, in any base
            value = int(text, 0)  # base 0: 0x/0o/0b prefixes too
            if value.bit_length() <= _MAX_INT_BITS:
                return value
        raise SpecError(f"number too large in {what}: {_short(node.value, 20)} has more than {_MAX_INT_BITS} bits; "
                        "sizes and constants stay far below that", self.loc(node))

    def apply(self, fn, left, right, node: cst.CSTNode, what: str):
        """``fn(left, right)`` with Python's semantics, turning its failure modes into SpecErrors."""
        if fn is operator.pow and isinstance(right, int) and right > _MAX_INT_BITS and abs(left) > 1:
            raise SpecError(f"exponent {right} is too large in {what}", self.loc(node))
        try:
            value = fn(left, right)
        except ZeroDivisionError:
            raise SpecError(f"division by zero in {what}", self.loc(node)) from None
        except OverflowError:
            raise SpecError(f"number too large in {what}", self.loc(node)) from None
        if isinstance(value, complex):  # (-8) ** 0.5
            raise SpecError(f"result is a complex number in {what}", self.loc(node))
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise SpecError(f"number too large in {what}", self.loc(node))
        return value

    def require_number(self, value, node, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"arithmetic on {type(value).__name__} {value!r} in {what}; use a number",
                            self.loc(node))

    def record_assignment(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """A module-level ``target = value`` that is not a pipeline."""
        line = self.loc(target).line
        if isinstance(target, (cst.Tuple, cst.List, cst.StarredElement)):
            self.reject_unpacking(target, value)
        if not isinstance(target, cst.Name):
            return  # x.attr = ..., x[i] = ...: binds no module-level name
        name = _ident(target.value)
        try:
            self.set_constant(name, self.evaluate(value, f"constant '{name}'"))
        except SpecError as err:  # not a constant (e.g. a tensor): only an error if an op uses it
            self.forget(name, f"line {line} assigns it a value fusegen cannot evaluate: {err.message}")

    def reject_unpacking(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """``a, b = ...`` binds names fusegen would have to guess; say how to write them instead."""
        bindings = _Bindings()
        bindings.add_target(target)
        values = value.elements if isinstance(value, (cst.Tuple, cst.List)) else ()
        if len(values) == len(bindings.names) and not any(isinstance(v, cst.StarredElement) for v in values):
            lines = "; ".join(f"{name} = {self.code(v.value)}" for name, v in zip(bindings.names, values))
            hint = f"write {_short(lines, 80)}, one assignment per line"
        else:
            hint = "assign each name on a line of its own"
        raise SpecError(f"fusegen does not evaluate unpacking assignments (they would bind "
                        f"{', '.join(bindings.names[:5]) or 'nothing'}{', ...' if len(bindings.names) > 5 else ''}); "
                        f"{hint}", self.loc(target))

    def scan(self, node: cst.CSTNode) -> _Scan:
        scan = _Scan(self)
        where = self.positions[node]
        if any(line in self.scan_lines for line in range(where.start.line, where.end.line + 1)):
            node.visit(scan)
        return scan

    def reject_walrus(self, scan: _Scan) -> None:
        """``:=`` in a module-level statement binds a module-level name fusegen does not evaluate."""
        if scan.walruses:
            walrus = scan.walruses[0]
            target = self.code(walrus.target)
            raise SpecError(f"fusegen does not evaluate ':=' (here it would bind '{target}'); write "
                            f"{_short(f'{target} = {self.code(walrus.value)}', 60)} on a line of its own",
                            self.loc(walrus.target))

    def record_augmented(self, node: cst.AugAssign) -> None:
        target = node.target
        if not isinstance(target, cst.Name):
            return  # x.attr += ..., x[i] += ...: binds no module-level name
        name, line = _ident(target.value), self.loc(target).line
        try:
            if name not in self.constants:
                self.evaluate(target, f"constant '{name}'")  # raises the right error
            what = f"constant '{name}'"
            right = self.evaluate(node.value, what)
            left = self.constants[name]
            self.require_number(left, target, what)
            self.require_number(right, node.value, what)
            self.set_constant(name, self.apply(_AUGMENTED[type(node.operator)], left, right, node, what))
        except (SpecError, KeyError) as err:  # KeyError: an operator we do not fold (<<=, |=, ...)
            reason = err.message if isinstance(err, SpecError) else "unsupported operator"
            self.forget(name, f"line {line} updates it in a way fusegen cannot evaluate: {reason}")

    # --- op calls -------------------------------------------------------------------------------

    def bind(self, op: OpDef, call: cst.Call) -> OpCall:
        """Match a call's arguments to ``op``'s signature like Python would, then type-check them."""
        positional = [a for a in op.args if not a.keyword_only]
        for arg in call.args:
            if arg.star:
                raise SpecError(f"{op.name}() arguments cannot be unpacked with {arg.star}; write each argument "
                                f"out; signature: {op.signature()}", self.loc(arg))
        given_positional = [arg for arg in call.args if arg.keyword is None]
        if len(given_positional) > len(positional):
            keyword_only = [a.name for a in op.args if a.keyword_only]
            hint = f"; pass {', '.join(keyword_only)} by keyword" if keyword_only else ""
            was = "was" if len(given_positional) == 1 else "were"
            raise SpecError(f"{op.name}() takes {_plural(len(positional), 'positional argument')} but "
                            f"{len(given_positional)} {was} given{hint}; signature: {op.signature()}",
                            self.loc(given_positional[len(positional)].value))
        given: dict[str, object] = {}
        where: dict[str, Location] = {}
        for index, arg in enumerate(given_positional):
            given[positional[index].name] = self.check_kind(op, positional[index], arg.value)
            where[positional[index].name] = self.loc(arg.value)
        for arg in call.args:
            if arg.keyword is None:
                continue
            name = _ident(arg.keyword.value)
            spec_arg = next((a for a in op.args if a.name == name), None)
            if spec_arg is None:
                raise SpecError(f"{op.name}() got an unexpected keyword argument '{name}'; "
                                f"signature: {op.signature()}", self.loc(arg.keyword))
            if name in given:
                raise SpecError(f"{op.name}() got multiple values for argument '{name}'; give it once",
                                self.loc(arg.keyword))
            given[name] = self.check_kind(op, spec_arg, arg.value)
            where[name] = self.loc(arg.value)
        args = {}
        for a in op.args:
            if a.name in given:
                args[a.name] = given[a.name]
            elif a.default is REQUIRED:
                raise SpecError(f"{op.name}() missing required argument '{a.name}'; "
                                f"signature: {op.signature()}", self.loc(call))
            else:
                args[a.name] = a.default
        return OpCall(op.name, args, self.loc(call), where)

    def check_kind(self, op: OpDef, arg: Arg, node: cst.BaseExpression):
        """Evaluate one argument and check it against the op's declared kind and check."""
        what = f"argument '{arg.name}' of {op.name}"
        value = self.evaluate(node, what)
        got = f"got {type(value).__name__} {value!r}"
        if arg.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            hint = "; use // for integer division" if isinstance(value, float) else ""
            raise SpecError(f"{what} must be an int, {got}{hint}", self.loc(node))
        if arg.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{what} must be a number, {got}", self.loc(node))
            value = float(value)  # exact enough: ints are bounded by _MAX_INT_BITS, far inside the float range
            if not math.isfinite(value):  # arithmetic overflowed (1e308 * 10) or made nan (inf - inf)
                raise SpecError(f"{what} must be finite, {got}", self.loc(node))
        if arg.kind == "bool" and not isinstance(value, bool):
            raise SpecError(f"{what} must be True or False, {got}", self.loc(node))
        problem = arg.check(value) if arg.check else None
        if problem:
            raise SpecError(f"{what} {problem}", self.loc(node))
        return value

    def unknown_op(self, func: cst.BaseExpression) -> SpecError:
        spelled = self.code(func)
        target = self.resolve(func)
        if target is None:
            why = (f" ('{spelled}' is not imported from {' or '.join(OP_MODULES)})"
                   if _dotted(func) else "")
        elif target[0] not in OP_MODULES:
            why = f" (it is {'.'.join(target)}, not an op of {' or '.join(OP_MODULES)})"
        else:
            why = ""
        return SpecError(f"unknown op '{spelled}'{why}; known ops: {', '.join(sorted(OPS))}", self.loc(func))

    def sequential(self, name: str, name_location: Location, call: cst.Call) -> SequentialSpec:
        calls = []
        if len(call.args) > MAX_OPS:
            raise SpecError(f"pipeline '{name}' has {len(call.args)} ops; fusegen plans at most {MAX_OPS} ops "
                            "per pipeline, so split it into several pipelines", self.loc(call.args[MAX_OPS]))
        for arg in call.args:
            if arg.star or arg.keyword is not None or not isinstance(arg.value, cst.Call):
                raise SpecError("Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got "
                                f"'{self.code(arg)}'", self.loc(arg))
            op = self.op_name(arg.value)
            if op == SEQUENTIAL:
                raise SpecError("Sequential(...) cannot be nested; list the inner ops directly in the outer one",
                                self.loc(arg.value))
            if op is None:
                raise self.unknown_op(arg.value.func)
            calls.append(self.bind(OPS[op], arg.value))
        return SequentialSpec(name, self.display, self.loc(call), tuple(calls), name_location)

    # --- statements -----------------------------------------------------------------------------

    def reject_stray_sequential(self, scan: _Scan) -> None:
        if scan.sequential:
            raise SpecError("a pipeline must be written as NAME = Sequential(...) at module level; "
                            "fusegen does not run code that builds it", self.loc(scan.sequential[0]))

    def pipeline_target(self, small: cst.BaseSmallStatement) -> tuple[list[cst.BaseExpression], cst.Call] | None:
        """(targets, call) if ``small`` assigns a Sequential(...) call, else None."""
        if isinstance(small, cst.Assign):
            targets = [t.target for t in small.targets]
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            targets = [small.target]
        else:
            return None
        value = small.value
        if isinstance(value, cst.Call) and self.op_name(value) == SEQUENTIAL:
            return targets, value
        return None

    def read_pipeline(self, targets: list[cst.BaseExpression], call: cst.Call) -> SequentialSpec:
        """``NAME = Sequential(...)``: the name is checked (it becomes a module and a class) first."""
        if len(targets) != 1 or not isinstance(targets[0], cst.Name):
            raise SpecError("a pipeline must be assigned to one plain name: NAME = Sequential(...)",
                            self.loc(targets[0]))
        name, where = targets[0].value, self.loc(targets[0])
        self.names.claim(name, where)
        spec = self.sequential(name, where, call)
        self.forget(_ident(name), f"line {where.line} makes it a pipeline")
        return spec

    def read_compound(self, statement: cst.BaseCompoundStatement) -> None:
        """if/for/try/def/class...: not evaluated, but imports in it count (try: import ... except
        ImportError) and names it rebinds are no longer known constants. A pipeline in it would be
        silently missing, so that is an error."""
        bindings = _Bindings()
        statement.visit(bindings)
        line = self.loc(statement).line
        keyword = _KEYWORDS.get(type(statement)) or self.code(statement).split()[0]
        for name in bindings.names:
            self.forget(name, f"line {line} binds it inside '{keyword}', which fusegen does not run")
        for node in bindings.imports:
            self.record_import(node)
        found = self.scan(statement).sequential
        if found:
            raise SpecError(f"a pipeline must be defined at module level: fusegen does not run the '{keyword}' "
                            f"at line {line}, so it would never see this one; write NAME = Sequential(...) at "
                            "the top level of the file", self.loc(found[0]))

    def read_simple(self, small: cst.BaseSmallStatement) -> SequentialSpec | None:
        """One module-level small statement: a pipeline (returned), an import, or a constant."""
        if isinstance(small, (cst.Import, cst.ImportFrom)):
            self.record_import(small)
            return None
        scan = self.scan(small)
        self.reject_walrus(scan)
        pipeline = self.pipeline_target(small)
        if pipeline is not None:
            return self.read_pipeline(*pipeline)
        self.reject_stray_sequential(scan)
        if isinstance(small, cst.Assign):
            for target in small.targets:
                self.record_assignment(target.target, small.value)
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            self.record_assignment(small.target, small.value)
        elif isinstance(small, cst.AugAssign):
            self.record_augmented(small)
        elif isinstance(small, cst.Del):
            bindings = _Bindings()
            small.visit(bindings)
            for name in bindings.names:
                self.forget(name, f"line {self.loc(small).line} deletes it")
        return None

    def read(self) -> list[SequentialSpec]:
        specs: list[SequentialSpec] = []
        for statement in self.module.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                self.read_compound(statement)
                continue
            for small in statement.body:
                spec = self.read_simple(small)
                if spec is not None:
                    specs.append(spec)
        if not specs:
            raise SpecError(f"no 'NAME = Sequential(...)' pipeline found in {self.display}", self.location_at(1, 1))
        return specs


def parse_spec(source: str, display_path: str) -> list[SequentialSpec]:
    """Every ``NAME = Sequential(...)`` of a spec's source, in file order; raises SpecError."""
    reader = _SpecReader(source, display_path)
    try:
        reader.parse()
        return reader.read()
    except RecursionError:  # a last resort: MAX_NESTING is meant to keep every recursion shallow
        raise SpecError(f"expression nested too deeply for fusegen; {reader.nesting_hint()}", reader.deepest) from None


def parse_spec_file(path: Path, display_path: str | None = None) -> list[SequentialSpec]:
    """``parse_spec`` on a file (UTF-8); ``display_path`` is how errors name it (default: ``path``)."""
    display = display_path if display_path is not None else str(path)
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the text, as for Python.
        source = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError(f"spec file is not valid UTF-8 (byte {err.start}); save it as UTF-8",
                        Location(display, 1, 1)) from None
    return parse_spec(source, display)
