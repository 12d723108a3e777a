"""Op calls: what a ``NAME = Sequential(...)`` holds, bound to the op registry's signatures.

``OpBinder`` matches each call's arguments to its op's signature like Python would, fills in the
defaults and checks every value against the op's declared kind and check; ``OpCall`` and
``SequentialSpec`` are what the frontend hands on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import libcst as cst

from ..errors import Location, SpecError
from ..ops import OPS, REQUIRED, SEQUENTIAL, Arg, OpDef
from .scope import OP_MODULES, Scope, _dotted, _ident
from .source import SpecSource
from .values import ConstantFolder

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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class OpBinder:
    """Reads the op calls of a Sequential(...): the callee through ``scope``, the arguments through ``folder``."""

    def __init__(self, source: SpecSource, scope: Scope, folder: ConstantFolder) -> None:
        self.source = source
        self.scope = scope
        self.folder = folder

    def sequential(self, name: str, name_location: Location, call: cst.Call) -> SequentialSpec:
        calls = []
        if len(call.args) > MAX_OPS:
            raise SpecError(f"pipeline '{name}' has {len(call.args)} ops; fusegen plans at most {MAX_OPS} ops "
                            "per pipeline, so split it into several pipelines", self.source.loc(call.args[MAX_OPS]))
        for arg in call.args:
            if arg.star or arg.keyword is not None or not isinstance(arg.value, cst.Call):
                raise SpecError("Sequential(...) takes op calls like te.ops.Linear(4096, 4096); got "
                                f"'{self.source.code(arg)}'", self.source.loc(arg))
            op = self.scope.op_name(arg.value)
            if op == SEQUENTIAL:
                raise SpecError("Sequential(...) cannot be nested; list the inner ops directly in the outer one",
                                self.source.loc(arg.value))
            if op is None:
                raise self.unknown_op(arg.value.func)
            calls.append(self.bind(OPS[op], arg.value))
        return SequentialSpec(name, self.source.display, self.source.loc(call), tuple(calls), name_location)

    def bind(self, op: OpDef, call: cst.Call) -> OpCall:
        """Match a call's arguments to ``op``'s signature like Python would, then type-check them."""
        positional = [a for a in op.args if not a.keyword_only]
        for arg in call.args:
            if arg.star:
                raise SpecError(f"{op.name}() arguments cannot be unpacked with {arg.star}; write each argument "
                                f"out; signature: {op.signature()}", self.source.loc(arg))
        given_positional = [arg for arg in call.args if arg.keyword is None]
        if len(given_positional) > len(positional):
            keyword_only = [a.name for a in op.args if a.keyword_only]
            hint = f"; pass {', '.join(keyword_only)} by keyword" if keyword_only else ""
            was = "was" if len(given_positional) == 1 else "were"
            raise SpecError(f"{op.name}() takes {_plural(len(positional), 'positional argument')} but "
                            f"{len(given_positional)} {was} given{hint}; signature: {op.signature()}",
                            self.source.loc(given_positional[len(positional)].value))
        given: dict[str, object] = {}
        where: dict[str, Location] = {}
        for index, arg in enumerate(given_positional):
            given[positional[index].name] = self.check_kind(op, positional[index], arg.value)
            where[positional[index].name] = self.source.loc(arg.value)
        for arg in call.args:
            if arg.keyword is None:
                continue
            name = _ident(arg.keyword.value)
            spec_arg = next((a for a in op.args if a.name == name), None)
            if spec_arg is None:
                raise SpecError(f"{op.name}() got an unexpected keyword argument '{name}'; "
                                f"signature: {op.signature()}", self.source.loc(arg.keyword))
            if name in given:
                raise SpecError(f"{op.name}() got multiple values for argument '{name}'; give it once",
                                self.source.loc(arg.keyword))
            given[name] = self.check_kind(op, spec_arg, arg.value)
            where[name] = self.source.loc(arg.value)
        args = {}
        for a in op.args:
            if a.name in given:
                args[a.name] = given[a.name]
            elif a.default is REQUIRED:
                raise SpecError(f"{op.name}() missing required argument '{a.name}'; "
                                f"signature: {op.signature()}", self.source.loc(call))
            else:
                args[a.name] = a.default
        return OpCall(op.name, args, self.source.loc(call), where)

    def check_kind(self, op: OpDef, arg: Arg, node: cst.BaseExpression):
        """Evaluate one argument and check it against the op's declared kind and check."""
        what = f"argument '{arg.name}' of {op.name}"
        value = self.folder.evaluate(node, what)
        got = f"got {type(value).__name__} {value!r}"
        if arg.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            hint = "; use // for integer division" if isinstance(value, float) else ""
            raise SpecError(f"{what} must be an int, {got}{hint}", self.source.loc(node))
        if arg.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SpecError(f"{what} must be a number, {got}", self.source.loc(node))
            value = float(value)  # exact enough: ints are bounded by _MAX_INT_BITS, far inside the float range
            if not math.isfinite(value):  # arithmetic overflowed (1e308 * 10) or made nan (inf - inf)
                raise SpecError(f"{what} must be finite, {got}", self.source.loc(node))
        if arg.kind == "bool" and not isinstance(value, bool):
            raise SpecError(f"{what} must be True or False, {got}", self.source.loc(node))
        problem = arg.check(value) if arg.check else None
        if problem:
            raise SpecError(f"{what} {problem}", self.source.loc(node))
        return value

    def unknown_op(self, func: cst.BaseExpression) -> SpecError:
        spelled = self.source.code(func)
        target = self.scope.resolve(func)
        if target is None:
            why = (f" ('{spelled}' is not imported from {' or '.join(OP_MODULES)})"
                   if _dotted(func) else "")
        elif target[0] not in OP_MODULES:
            why = f" (it is {'.'.join(target)}, not an op of {' or '.join(OP_MODULES)})"
        else:
            why = ""
        return SpecError(f"unknown op '{spelled}'{why}; known ops: {', '.join(sorted(OPS))}", self.source.loc(func))
