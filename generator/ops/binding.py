"""The one argument binder: an op call's arguments matched to its ``OpDef`` signature like Python
would, defaults filled in, every value checked against its declared kind and check.

Two callers, one rule: the frontend binds the libcst nodes of a spec (errors become SpecErrors at
the node that ``ArgumentError.at`` names) and the eager modules bind real Python values (errors
become TypeError or ValueError). ``bind`` is generic over what an argument is: ``convert`` turns
one given argument into its value (the frontend folds constants there) and may raise
``ArgumentError``, which ``bind`` points at that argument.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Callable, Sequence, TypeVar

from .opdef import REQUIRED, Arg, OpDef, TorchDtype

Given = TypeVar("Given")


class ArgumentError(Exception):
    """An argument does not fit the op. ``at``: the given item to point at (None: the whole call);
    ``value_error``: the argument's value is wrong (else the call's shape is)."""

    def __init__(self, message: str, at: object = None, value_error: bool = False):
        super().__init__(message)
        self.message = message
        self.at = at
        self.value_error = value_error


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def check_value(op: OpDef, arg: Arg, value: object) -> object:
    """``value`` checked against ``arg``'s kind (int, float, bool, shape) and check; floats come back as
    float, a shape as an int (one dim, given as an int or a one-element tuple) or a tuple of ints
    (several dims)."""
    if value is None and arg.default is None:  # None where None is the default: "not given"
        return None
    what = f"argument '{arg.name}' of {op.name}"
    got = f"got {type(value).__name__} {value!r}"
    if arg.kind == "str" and not isinstance(value, str):
        raise ArgumentError(f"{what} must be a string, {got}", value_error=True)
    if arg.kind == "device" and value is not None:
        if not isinstance(value, str) or not re.fullmatch(r"(cuda|cpu)(:\d+)?", value):
            raise ArgumentError(f"{what} must be None or a device name like 'cuda', 'cuda:1' or 'cpu', {got}",
                                value_error=True)
    if arg.kind == "dtype" and value is not None and not isinstance(value, TorchDtype):
        raise ArgumentError(f"{what} must be None or a torch dtype like torch.bfloat16, {got}", value_error=True)
    if arg.kind == "shape":  # TE and torch take an int or a tuple of the last dims' sizes
        dims = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not dims or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise ArgumentError(f"{what} must be an int or a non-empty tuple of ints, {got}", value_error=True)
        value = dims[0] if len(dims) == 1 else dims  # one dim as its size, several as a tuple
    if arg.kind == "dims":  # a tensor shape, as torch.reshape takes it: a tuple or list of ints
        value = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if not value or any(isinstance(d, bool) or not isinstance(d, int) for d in value):
            raise ArgumentError(f"{what} must be a non-empty tuple of ints, {got}", value_error=True)
    if arg.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        hint = "; use // for integer division" if isinstance(value, float) else ""
        raise ArgumentError(f"{what} must be an int, {got}{hint}", value_error=True)
    if arg.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgumentError(f"{what} must be a number, {got}", value_error=True)
        value = float(value)  # exact enough: spec ints are bounded far inside the float range
        if not math.isfinite(value):  # arithmetic overflowed (1e308 * 10) or made nan (inf - inf)
            raise ArgumentError(f"{what} must be finite, {got}", value_error=True)
    if arg.kind == "bool" and not isinstance(value, bool):
        raise ArgumentError(f"{what} must be True or False, {got}", value_error=True)
    problem = arg.check(value) if arg.check else None
    if problem:
        raise ArgumentError(f"{what} {problem}", value_error=True)
    return value


def bind(op: OpDef, positional: Sequence[Given], keywords: Sequence[tuple[str, object, Given]],
         convert: Callable[[Arg, Given], object]) -> tuple[dict[str, object], dict[str, Given]]:
    """(every argument by name with defaults filled in, the given item of each explicit argument).

    ``keywords`` are (name, where the name is written, given value)."""
    params = [a for a in op.args if not a.keyword_only]
    if len(positional) > len(params):
        keyword_only = [a.name for a in op.args if a.keyword_only and not a.te_only]
        hint = f"; pass {', '.join(keyword_only)} by keyword" if keyword_only else ""
        was = "was" if len(positional) == 1 else "were"
        raise ArgumentError(f"{op.name}() takes {_plural(len(params), 'positional argument')} but "
                            f"{len(positional)} {was} given{hint}; signature: {op.signature()}",
                            positional[len(params)])
    given: dict[str, Given] = {}
    values: dict[str, object] = {}

    def take(arg: Arg, item: Given) -> None:
        try:
            values[arg.name] = convert(arg, item)
        except ArgumentError as err:
            raise ArgumentError(err.message, item if err.at is None else err.at, err.value_error) from None
        given[arg.name] = item

    for arg, item in zip(params, positional):
        take(arg, item)
    by_name = {a.name: a for a in op.args}
    for name, name_at, item in keywords:
        if name not in by_name:
            close = difflib.get_close_matches(name, [a.name for a in op.args if not a.te_only], n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ArgumentError(f"{op.name}() got an unexpected keyword argument '{name}'; "
                                f"{hint}signature: {op.signature()}", name_at)
        if name in given:
            raise ArgumentError(f"{op.name}() got multiple values for argument '{name}'; give it once", name_at)
        take(by_name[name], item)
    for a in op.args:
        if a.name not in values:
            if a.default is REQUIRED:
                raise ArgumentError(f"{op.name}() missing required argument '{a.name}'; signature: {op.signature()}")
            values[a.name] = a.default
    return {a.name: values[a.name] for a in op.args}, given
