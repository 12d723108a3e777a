"""The spec frontend: reads a spec file with libcst, never importing or running it.

Every module-level ``NAME = Sequential(...)`` becomes a ``SequentialSpec``: the op calls in order,
their arguments bound to the catalog's signatures (defaults filled in) and source locations for
error messages. Spellings follow Transformer Engine (``te.ops.Linear``, ``from
transformer_engine.pytorch.ops import Linear as L``) or fusegen's eager module (``generator.eager``).
Arguments may be literals, module-level constants defined earlier, and arithmetic on them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from pathlib import Path

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .catalog import OPS, REQUIRED, SEQUENTIAL, OpDef
from .errors import Location, SpecError

OP_MODULES = ("transformer_engine.pytorch.ops", "generator.eager")

_BINARY = {
    cst.Add: operator.add, cst.Subtract: operator.sub, cst.Multiply: operator.mul,
    cst.Divide: operator.truediv, cst.FloorDivide: operator.floordiv, cst.Modulo: operator.mod,
    cst.Power: operator.pow,
}


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


def _module_name(node: cst.BaseExpression) -> str:
    return _dotted(node) or ""


class _SpecReader:
    def __init__(self, source: str, display_path: str):
        self.display = display_path
        self.lines = source.splitlines()
        try:
            module = cst.parse_module(source)
        except cst.ParserSyntaxError as err:
            raise SpecError(f"syntax error: {err.message}", self.location_at(err.editor_line, err.editor_column)) from None
        self.wrapper = MetadataWrapper(module)
        self.positions = self.wrapper.resolve(PositionProvider)
        self.module = self.wrapper.module
        self.aliases: dict[str, str] = {}  # local name -> dotted import path
        self.constants: dict[str, object] = {}

    # --- locations ------------------------------------------------------------------------------

    def location_at(self, line: int, col: int) -> Location:
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return Location(self.display, line, col, text)

    def loc(self, node: cst.CSTNode) -> Location:
        start = self.positions[node].start
        return self.location_at(start.line, start.column + 1)

    # --- imports and names ----------------------------------------------------------------------

    def record_import(self, node: cst.Import | cst.ImportFrom) -> None:
        if isinstance(node, cst.Import):
            for alias in node.names:
                full = _module_name(alias.name)
                if alias.asname is not None:
                    self.aliases[alias.asname.name.value] = full
                else:  # `import a.b.c` binds `a`
                    top = full.split(".")[0]
                    self.aliases[top] = top
            return
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return
        base = _module_name(node.module)
        for alias in node.names:
            name = alias.name.value
            local = alias.asname.name.value if alias.asname is not None else name
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
        target = self.resolve(call.func)
        if target is None or target[0] not in OP_MODULES:
            return None
        return target[1]

    # --- argument values ------------------------------------------------------------------------

    def evaluate(self, node: cst.BaseExpression, what: str):
        if isinstance(node, cst.Integer):
            return int(node.value.replace("_", ""), 0)
        if isinstance(node, cst.Float):
            return float(node.value.replace("_", ""))
        if isinstance(node, cst.Name):
            if node.value in ("True", "False"):
                return node.value == "True"
            if node.value in self.constants:
                return self.constants[node.value]
            raise SpecError(f"'{node.value}' is not a module-level constant defined before this line; "
                            "define it above as NAME = <number>", self.loc(node))
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
            value = self.evaluate(node.expression, what)
            self.require_number(value, node, what)
            return -value if isinstance(node.operator, cst.Minus) else +value
        if isinstance(node, cst.BinaryOperation) and type(node.operator) in _BINARY:
            left, right = self.evaluate(node.left, what), self.evaluate(node.right, what)
            self.require_number(left, node.left, what)
            self.require_number(right, node.right, what)
            try:
                return _BINARY[type(node.operator)](left, right)
            except ZeroDivisionError:
                raise SpecError(f"division by zero in {what}", self.loc(node)) from None
        raise SpecError(f"unsupported expression in {what}: only literals, module-level constants "
                        "and + - * / // % ** are allowed", self.loc(node))

    def require_number(self, value, node, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"arithmetic on {type(value).__name__} in {what}", self.loc(node))

    def record_constant(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            try:
                self.constants[target.value] = self.evaluate(value, f"constant '{target.value}'")
            except SpecError:
                self.constants.pop(target.value, None)  # not a constant: later uses are errors

    # --- op calls -------------------------------------------------------------------------------

    def bind(self, op: OpDef, call: cst.Call) -> OpCall:
        positional = [a for a in op.args if not a.keyword_only]
        given: dict[str, object] = {}
        where: dict[str, Location] = {}
        n_positional = 0
        for arg in call.args:
            if arg.star:
                raise SpecError(f"{op.name}() arguments cannot be unpacked with {arg.star}; write them out",
                                self.loc(arg))
            if arg.keyword is None:
                if n_positional >= len(positional):
                    raise SpecError(f"{op.name}() takes {len(positional)} positional argument"
                                    f"{'' if len(positional) == 1 else 's'} but more were given; "
                                    f"signature: {op.signature()}", self.loc(arg.value))
                spec_arg = positional[n_positional]
                n_positional += 1
            else:
                name = arg.keyword.value
                spec_arg = next((a for a in op.args if a.name == name), None)
                if spec_arg is None:
                    raise SpecError(f"{op.name}() got an unexpected keyword argument '{name}'; "
                                    f"signature: {op.signature()}", self.loc(arg.keyword))
                if name in given:
                    raise SpecError(f"{op.name}() got multiple values for argument '{name}'", self.loc(arg.keyword))
            value = self.evaluate(arg.value, f"argument '{spec_arg.name}' of {op.name}")
            value = self.check_kind(op, spec_arg, value, arg.value)
            given[spec_arg.name] = value
            where[spec_arg.name] = self.loc(arg.value)
        args = {}
        for a in op.args:
            if a.name not in given:
                if a.default is REQUIRED:
                    raise SpecError(f"{op.name}() missing required argument '{a.name}'; "
                                    f"signature: {op.signature()}", self.loc(call))
                args[a.name] = a.default
            else:
                args[a.name] = given[a.name]
        return OpCall(op.name, args, self.loc(call), where)

    def check_kind(self, op: OpDef, arg, value, node):
        what = f"argument '{arg.name}' of {op.name}"
        if arg.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"{what} must be an int, got {type(value).__name__} {value!r}", self.loc(node))
        if arg.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{what} must be a number, got {type(value).__name__} {value!r}", self.loc(node))
            value = float(value)
        if arg.kind == "bool" and not isinstance(value, bool):
            raise SpecError(f"{what} must be True or False, got {value!r}", self.loc(node))
        problem = arg.check(value) if arg.check else None
        if problem:
            raise SpecError(f"{what} {problem}", self.loc(node))
        return value

    def sequential(self, name: str, call: cst.Call) -> SequentialSpec:
        calls = []
        for arg in call.args:
            if arg.star or arg.keyword is not None or not isinstance(arg.value, cst.Call):
                raise SpecError("Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got "
                                f"'{self.module.code_for_node(arg).strip().rstrip(',')}'", self.loc(arg))
            op = self.op_name(arg.value)
            if op is None or op not in OPS:
                spelled = self.module.code_for_node(arg.value.func)
                raise SpecError(f"unknown op '{spelled}'; known ops: {', '.join(sorted(OPS))}",
                                self.loc(arg.value.func))
            calls.append(self.bind(OPS[op], arg.value))
        return SequentialSpec(name, self.display, self.loc(call), tuple(calls))

    def read(self) -> list[SequentialSpec]:
        specs: list[SequentialSpec] = []
        for statement in self.module.body:
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            for small in statement.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    self.record_import(small)
                elif isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
                    targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else [small.target]
                    value = small.value
                    if isinstance(value, cst.Call) and self.op_name(value) == SEQUENTIAL:
                        if len(targets) != 1 or not isinstance(targets[0], cst.Name):
                            raise SpecError("a pipeline must be assigned to one plain name: NAME = Sequential(...)",
                                            self.loc(targets[0]))
                        name = targets[0].value
                        if any(s.name == name for s in specs):
                            raise SpecError(f"pipeline '{name}' is defined twice in this file", self.loc(targets[0]))
                        specs.append(self.sequential(name, value))
                    else:
                        for target in targets:
                            self.record_constant(target, value)
        if not specs:
            raise SpecError(f"no 'NAME = Sequential(...)' pipeline found in {self.display}", self.location_at(1, 1))
        return specs


def parse_spec(source: str, display_path: str) -> list[SequentialSpec]:
    return _SpecReader(source, display_path).read()


def parse_spec_file(path: Path, display_path: str | None = None) -> list[SequentialSpec]:
    return parse_spec(Path(path).read_text(encoding="utf-8"), display_path or str(path))
