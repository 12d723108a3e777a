"""The generated calling convention, derived from the roles of a pipeline's free values.

A pipeline's free values are what its code takes rather than computes: x, the extra inputs, the
parameters, the training flag, each user module and the leading dims it runs at (values.py). In
that order they are the autograd Function's inputs (and the no-grad forward's, and a segment
Function's where it reads them); each role says how the module's ``forward`` passes the value,
whether the Function returns a grad for it, and its type in the no-grad custom op's schema. A new
kind of input is one role here and its rendering in ``_passed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import size_expr
from ..source_text import comment_text
from ..values import Role

# the roles of values that are tensors with grads (a flag, an object or metadata has none: the
# Function returns None for it, and a custom op's schema has no tensor for it)
TENSOR_ROLES = (Role.ACTIVATION, Role.ROWWISE, Role.PARAMETER)
# the roles of the tensors the caller hands the module (a CUDA graph is captured per their shapes)
CALLER_ROLES = (Role.ACTIVATION, Role.ROWWISE)


@dataclass(frozen=True)
class Argument:
    """One free value as the generated code takes it."""

    value: int
    role: Role
    name: str  # the Function's, the no-grad forward's and (x, extra inputs) the module forward's parameter
    passed: str  # what the module's forward passes for it (its ``args``)
    line: str  # the args line it shares with the arguments of the same key (parameters; a module and its dims)
    comment: str = ""  # the line's comment

    @property
    def tensor(self) -> bool:
        return self.role in TENSOR_ROLES

    @property
    def schema(self) -> str:
        """Its type in a custom op's schema."""
        if self.role is Role.FLAG:
            return "bool"
        assert self.tensor, f"{self.name}: a {self.role.value} value has no type in a custom op's schema"
        return "Tensor"


def free_values(pipeline) -> list[int]:
    """The values the pipeline's code takes, in the Function's order."""
    p = pipeline
    modules = [value for op in p.ops if op.module_object is not None for value in (op.module_object, op.lead)]
    return ([0, *p.extra_input_values, *(value for op in p.ops for _, value in op.param_ids)]
            + ([p.training] if p.training is not None else []) + modules)


def arguments(pipeline, leads: dict[int, str], copied: set[int]) -> list[Argument]:
    """Each free value as an argument. ``leads``: the leading dims' name at each op's input
    (emit.leading_dims); ``copied``: extra inputs the forward gets a copy of (the caller's tensor
    changes after it: a written-back one the backward reads)."""
    owner = {}
    for op in pipeline.ops:
        for value in (op.extra_in, *(v for _, v in op.param_ids), op.module_object, op.lead):
            owner.setdefault(value, op)
    return [_passed(pipeline, pipeline.value(value), owner.get(value), leads, copied) for value in free_values(pipeline)]


def _passed(pipeline, value, op, leads, copied) -> Argument:
    """How the module's forward passes ``value`` (of ``op``), by its role."""
    name = value.name
    if value.role is Role.ACTIVATION:  # x, an extra input: [rows, features], dense
        features = size_expr(value.features, "n", "//")
        if value.id in copied:
            passed = f"{name}.reshape(-1, {features}).clone(memory_format=torch.contiguous_format)"
        else:
            passed = f"as_rows({name}, {features})"
        return Argument(value.id, value.role, name, passed, line=name)
    if value.role is Role.ROWWISE:  # one value per row
        return Argument(value.id, value.role, name, f"{name}.reshape(-1).contiguous()", line=name)
    if value.role is Role.PARAMETER:  # the parameters, on one line
        return Argument(value.id, value.role, name, name, line="parameters")
    if value.role is Role.FLAG:
        return Argument(value.id, value.role, name, "self.training", line=name,
                        comment="Dropout draws its masks in training only")
    if value.role is Role.OBJECT:  # a user's module, on one line with the leading dims it runs at
        return Argument(value.id, value.role, name, f'self._modules["{op.module_index}"]', line=name)
    if value.role is Role.METADATA and op is not None and op.lead == value.id:
        return Argument(value.id, value.role, name, leads[op.index], line=pipeline.value(op.module_object).name,
                        comment=f"{comment_text(op.args['call'])}: run as it is")
    raise AssertionError(f"{pipeline.name}: no argument for the {value.role.value} value {name}")


def passed_lines(args: list[Argument]) -> list[str]:
    """The module forward's ``args`` tuple, one line per key, each ending in a comma."""
    lines: list[tuple[str, list[Argument]]] = []
    for arg in args:
        if lines and lines[-1][0] == arg.line:
            lines[-1][1].append(arg)
        else:
            lines.append((arg.line, [arg]))
    return [", ".join(a.passed for a in group) + "," + (f"  # {group[-1].comment}" if group[-1].comment else "")
            for _, group in lines]


def grad_inputs(args: list[Argument], d_x: str) -> list[str]:
    """What the Function's backward returns for each input: x's grad (``d_x``: the name the
    backward gives it), ``d_<name>`` for a tensor, None for the rest."""
    return [d_x if arg.value == 0 else f"d_{arg.name}" if arg.tensor else "None" for arg in args]


def caller_tensors(args: list[Argument]) -> list[str]:
    """The tensors the caller hands the module's forward: x and the extra inputs."""
    return [arg.name for arg in args if arg.role in CALLER_ROLES]


def schema_arguments(args: list[Argument]) -> str:
    """The arguments of a custom op's schema: ``Tensor x, ..., bool training``."""
    return ", ".join(f"{arg.schema} {arg.name}" for arg in args)


def schema(args: list[Argument], outputs: int) -> str:
    """A custom op's schema of these arguments and ``outputs`` tensors."""
    returns = "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    return f"({schema_arguments(args)}) -> {returns}"
