"""The spec frontend: reads a spec file with libcst, never importing or running it.

Every module-level ``NAME = Sequential(...)`` becomes a ``SequentialSpec``: the op calls in order,
their arguments bound to the catalog's signatures (defaults filled in) and source locations for
error messages. Spellings follow Transformer Engine (``te.ops.Linear``, ``from
transformer_engine.pytorch.ops import Linear as L``) or fusegen's eager module (``generator.eager``).
Arguments may be literals, module-level constants defined earlier, and arithmetic on them.

The file is read top to bottom like Python would run it, so a constant means the value of its
latest assignment above the use. Anything fusegen cannot evaluate makes the name unusable rather
than silently keeping an older value.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .catalog import OPS, REQUIRED, SEQUENTIAL, Arg, OpDef
from .errors import Location, SpecError

OP_MODULES = ("transformer_engine.pytorch.ops", "generator.eager")

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


@dataclass(frozen=True)
class OpCall:
    op: str  # catalog name, aliases resolved
    args: dict[str, object]  # every argument of the op by name, defaults filled in
    location: Location  # the call
    arg_locations: dict[str, Location]  # where each explicitly given argument is written


@dataclass(frozen=True)
class SequentialSpec:
    name: str  # the module-level variable
    file: str  # display path
    location: Location  # the Sequential(...) call
    calls: tuple[OpCall, ...]


def _dotted(node: cst.BaseExpression) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class _Bindings(cst.CSTVisitor):
    """Names a compound statement (if/for/try/with...) binds at module scope, and its imports.

    Function and class bodies are their own scopes: only the def/class name itself is bound.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.imports: list[cst.Import | cst.ImportFrom] = []

    def add_target(self, node: cst.CSTNode) -> None:
        if isinstance(node, cst.Name):
            self.names.append(node.value)
        elif isinstance(node, (cst.Tuple, cst.List)):
            for element in node.elements:
                self.add_target(element.value)
        elif isinstance(node, cst.StarredElement):
            self.add_target(node.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.names.append(node.name.value)
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.names.append(node.name.value)
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


class _SequentialCalls(cst.CSTVisitor):
    """Calls to Sequential anywhere inside a statement (to reject ones that are not NAME = ...)."""

    def __init__(self, reader: _SpecReader) -> None:
        self.reader = reader
        self.found: list[cst.Call] = []

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False  # a function body, not a declaration

    def visit_Call(self, node: cst.Call) -> None:
        if self.reader.op_name(node) == SEQUENTIAL:
            self.found.append(node)


class _SpecReader:
    def __init__(self, source: str, display_path: str):
        self.display = display_path
        # Split like Python counts lines (str.splitlines also splits on \f, \x1c, ...).
        self.lines = re.split(r"\r\n|\r|\n", source)
        # Python's own parser reports syntax errors precisely (libcst's native parser often says
        # 1:1); ast.parse only parses, it never runs anything.
        try:
            ast.parse(source, filename=display_path)
        except SyntaxError as err:
            raise SpecError(f"syntax error: {err.msg}", self.location_at(err.lineno or 1, err.offset or 1)) from None
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError as err:  # syntax Python accepts but libcst does not
            raise SpecError(f"syntax error: {err.message}", self.location_at(err.editor_line, err.editor_column)) from None
        self.wrapper = MetadataWrapper(module)
        self.positions = self.wrapper.resolve(PositionProvider)
        self.module = self.wrapper.module
        self.aliases: dict[str, str] = {}  # local name -> dotted import path
        self.constants: dict[str, object] = {}  # module-level constant -> current value
        self.not_constant: dict[str, str] = {}  # name -> why it cannot be used as a constant

    # --- locations ------------------------------------------------------------------------------

    def location_at(self, line: int, col: int) -> Location:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return Location(self.display, line, col, text)

    def loc(self, node: cst.CSTNode) -> Location:
        start = self.positions[node].start
        return self.location_at(start.line, start.column + 1)  # libcst columns are 0-based

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node).strip().rstrip(",").strip()

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
                local, target = (alias.asname.name.value, full) if alias.asname else (full.split(".")[0],) * 2
                self.forget(local, f"line {line} imports it")
                self.aliases[local] = target
            return
        if isinstance(node.names, cst.ImportStar):
            return  # cannot know what it binds; names it would bind stay unresolved ("unknown op")
        base = _dotted(node.module) if node.module is not None and not node.relative else None
        for alias in node.names:
            name = alias.name.value
            local = alias.asname.name.value if alias.asname is not None else name
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
            return int(node.value.replace("_", ""), 0)  # base 0: 0x/0o/0b prefixes too
        if isinstance(node, cst.Float):
            return float(node.value.replace("_", ""))
        if isinstance(node, cst.Name) and node.value != "None":
            if node.value in ("True", "False"):
                return node.value == "True"
            if node.value in self.constants:
                return self.constants[node.value]
            why = self.not_constant.get(node.value)
            hint = f" ({why})" if why else f"; define it above this line as {node.value} = <number>"
            raise SpecError(f"'{node.value}' is not a module-level constant defined before this line{hint}",
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
        if not isinstance(target, cst.Name):
            bindings = _Bindings()
            bindings.add_target(target)  # a, b = ...: names we do not evaluate
            for name in bindings.names:
                self.forget(name, f"line {line} assigns it by unpacking")
            return
        name = target.value
        try:
            self.set_constant(name, self.evaluate(value, f"constant '{name}'"))
        except SpecError as err:  # not a constant (e.g. a tensor): only an error if an op uses it
            self.forget(name, f"line {line} assigns it a value fusegen cannot evaluate: {err.message}")

    def record_augmented(self, node: cst.AugAssign) -> None:
        target = node.target
        if not isinstance(target, cst.Name):
            return  # x.attr += ..., x[i] += ...: binds no module-level name
        name, line = target.value, self.loc(target).line
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
            name = arg.keyword.value
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
        """Evaluate one argument and check it against the catalog's kind and check."""
        what = f"argument '{arg.name}' of {op.name}"
        value = self.evaluate(node, what)
        got = f"got {type(value).__name__} {value!r}"
        if arg.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            hint = "; use // for integer division" if isinstance(value, float) else ""
            raise SpecError(f"{what} must be an int, {got}{hint}", self.loc(node))
        if arg.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{what} must be a number, {got}", self.loc(node))
            value = float(value)
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

    def sequential(self, name: str, call: cst.Call) -> SequentialSpec:
        calls = []
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
        return SequentialSpec(name, self.display, self.loc(call), tuple(calls))

    # --- statements -----------------------------------------------------------------------------

    def reject_stray_sequential(self, node: cst.CSTNode) -> None:
        finder = _SequentialCalls(self)
        node.visit(finder)
        if finder.found:
            raise SpecError("a pipeline must be written as NAME = Sequential(...) at module level; "
                            "fusegen does not run code that builds it", self.loc(finder.found[0]))

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

    def read(self) -> list[SequentialSpec]:
        specs: list[SequentialSpec] = []
        for statement in self.module.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                # if/for/try/def/class...: not evaluated, but imports in it count (try: import ...
                # except ImportError) and names it rebinds are no longer known constants.
                bindings = _Bindings()
                statement.visit(bindings)
                line = self.loc(statement).line
                keyword = {cst.FunctionDef: "def", cst.ClassDef: "class"}.get(type(statement))
                keyword = keyword or self.code(statement).split()[0]  # if, for, while, try, with, match
                for name in bindings.names:
                    self.forget(name, f"line {line} binds it inside '{keyword}', which fusegen does not run")
                for node in bindings.imports:
                    self.record_import(node)
                continue
            for small in statement.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    self.record_import(small)
                    continue
                pipeline = self.pipeline_target(small)
                if pipeline is not None:
                    targets, call = pipeline
                    if len(targets) != 1 or not isinstance(targets[0], cst.Name):
                        raise SpecError("a pipeline must be assigned to one plain name: NAME = Sequential(...)",
                                        self.loc(targets[0]))
                    name = targets[0].value
                    if any(s.name == name for s in specs):
                        first = next(s for s in specs if s.name == name)
                        raise SpecError(f"pipeline '{name}' is defined twice in this file (first at line "
                                        f"{first.location.line}); give each pipeline its own name",
                                        self.loc(targets[0]))
                    specs.append(self.sequential(name, call))
                    self.forget(name, f"line {self.loc(targets[0]).line} makes it a pipeline")
                    continue
                self.reject_stray_sequential(small)
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
        if not specs:
            raise SpecError(f"no 'NAME = Sequential(...)' pipeline found in {self.display}", self.location_at(1, 1))
        return specs


def parse_spec(source: str, display_path: str) -> list[SequentialSpec]:
    """Every ``NAME = Sequential(...)`` of a spec's source, in file order; raises SpecError."""
    return _SpecReader(source, display_path).read()


def parse_spec_file(path: Path, display_path: str | None = None) -> list[SequentialSpec]:
    """``parse_spec`` on a file (UTF-8); ``display_path`` is how errors name it (default: ``path``)."""
    display = display_path if display_path is not None else str(path)
    try:
        source = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(f"spec file is not valid UTF-8 (byte {err.start}); save it as UTF-8",
                        Location(display, 1, 1)) from None
    return parse_spec(source, display)
