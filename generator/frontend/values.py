"""Constant folding: the values of a spec's arguments and module-level constants.

An argument may be a literal, a constant assigned above it, and + - * / // % ** on them; the
result follows Python's semantics, with every number bounded by ``_MAX_INT_BITS``. Assignments
that are not pipelines update the constants; one fusegen cannot evaluate makes its name unusable
(only an error if an op uses it).
"""

from __future__ import annotations

import math
import operator
import warnings

import libcst as cst

from ..errors import SpecError
from ..ops.opdef import TORCH_DTYPES, TorchDtype
from .scope import Scope, _Bindings, _ident
from .source import _MAX_INT_BITS, SpecSource, _short

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
_ALLOWED = ("only literals (numbers, True/False, None, strings, tuples), torch dtypes, module-level constants and "
            "+ - * / // % ** are allowed")


class ConstantFolder:
    """Evaluates expressions over the constants of ``scope``, and records assignments to them."""

    def __init__(self, source: SpecSource, scope: Scope) -> None:
        self.source = source
        self.scope = scope

    def evaluate(self, node: cst.BaseExpression, what: str):
        if isinstance(node, cst.Integer):
            return self.integer(node, what)
        if isinstance(node, cst.Float):
            value = float(node.value.replace("_", ""))
            if math.isinf(value):  # Python reads 1e999 as inf without a word
                raise SpecError(f"number too large in {what}: {_short(node.value, 20)} is beyond the float range "
                                "(about 1.8e308)", self.source.loc(node))
            return value
        if isinstance(node, cst.Name) and node.value == "None":
            return None  # device=None, dtype=None; elsewhere the binder names the kind it wants
        dtype = self.torch_dtype(node)
        if dtype is not None:
            return dtype
        if isinstance(node, cst.Name):
            if node.value in ("True", "False"):
                return node.value == "True"
            name = _ident(node.value)
            if name in self.scope.constants:
                return self.scope.constants[name]
            why = self.scope.not_constant.get(name)
            hint = f" ({why})" if why else f"; define it above this line as {_short(name, 40)} = <number>"
            raise SpecError(f"'{_short(name, 40)}' is not a module-level constant defined before this line{hint}",
                            self.source.loc(node))
        if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, (cst.Minus, cst.Plus)):
            value = self.evaluate(node.expression, what)
            self.require_number(value, node.expression, what)
            return -value if isinstance(node.operator, cst.Minus) else +value
        if isinstance(node, cst.BinaryOperation) and type(node.operator) in _BINARY:
            left, right = self.evaluate(node.left, what), self.evaluate(node.right, what)
            self.require_number(left, node.left, what)
            self.require_number(right, node.right, what)
            return self.apply(_BINARY[type(node.operator)], left, right, node, what)
        if isinstance(node, (cst.Tuple, cst.List)) and all(isinstance(e, cst.Element) for e in node.elements):
            return tuple(self.evaluate(e.value, what) for e in node.elements)  # a shape: (64,)
        if isinstance(node, cst.SimpleString) and not node.prefix.strip("rRuU"):
            with warnings.catch_warnings():  # "\d" reads as Python reads it, without its warning
                warnings.simplefilter("ignore")
                return node.evaluated_value  # the binder then says which kind the argument takes
        raise SpecError(f"unsupported expression in {what}: {_ALLOWED}", self.source.loc(node))

    def torch_dtype(self, node: cst.BaseExpression) -> TorchDtype | None:
        """``torch.bfloat16`` (through the file's imports of torch) as the dtype it names."""
        if not isinstance(node, (cst.Name, cst.Attribute)):
            return None
        target = self.scope.resolve(node)
        if target is None or target[0] != "torch" or target[1] not in TORCH_DTYPES:
            return None
        return TorchDtype(TORCH_DTYPES[target[1]])

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
                        "sizes and constants stay far below that", self.source.loc(node))

    def apply(self, fn, left, right, node: cst.CSTNode, what: str):
        """``fn(left, right)`` with Python's semantics, turning its failure modes into SpecErrors."""
        if fn is operator.pow and isinstance(right, int) and right > _MAX_INT_BITS and abs(left) > 1:
            raise SpecError(f"exponent {right} is too large in {what}", self.source.loc(node))
        try:
            value = fn(left, right)
        except ZeroDivisionError:
            raise SpecError(f"division by zero in {what}", self.source.loc(node)) from None
        except OverflowError:
            raise SpecError(f"number too large in {what}", self.source.loc(node)) from None
        if isinstance(value, complex):  # (-8) ** 0.5
            raise SpecError(f"result is a complex number in {what}", self.source.loc(node))
        if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
            raise SpecError(f"number too large in {what}", self.source.loc(node))
        return value

    def require_number(self, value, node, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"arithmetic on {type(value).__name__} {value!r} in {what}; use a number",
                            self.source.loc(node))

    # --- assignments ----------------------------------------------------------------------------

    def record_assignment(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """A module-level ``target = value`` that is not a pipeline."""
        line = self.source.loc(target).line
        if isinstance(target, (cst.Tuple, cst.List, cst.StarredElement)):
            self.reject_unpacking(target, value)
        if not isinstance(target, cst.Name):
            return  # x.attr = ..., x[i] = ...: binds no module-level name
        name = _ident(target.value)
        try:
            self.scope.set_constant(name, self.evaluate(value, f"constant '{name}'"))
        except SpecError as err:  # not a constant (e.g. a tensor): only an error if an op uses it
            self.scope.forget(name, f"line {line} assigns it a value fusegen cannot evaluate: {err.message}")

    def reject_unpacking(self, target: cst.BaseExpression, value: cst.BaseExpression) -> None:
        """``a, b = ...`` binds names fusegen would have to guess; say how to write them instead."""
        bindings = _Bindings()
        bindings.add_target(target)
        values = value.elements if isinstance(value, (cst.Tuple, cst.List)) else ()
        if len(values) == len(bindings.names) and not any(isinstance(v, cst.StarredElement) for v in values):
            lines = "; ".join(f"{name} = {self.source.code(v.value)}" for name, v in zip(bindings.names, values))
            hint = f"write {_short(lines, 80)}, one assignment per line"
        else:
            hint = "assign each name on a line of its own"
        raise SpecError(f"fusegen does not evaluate unpacking assignments (they would bind "
                        f"{', '.join(bindings.names[:5]) or 'nothing'}{', ...' if len(bindings.names) > 5 else ''}); "
                        f"{hint}", self.source.loc(target))

    def record_augmented(self, node: cst.AugAssign) -> None:
        target = node.target
        if not isinstance(target, cst.Name):
            return  # x.attr += ..., x[i] += ...: binds no module-level name
        name, line = _ident(target.value), self.source.loc(target).line
        try:
            if name not in self.scope.constants:
                self.evaluate(target, f"constant '{name}'")  # raises the right error
            what = f"constant '{name}'"
            right = self.evaluate(node.value, what)
            left = self.scope.constants[name]
            self.require_number(left, target, what)
            self.require_number(right, node.value, what)
            self.scope.set_constant(name, self.apply(_AUGMENTED[type(node.operator)], left, right, node, what))
        except (SpecError, KeyError) as err:  # KeyError: an operator we do not fold (<<=, |=, ...)
            reason = err.message if isinstance(err, SpecError) else "unsupported operator"
            self.scope.forget(name, f"line {line} updates it in a way fusegen cannot evaluate: {reason}")
