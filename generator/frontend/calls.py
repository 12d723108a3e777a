"""Op calls: what a ``NAME = Sequential(...)`` holds, bound to the op registry's signatures.

``OpBinder`` reads each call of a Sequential and binds its arguments with the registry's one
binder (ops.binding), folding each value from its node; ``OpCall`` and ``SequentialSpec`` are what
the frontend hands on.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import libcst as cst

from ..errors import Location, SpecError
from ..ops import NOT_YET, OPS, RESIDUAL, SEQUENTIAL, SPEC_MODULES, Arg, OpDef, basic_ops, op_modules
from ..ops.binding import ArgumentError, bind, check_value
from ..ops.te_namespace import (ANY, MODULES_NOT_YET, TE_NAMESPACE, module_keyword, module_only_argument,
                                module_positional)
from .scope import Scope, _dotted, _ident
from .source import SpecSource
from .values import ConstantFolder

# Ops in one Sequential (Linear counts once; real pipelines have tens). The planner slides each
# rule over the ops, quadratic in their number, so this keeps planning well under a second.
MAX_OPS = 1000
_UNFOLDED = object()  # a module-only argument's value that is no literal (a function, an object)


def user_module(target: tuple[str, str]) -> bool:
    """Whether a callee is a module class run as it is between fused ops, as TE's Sequential runs
    what it cannot fuse: the user's code, or torch.nn's modules without a te.ops equivalent (the
    callee is not an op there); not Transformer Engine's or fusegen's (an op they do not have is an
    unknown op there)."""
    module, name = target
    if not name[:1].isupper():  # a function, not a module class (a spec cannot tell them apart otherwise)
        return False
    if module == "torch.nn":
        return True
    return not (module in op_modules() or module.split(".")[0] in ("transformer_engine", "fusegen"))


@dataclass(frozen=True)
class OpCall:
    op: str  # registry name (ops.OPS), aliases resolved
    args: dict[str, object]  # every argument of the op by name, defaults filled in
    location: Location  # the call
    arg_locations: dict[str, Location]  # where each explicitly given argument is written
    inner: tuple[OpCall, ...] = ()  # a Residual's ops (op RESIDUAL), in order


@dataclass(frozen=True)
class SequentialSpec:
    name: str  # the module-level variable
    file: str  # display path
    location: Location  # the Sequential(...) call
    calls: tuple[OpCall, ...]
    name_location: Location  # the NAME of NAME = Sequential(...)


class OpBinder:
    """Reads the op calls of a Sequential(...): the callee through ``scope``, the arguments through ``folder``."""

    def __init__(self, source: SpecSource, scope: Scope, folder: ConstantFolder) -> None:
        self.source = source
        self.scope = scope
        self.folder = folder

    def sequential(self, name: str, name_location: Location, call: cst.Call) -> SequentialSpec:
        self.pipeline, self.counted = name, 0  # ops counted over the Residuals too
        calls = self.op_calls(call, "Sequential(...)")
        return SequentialSpec(name, self.source.display, self.source.loc(call), calls, name_location)

    def op_calls(self, call: cst.Call, container: str) -> tuple[OpCall, ...]:
        """The op calls a Sequential(...) or a Residual(...) holds, in order (a Residual's own,
        read the same way: Residuals nest)."""
        calls = []
        for arg in call.args:
            self.counted += 1
            if self.counted > MAX_OPS:
                raise SpecError(f"pipeline '{self.pipeline}' has {self.counted} ops; fusegen plans at most "
                                f"{MAX_OPS} ops per pipeline, so split it into several pipelines", self.source.loc(arg))
            if arg.star or arg.keyword is not None or not isinstance(arg.value, cst.Call):
                raise SpecError(f"{container} takes op calls like te.ops.Linear(4096, 4096); got "
                                f"'{self.source.code(arg)}'", self.source.loc(arg))
            op = self.scope.op_name(arg.value)
            if op == SEQUENTIAL:
                raise SpecError(f"Sequential(...) cannot be nested in {container}; list the inner ops directly "
                                "in the outer one", self.source.loc(arg.value))
            if op == RESIDUAL:
                calls.append(self.residual(arg.value))
                continue
            if op is None:
                target = self.scope.resolve(arg.value.func)
                if target is None or not user_module(target):
                    raise self.unknown_op(arg.value.func)
                calls.append(self.module_call(target, arg.value))
                continue
            calls.append(self.bind(OPS[op], arg.value))
        return tuple(calls)

    def residual(self, call: cst.Call) -> OpCall:
        """``Residual(op, ...)``: y = x + ops(x), its ops read as a Sequential's; the pipeline's
        extra inputs and outputs and the user's modules stay outside it (ir.py expands it)."""
        spelled = self.source.code(call.func)
        if not call.args:
            raise SpecError(f"{spelled}() is empty; give it the ops of the residual branch, as in "
                            f"{spelled}(te.ops.RMSNorm(4096), te.ops.Linear(4096, 4096)), or leave it out",
                            self.source.loc(call))
        inner = self.op_calls(call, f"{spelled}(...)")
        for op_call in inner:
            if op_call.op == RESIDUAL:  # checked when it was read
                continue
            basic = [] if op_call.op == "Module" else [sub for sub, _ in basic_ops(op_call.op, op_call.args)]
            # a Reshape's rows and leading dims differ from the Residual input's it is added to
            if op_call.op == "Module" or any(sub.extra_inputs or sub.extra_outputs or sub.reshape for sub in basic):
                what = ("a module of your code" if op_call.op == "Module"
                        else f"{op_call.op}() (a reshape of the running value)" if any(sub.reshape for sub in basic)
                        else f"{op_call.op}() (an extra input or output of the pipeline)")
                raise SpecError(f"{spelled}(...) cannot hold {what} yet; move it out of the Residual "
                                "(before or after it in the Sequential)", op_call.location)
        return OpCall(RESIDUAL, {}, self.source.loc(call), {}, inner)

    def bind(self, op: OpDef, call: cst.Call) -> OpCall:
        """Match a call's arguments to ``op``'s signature (ops.binding, the one binder), each value
        folded from its node; a mismatch is a SpecError at the node the binder names."""
        for arg in call.args:
            if arg.star:
                raise SpecError(f"{op.name}() arguments cannot be unpacked with {arg.star}; write each argument "
                                f"out; signature: {op.signature()}", self.source.loc(arg))
        positional = [arg.value for arg in call.args if arg.keyword is None]
        module, attribute = self.scope.resolve(call.func) or ("", "")
        named = [(_ident(arg.keyword.value), arg.keyword, arg.value) for arg in call.args if arg.keyword is not None]
        order = module_positional(module, attribute)
        if order is not None and positional:  # TE's module's positional order: te.LayerNorm(4096, 1e-6)
            if len(positional) > len(order):
                raise SpecError(f"te.{attribute}() takes at most {len(order)} positional arguments (TE's module: "
                                f"{', '.join(order)}); pass the others by keyword", self.source.loc(positional[-1]))
            named = [(name, node, node) for name, node in zip(order, positional)] + named
            positional = []
        # a TE module's keyword read as te.ops' of that meaning: te.RMSNorm(hidden_size=4096, params_dtype=...)
        keywords = []
        for name, name_at, node in named:
            only = module_only_argument(module, attribute, name)  # te.Linear(..., return_bias=False)
            if only is None:
                keywords.append((module_keyword(module, attribute, name), name_at, node))
                continue
            default, why = only
            if default is ANY:
                continue
            try:
                given = self.folder.evaluate(node, f"argument '{name}' of te.{attribute}")
                shown = repr(given)
            except SpecError:  # a function or object (init_method=...): never TE's default
                given, shown = _UNFOLDED, self.source.code(node)
            if given is _UNFOLDED or given != default:
                raise SpecError(f"te.{attribute}(): argument '{name}' is {shown}: it {why}", self.source.loc(node))

        def value(spec_arg: Arg, node: cst.BaseExpression) -> object:
            if spec_arg.kind == "group":  # a process group: the module's, at run time; the expression only shown
                return None if isinstance(node, cst.Name) and node.value == "None" else self.source.code(node)
            named = self.named_object(spec_arg, node)
            folded = self.folder.evaluate(node, f"argument '{spec_arg.name}' of {op.name}") if named is None else named
            return check_value(op, spec_arg, folded)

        try:
            args, given = bind(op, positional, keywords, value)
        except ArgumentError as err:
            raise SpecError(err.message, self.source.loc(call if err.at is None else err.at)) from None
        where = {name: self.source.loc(node) for name, node in given.items()}
        problem = op.validate(args) if op.validate else None
        if problem:
            raise SpecError(f"{op.name}(): {problem}", self.source.loc(call))
        self.check_expansion(op, args, given, call)
        return OpCall(op.name, args, self.source.loc(call), where)

    def named_object(self, spec_arg: Arg, node: cst.BaseExpression) -> str | None:
        """For an argument that takes objects of other modules (``Arg.objects``), what a name the
        file imports gives: one of those objects as its last name (``te.DotProductAttention``), any
        other as its import path, which the argument's check refuses; None for all else (folded)."""
        if not spec_arg.objects or not isinstance(node, (cst.Name, cst.Attribute)):
            return None
        target = self.scope.resolve(node)
        if target is None:
            return None
        path = ".".join(target)
        return target[1] if path in spec_arg.objects else path

    def check_expansion(self, op: OpDef, args: dict[str, object], given: dict[str, cst.CSTNode],
                        call: cst.Call) -> None:
        """A container's basic ops hold their own arguments' checks too (``nn.Dropout(1.5)``
        must fail as ``Dropout(1.5)`` does), wherever the container's signature leaves one out;
        the error points at the argument of the same name, else at the call."""
        if op.expand is None:
            return
        for sub, sub_args in basic_ops(op.name, args):
            for sub_arg in sub.args:
                try:
                    check_value(sub, sub_arg, sub_args[sub_arg.name])
                except ArgumentError as err:
                    at = given.get(sub_arg.name, call)
                    raise SpecError(f"{op.name}(): {err.message}", self.source.loc(at)) from None

    def module_call(self, target: tuple[str, str], call: cst.Call) -> OpCall:
        """A call of a class from the user's code: a ``Module`` op holding where it comes from, the
        call as written and its folded (literal) arguments."""
        spelled = self.source.code(call.func)
        positional, keywords = [], []
        for i, arg in enumerate(call.args):
            if arg.star:
                raise SpecError(f"{spelled}() arguments cannot be unpacked with {arg.star}; write each argument out",
                                self.source.loc(arg))
            if arg.keyword is None:
                positional.append(self.folder.evaluate(arg.value, f"argument {i + 1} of {spelled}"))
            else:
                name = _ident(arg.keyword.value)
                keywords.append((name, self.folder.evaluate(arg.value, f"argument '{name}' of {spelled}")))
        args = {"target": ".".join(target), "call": self.source.code(call), "positional": tuple(positional),
                "keywords": tuple(keywords)}
        return OpCall("Module", args, self.source.loc(call), {})

    def unknown_op(self, func: cst.BaseExpression) -> SpecError:
        spelled = self.source.code(func)
        target = self.scope.resolve(func)
        if target is not None and target[0] in SPEC_MODULES and target[1] in NOT_YET:
            return SpecError(f"{target[1]} is a te.ops operation fusegen does not generate: {NOT_YET[target[1]]}; "
                             "leave it out of the pipeline (run it before or after the generated module)",
                             self.source.loc(func))
        if target is not None and target[0] == TE_NAMESPACE and target[1] in MODULES_NOT_YET:
            return SpecError(f"te.{target[1]}: {MODULES_NOT_YET[target[1]]}", self.source.loc(func))
        if target is None:
            why = (f" ('{spelled}' is not imported from {' or '.join(op_modules())})"
                   if _dotted(func) else "")
        elif target[0] == "torch.nn":  # a function (module classes run as they are)
            mapped = ", ".join(op.attribute for op in OPS.values() if "torch.nn" in op.modules)
            why = (f" (torch.nn modules stand for te.ops where fusegen has the op: {mapped}, and other torch.nn "
                   f"modules run as they are; torch.nn.{target[1]} is not a module class)")
        elif target[0] not in op_modules():
            why = f" (it is {'.'.join(target)}, not an op of {' or '.join(op_modules())})"
        elif target[1] in OPS:  # a plugin's op spelled from Transformer Engine, or the reverse
            why = f" ({target[1]} is not in {target[0]}; import it from {' or '.join(OPS[target[1]].modules)})"
        else:
            why = ""
        known = sorted({op.attribute for op in OPS.values() if op.modules})
        attribute = target[1] if target is not None else spelled.rpartition(".")[2]
        close = close_match(attribute, known)
        if close is not None and close != attribute:
            hint = f"did you mean '{spelled[:len(spelled) - len(attribute)]}{close}'?"
        elif close is not None and target is None:  # the right name, never imported
            module = next(op.modules[0] for op in OPS.values() if op.attribute == close and op.modules)
            hint = f"import it: from {module} import {close}"
        else:
            hint = f"known ops: {', '.join(known)}"
        return SpecError(f"unknown op '{spelled}'{why}; {hint}", self.source.loc(func))


def close_match(word: str, known: list[str], cutoff: float = 0.6) -> str | None:
    """The one of ``known`` that ``word`` most likely misspells (case aside: 'Layernorm'), or None;
    ``cutoff``: difflib's least similarity."""
    by_folded = {name.casefold(): name for name in known}
    close = difflib.get_close_matches(word.casefold(), list(by_folded), n=1, cutoff=cutoff)
    return by_folded[close[0]] if close else None
