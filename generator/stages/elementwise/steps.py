"""What each op of an elementwise run is to a kernel: its step (functor, constants, operand and
how that operand's grad is reduced), its operands' names in the kernel and the launcher, and
which extra tensors are aliases rather than writes. The vocabulary both the elementwise kernels
and the norm kernels (their ops before and after the norm) are built from."""

from __future__ import annotations

from typing import Callable

from ...calls import TorchCall
from ...ops import OPS

def width_halving_kinds() -> set[str]:
    return {op.kind for op in OPS.values() if op.halves_width}


def grad_is_reduced(op) -> bool:
    """The op's operand grad is reduced (a parameter's) rather than handed on per element."""
    operand = op.opdef.operand
    return operand is not None and operand.grad in ("column", "scalar")


def reads_operand(op) -> bool:
    return op.opdef.operand is not None and op.opdef.operand.read_in_backward


def _operand_names(op, rel: int) -> tuple[str, str]:
    """(operand, its grad) as the kernel and launcher name them: bias3/dbias3, extra_in3/d_extra_in3."""
    if op.opdef.operand.source == "param":
        param = op.opdef.params[0].name
        return f"{param}{rel}", f"d{param}{rel}"
    if op.opdef.operand.source == "random":
        return f"seed{rel}", ""
    return f"extra_in{rel}", f"d_extra_in{rel}"


def operand_width(pipeline, stage, name: str, kernel_ops=None):
    """Values per row of a kernel's operand or result, by its name (``_operand_names``,
    ``io_names``): an extra input or output (or its grad) is as wide as its op's input, a per-row
    operand (RowScale's scales) one value; a parameter, its grad (a column sum) and a Dropout key
    are per call: 0. ``kernel_ops``: the ops the names number, where not the whole run
    (``kernel_number``)."""
    kind, rel = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")):]
    op = (stage.ops if kernel_ops is None else kernel_ops)[int(rel)]
    if kind in ("extra_out", "d_extra_out"):
        return pipeline.width(op.index)
    if kind in ("extra_in", "d_extra_in"):
        broadcast = op.opdef.operand.broadcast if kind == "extra_in" else op.opdef.operand.grad
        return {"element": pipeline.width(op.index), "row": 1}.get(broadcast, 0)
    return 0  # bias3 / dbias3 / seed3


def random_ops(ops):
    """The ops drawing random operands (Dropout): their forward depends on the training mode."""
    return [op for op in ops if op.opdef.operand is not None and op.opdef.operand.source == "random"]


def new_seed(pipeline, op, x: int) -> TorchCall:
    """A random op's key: a fresh one per call (on ``x``'s device); None in eval mode (keep all)."""
    return TorchCall("{seed} = ref.new_seed({x}) if {training} else None", dict(x=x, training=pipeline.training),
                     dict(seed=op.seed))


def random_operands(steps) -> list[str]:
    """The operands of a kernel's random steps (a Dropout's key tensor, None in eval mode): its
    launcher passes them as ``pointer(t)`` and its custom op takes them as ``Tensor?``."""
    return [step["operand"] for step in steps if step["broadcast"] == "random"]


def operand_ctypes(steps) -> dict[str, str]:
    """{operand: its C type}: a random operand is its 64-bit key, any other a T tensor (a missing
    name: the saved run input or an extra output's grad, both T)."""
    return {dict(s)["operand"]: "const long long*" if dict(s)["broadcast"] == "random" else "const T*"
            for s in steps if dict(s)["operand"]}


def kernel_number(stage, op, kernel_ops=None) -> int:
    """``op``'s number in its kernel, which names its operands and results: its place in the run,
    or among ``kernel_ops`` (a norm kernel's own ops, whose numbers do not depend on an
    AddExtraInput or MakeExtraOutput before its norm, so stages that differ only by those share
    one kernel)."""
    if kernel_ops is None:
        return op.index - stage.start
    return [o.index for o in kernel_ops].index(op.index)


def io_names(stage, kernel_ops=None, grad: Callable[[int], int] | None = None) -> dict[str, int]:
    """{launcher operand or result: the value the generated module passes} for a run's ops (or
    for ``kernel_ops``: ``kernel_number``): a parameter, a random key, an extra input or output;
    and, given ``grad`` (a backward's: the grad value of a value, Emitter.grad), their grads."""
    operands: dict[str, int] = {}
    for op in stage.ops if kernel_ops is None else kernel_ops:
        rel = kernel_number(stage, op, kernel_ops)
        if op.opdef.operand is not None:
            operand, operand_grad = _operand_names(op, rel)
            if op.opdef.operand.source == "param":
                operands[operand] = op.param(op.opdef.params[0].name)
            elif op.opdef.operand.source == "random":
                operands[operand] = op.seed
            else:
                operands[operand] = op.extra_in
            if operand_grad and grad is not None:
                operands[operand_grad] = grad(operands[operand])
        if op.extra_out is not None:  # a public extra output or a Residual's value
            operands[f"extra_out{rel}"] = op.extra_out
            if grad is not None:
                operands[f"d_extra_out{rel}"] = grad(op.extra_out)
    return operands


def glu_index(ops) -> int | None:
    return next((op.index for op in ops if op.opdef.halves_width), None)


def _alias(stage, op, changes: str, first: str, last: str) -> str:
    """Where an extra tensor of ``op`` comes from: the run's ``first`` tensor when no op before it
    changes ``changes`` (value or grad), its ``last`` tensor when none after does, else 'write'."""
    before = any(getattr(o.opdef, changes) for o in stage.ops if o.index < op.index)
    after = any(getattr(o.opdef, changes) for o in stage.ops if o.index > op.index)
    return first if not before else last if not after else "write"


def forward_aliases(stage) -> dict[int, str]:
    """For each extra output of a forward run: 'input', 'output' (the same tensor) or 'write'."""
    return {op.index: _alias(stage, op, "changes_value", "input", "output")
            for op in stage.ops if op.opdef.functor_form == "tee"}


def backward_aliases(stage) -> dict[int, str]:
    """For each per-element addend of a backward run (an extra input), its grad: 'dx', 'dy' (the
    same tensor) or 'write'."""
    return {op.index: _alias(stage, op, "changes_grad", "dx", "dy")
            for op in stage.ops if op.opdef.operand is not None and op.opdef.operand.grad == "element"}


def op_step(stage, op, glu: int | None, kernel_ops=None, **extra) -> tuple[tuple[str, object], ...]:
    """One op of a run as the templates see it: its number in the kernel (``kernel_number``), its
    form and functor, its operand (name, broadcast, grad), lanes 'a' (and 'b' before a GLU: the
    row's second half)."""
    rel = kernel_number(stage, op, kernel_ops)
    lanes = ("a", "b") if glu is not None and op.index <= glu else ("a",)  # a GLU reads both halves
    constants = op.opdef.device_args(op.args)
    operand = op.opdef.operand
    names = _operand_names(op, rel) if operand is not None else ("", "")
    step = dict(index=rel, lanes=lanes, form=op.opdef.functor_form, struct=op.opdef.device_struct,
                cuda_args=tuple(f"{float(c)!r}f" for c in constants),
                python_args=tuple(repr(float(c)) for c in constants), label=op.describe(kernel=True),
                reference=op.opdef.reference_names, operand=names[0], operand_grad=names[1],
                broadcast=operand.broadcast if operand else "", grad=operand.grad if operand else "",
                reads_operand=bool(operand and operand.read_in_backward),
                tee=f"extra_out{rel}" if op.extra_out is not None else "",
                interleave=op.opdef.interleave(op.args), **extra)
    return tuple(sorted(step.items()))


def device_headers(stage) -> tuple[str, ...]:
    return tuple(sorted({op.opdef.device_header for op in stage.ops if op.opdef.device_struct}))
