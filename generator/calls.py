"""Typed calls: what a stage lowers a planned stage to, and all that emit renders.

A call is one line of the generated forward or backward. It reads and writes values by id
(values.py), a backward's grads among them (``ValueTable.grad``); what it does not hold as a value
(a constant, ``ctx``, a keyword argument) is literal text.
Each call keeps its line as text with a named placeholder for each value (``"{y} = torch.addmm({b},
{x}, {w}.t())"``) and renders it by looking the names up: the name a value has where the line
runs (``Emitter.name``), so a value handed on by a stage that changes nothing is written under
the tensor that holds it.

What a backward reads of the forward's values (its reads that are not grads), and so what the
forward saves and which parameters a backward takes, follows from its calls' ``reads``; which
free values (extra inputs, parameters, the training flag, user modules) a run of forward stages
takes follows from theirs. A new kind of call (a
collective: all-gather, reduce-scatter) is one more class here with its reads and writes.
"""

from __future__ import annotations

from typing import Callable, Sequence

class Expr:
    """An expression over values where a call takes an operand: ``Expr("{p}.view(-1)", p=id)``."""

    def __init__(self, text: str, **reads: int):
        self.text, self.reads = text, reads


Operand = int | str | Expr  # a value's id (a grad's too), literal text (a constant, a keyword), an expression


def literal(text: str) -> str:
    """``text`` as it stands in a call's line (braces are placeholders' there)."""
    return text.replace("{", "{{").replace("}", "}}")


class Call:
    """One line over values: ``text`` with a placeholder for each value it reads or writes."""

    def __init__(self, text: str, reads: dict[str, int] | None = None, writes: dict[str, int] | None = None):
        self.text = text
        self.reads = dict(reads or {})
        self.writes = dict(writes or {})

    def render(self, name: Callable[[int], str]) -> str:
        return self.text.format_map({slot: name(value) for slot, value in {**self.reads, **self.writes}.items()})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r}, reads={self.reads}, writes={self.writes})"


def _slots(operands: Sequence[Operand], prefix: str, into: dict[str, int]) -> list[str]:
    """Each operand as it stands in a line: a value as a placeholder (recorded in ``into``),
    literal text as it is."""
    texts = []
    for operand in operands:
        if isinstance(operand, Expr):
            text = operand.text
            for name, value in operand.reads.items():
                slot = f"{prefix}{len(into)}"
                into[slot] = value
                text = text.replace("{" + name + "}", "{" + slot + "}")
            texts.append(text)
        elif isinstance(operand, int):
            slot = f"{prefix}{len(into)}"
            into[slot] = operand
            texts.append("{" + slot + "}")
        else:
            texts.append(literal(operand))
    return texts


class Launch(Call):
    """A generated kernel through its launcher: ``results = kernels.<kernel>(args)``."""

    def __init__(self, kernel: str, args: Sequence[Operand], results: Sequence[Operand]):
        reads: dict[str, int] = {}
        writes: dict[str, int] = {}
        outs, ins = _slots(results, "w", writes), _slots(args, "r", reads)
        super().__init__(f"{', '.join(outs)} = kernels.{literal(kernel)}({', '.join(ins)})", reads, writes)
        self.kernel = kernel


class Fp8Produce(Call):
    """An FP8 GEMM's operand written by the kernel that computes it, through the call's Fp8Call:
    ``result = fp8.produce(gemm, mode, kernels.<its FP8 variant>, kernels.<kernel>, args)``, the
    variant launched as the recipe needs (or the kernel, where the recipe casts no producer's
    output)."""

    def __init__(self, fp8: int, gemm: int, mode: str, kernel: str, plain: str, args: Sequence[Operand],
                 result: Operand):
        reads: dict[str, int] = {}
        writes: dict[str, int] = {}
        (out,), (call,) = _slots([result], "w", writes), _slots([fp8], "r", reads)
        ins = _slots(args, "r", reads)
        super().__init__(f"{out} = {call}.produce({gemm}, {mode!r}, kernels.{literal(kernel)}, kernels.{literal(plain)}, "
                         f"{', '.join(ins)})", reads, writes)
        self.kernel, self.plain = kernel, plain


class TorchCall(Call):
    """A line of PyTorch (a cuBLAS GEMM through torch, a view, an op's reference math, a
    random key): its text with placeholders, and the values they stand for."""


class Alias(Call):
    """``name = of``: one tensor under a second name (forward: an extra output that is the value
    itself; backward: one grad handed to two inputs, or, ``clone``, a copy of it)."""

    def __init__(self, name: Operand, of: Operand, why: str = "", clone: bool = False):
        reads: dict[str, int] = {}
        writes: dict[str, int] = {}
        (out,), (src,) = _slots([name], "w", writes), _slots([of], "r", reads)
        super().__init__(f"{out} = {src}" + (".clone()" if clone else "") + (f"  # {literal(why)}" if why else ""),
                         reads, writes)
        self.name, self.of, self.why = name, of, why


class ModuleCall(Call):
    """A module of the user's code run as it is on the running tensor, at its leading dims."""

    def __init__(self, where: str, module: int, x: int, lead: int, out: int):
        super().__init__(f"{{y}} = ref.run_module({literal(where)}, {{module}}, {{x}}, {{lead}})",
                         dict(module=module, x=x, lead=lead), dict(y=out))
