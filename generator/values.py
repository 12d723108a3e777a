"""A pipeline's values, typed and named by id: what the stages lower to calls over and what
generated code names.

Every tensor, parameter, flag or object a pipeline's generated code handles is a ``Value``: an id
(the graph's for the values it numbers, ir.py: the input, each op's output, the extra inputs;
new ids for the rest), a ``Role``, a dtype and its name in generated code. A value read twice (a
residual) is one value with two readers. A backward's grads are values too (``ValueTable.grad``):
the grad of a value has its role, dtype and width, ``grad_of`` its id, and the name ``d_<name>``. The names are derived from the spec (``x``,
``linear1_out``, ``extra_input0``, ``linear1_weight``), so a change to a spec or a rule shows up
as a readable diff of generated code.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .ir import Size


class Role(Enum):
    ACTIVATION = "activation"  # [rows, features] in x's dtype: the input, each op's output, extra inputs and outputs
    ROWWISE = "rowwise"  # one number per row (an extra input a row-scaled op multiplies by)
    METADATA = "metadata"  # about the rows, not of them: a user module's leading dims, a random op's key
    STATISTIC = "statistic"  # a norm's fp32 mean or rstd, one per row, kept for its backward
    PARAMETER = "parameter"  # a module parameter (its own dtype)
    STATE = "state"  # kept across calls in the state_dict (none yet: FP8 scales live in the runtime's Fp8State)
    OBJECT = "object"  # a Python object handed in: a user's module
    GROUP = "group"  # the tensor-parallel process group the generated module is given at construction
    FLAG = "flag"  # a bool: the module's training mode


X_DTYPE = "x"  # a value's dtype: the pipeline input's, whatever it is at run time
HOST_INT = "host int"  # a value's dtype: a Python int, no tensor (max_seqlen), kept beside a backward's tensors
HOST_OBJECT = "host object"  # a value's dtype: a Python object (an FP8 call, an FP8 weight), kept likewise
HOST_DTYPES = (HOST_INT, HOST_OBJECT)  # what the ctx keeps beside save_for_backward's tensors


@dataclass(frozen=True)
class Value:
    id: int
    role: Role
    dtype: str  # X_DTYPE, "float32", "int64", "bool", "param" (the parameter's own), "object", HOST_INT, HOST_OBJECT
    name: str  # its name in generated code
    features: Size | None = None  # an activation's width (a statistic or a flag has none)
    grad_of: int | None = None  # a grad: the id of the value it is the grad of (None: not a grad)


class ValueTable:
    """The values of one pipeline by id. The pipeline's own come from its graph (pipeline.chain);
    a stage adds what its lowering makes (a norm's statistics) to the table of the emission it
    lowers into (``add``), so the pipeline's table stays as the graph made it."""

    def __init__(self, values=()):
        self._values: dict[int, Value] = {value.id: value for value in values}
        self._grads: dict[int, int] = {}  # a value's id -> its grad's

    def add(self, role: Role, dtype: str, name: str, features: Size | None = None, grad_of: int | None = None) -> int:
        value = Value(max(self._values, default=-1) + 1, role, dtype, name, features, grad_of)
        self._values[value.id] = value
        return value.id

    def grad(self, of: int, name: str | None = None) -> int:
        """The id of the grad of value ``of``, added the first time it is asked for: of its role,
        dtype and width, named ``name`` (``d_`` and the value's name unless given: the backward
        names a grad after the tensor that holds its value, Emitter.grad)."""
        if of not in self._grads:
            value = self._values[of]
            assert value.grad_of is None, f"{value.name}: a grad of a grad (the backward is first order)"
            self._grads[of] = self.add(value.role, value.dtype, name or grad_name(value.name), value.features, grad_of=of)
        return self._grads[of]

    def __getitem__(self, id: int) -> Value:
        return self._values[id]

    def __iter__(self):
        return iter(self._values.values())

    def of_role(self, *roles: Role) -> list[Value]:
        return [value for value in self._values.values() if value.role in roles]


# --- names in generated code (a value's name is given once, when it enters a table) -------------

def activation_name(producer, reader) -> str:
    """Name of the value op ``producer`` writes, ``reader`` (the next op, or None) reads."""
    if producer.residual and producer.opdef.extra_outputs:  # a Residual's tee: its input, into its ops
        return f"{producer.hint}_in"
    if reader is not None and reader.module_index == producer.module_index:
        return f"{producer.hint}_pre_{reader.kind}"  # inside a container: Linear's matmul output
    return f"{producer.module_hint}_out"  # the spec-level op's output (its last part's)


def param_name(op, attr: str) -> str:
    """``linear1_weight``; ``layernormmlp0_fc1_weight``: as the spec-level op holds it."""
    return f"{op.module_hint}_{op.holder_attribute(attr).replace('.', '_')}"  # proj.weight: proj_weight


def extra_input_name(op) -> str:
    """Public: named by order among the pipeline's extra inputs, so inserting an op elsewhere in
    the spec never renames a caller's keyword argument."""
    return f"extra_input{op.extra_input}"


def extra_output_name(op) -> str:
    if op.writes_back_to is not None:  # hidden: the new value of a caller's extra input
        return f"new_extra_input{op.writes_back_to}"
    return f"extra_output{op.extra_output}"


def residual_name(op) -> str:
    """The value a Residual's tee keeps for its add (its input): ``residual0``, ``residual0_1``."""
    return op.hint


def grad_name(name: str) -> str:
    """The name of the grad of the tensor named ``name``: ``d_linear1_out``, ``d_extra_input0``."""
    return f"d_{name}"


def seed_name(op) -> str:
    """The generated module's name for a random op's key, drawn once per call (Operand "random")."""
    return f"{op.hint}_seed"


def module_name(op) -> str:
    return f"{op.hint}_module"


def lead_name(op) -> str:
    return f"{op.hint}_lead"
