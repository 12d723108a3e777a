"""The planner's view of a graph (ir.py): the chain of basic ops a Sequential runs, each with
its feature sizes, parameters and extra input/output numbers.

Rules match consecutive ops of this chain, as TE's fuser matches its op list. Views (``Identity``)
are left out (they would only break fusion windows, catalog 6.2 item 13); a pipeline of only
Identity ops has no op: its module returns its input, as TE's.

A pipeline in which no op fixes the feature size is size-generic: its sizes are ``Sym``s (``n``,
``n // 2`` after a GLU) and its kernels take ``n`` at run time. ``specialise`` lists input sizes
to build fixed-size kernels for as well (``[tool.fusegen.pipelines.<name>] features``).
"""

from __future__ import annotations

import math
import string
from collections import Counter
from dataclasses import dataclass, replace

from . import names
from .errors import Location
from .frontend import SequentialSpec
from .ir import Graph, Size, Sym, build_graph, size_at
from .ops import OPS, OpDef


@dataclass(frozen=True)
class Op:
    """One basic op of a pipeline. Its input is value ``index``, its output value ``index + 1``."""

    index: int
    opdef: OpDef
    args: dict
    in_features: Size
    out_features: Size
    module_index: int  # position in the spec's Sequential: the state_dict prefix
    module_name: str  # the spec-level op ("Linear" for its BasicLinear and Bias)
    location: Location
    extra_input: int | None = None  # index among the pipeline's extra inputs
    extra_output: int | None = None  # index among the pipeline's extra outputs
    # A hidden extra output (numbered after the public ones): the value goes into this extra
    # input of the caller's after the forward (OpDef.writes_back)
    writes_back_to: int | None = None
    number: str = ""  # how plans, code and kernels' launch comments cite it (spec_numbers)

    @property
    def kind(self) -> str:
        return self.opdef.kind

    @property
    def tag(self) -> str:
        return self.opdef.tag(self.args)

    @property
    def hint(self) -> str:
        """A readable, unique stem for names in generated code, e.g. ``linear1``."""
        return f"{self.module_name.lower()}{self.module_index}"

    @property
    def params(self) -> list[tuple[str, str, tuple[int, ...], str]]:
        """(attribute, state_dict key, shape, init) for each parameter."""
        return [
            (p.name, f"{self.module_index}.{p.name}", p.shape(self.args), p.init(self.args))
            for p in self.opdef.params
        ]

    def describe(self, kernel: bool = False) -> str:
        """The basic op as a spec would write it (OpDef.describe)."""
        return self.opdef.describe(self.args, kernel)


@dataclass(frozen=True)
class Pipeline:
    name: str
    file: str
    location: Location
    ops: tuple[Op, ...]
    num_extra_inputs: int
    num_extra_outputs: int
    graph: Graph  # what this chain is a view of
    specialise: tuple[int, ...] = ()  # input sizes a size-generic pipeline also has fixed-size kernels for

    @property
    def class_name(self) -> str:
        return names.class_name(self.name)

    @property
    def in_features(self) -> Size:
        return self.graph.features(self.graph.inputs[0])

    @property
    def out_features(self) -> Size:
        return self.graph.features(self.graph.outputs[0])

    @property
    def generic(self) -> bool:
        """Whether the feature sizes are symbolic (no op fixes one)."""
        return isinstance(self.in_features, Sym)

    @property
    def divisor(self) -> int:
        """What a size-generic pipeline's input size must be a multiple of: each GLU halves it, and
        an interleaved GLU (glu_interleave_size=k) reads whole blocks of 2k."""
        return self.divisor_of("")

    def divisor_of(self, width: str) -> int:
        """``divisor`` for the sizes made from ``width`` ("": the input's n; else a Reshape's
        run-time width, ``Sym.width``)."""
        made = [v.features for v in self.graph.values if isinstance(v.features, Sym) and v.features.width == width]
        divisor = max((size.divisor for size in made), default=1)
        for op in self.ops:
            k = op.opdef.interleave(op.args)
            # n * p / q a multiple of 2k
            if k is not None and isinstance(op.in_features, Sym) and op.in_features.width == width:
                p, q = op.in_features.factor.numerator, op.in_features.factor.denominator
                need = 2 * k * q
                divisor = math.lcm(divisor, need // math.gcd(need, p))
        return divisor

    @property
    def params(self) -> list[tuple[Op, str, str, tuple[int, ...], str]]:
        return [(op, *p) for op in self.ops for p in op.params]

    @property
    def written_back(self) -> list[Op]:
        """The hidden tees of ops that write their value into an extra input, in order."""
        return [op for op in self.ops if op.writes_back_to is not None]

    def width(self, position: int, n: int | None = None) -> Size:
        """Feature size of value ``position`` (0 = pipeline input); at input size ``n`` if given."""
        size = self.ops[position].in_features if position < len(self.ops) else self.out_features
        return size_at(size, n)


def spec_numbers(ops: list[Op]) -> list[str]:
    """Each basic op's number, the one numbering plans and generated code use: its spec op's
    position in the Sequential as written (the eager Sequential's child index, the state_dict
    prefix; views count), lettered where that op runs as several basic ops: "1a", "1b" for a
    Linear's BasicLinear and Bias, or an in-place AddExtraInput's add and its write-back."""
    parts = Counter(op.module_index for op in ops)
    seen: Counter[int] = Counter()
    numbers = []
    for op in ops:
        letter = string.ascii_lowercase[seen[op.module_index]] if parts[op.module_index] > 1 else ""
        numbers.append(f"{op.module_index}{letter}")
        seen[op.module_index] += 1
    return numbers


def ops_cited(ops) -> str:
    """``ops`` as plans and comments cite them: "op 3" or "ops 1a, 1b"."""
    return ("op " if len(ops) == 1 else "ops ") + ", ".join(op.number for op in ops)


def build_pipeline(spec: SequentialSpec, specialise: tuple[int, ...] = ()) -> Pipeline:
    return chain(build_graph(spec), specialise)


def chain(graph: Graph, specialise: tuple[int, ...] = ()) -> Pipeline:
    """The planner's view of a graph: its nodes in order, views left out, each op reading the
    running value its predecessor wrote; extra inputs and outputs numbered by their order among
    the graph's inputs and outputs."""
    ops: list[Op] = []
    n_out, n_hidden = 0, len(graph.outputs) - 1
    for node in graph.nodes:
        if node.opdef.view:
            continue
        extra_input = graph.inputs.index(node.inputs[1]) - 1 if node.opdef.extra_inputs else None
        ops.append(Op(
            index=len(ops), opdef=node.opdef, args=node.args, in_features=graph.features(node.inputs[0]),
            out_features=graph.features(node.outputs[0]), module_index=node.module_index,
            module_name=node.module_name, location=node.location, extra_input=extra_input,
            extra_output=n_out if node.opdef.extra_outputs else None,
        ))
        n_out += node.opdef.extra_outputs
        if node.opdef.writes_back(node.args):  # its value handed out by a tee the spec does not show
            size = graph.features(node.outputs[0])
            ops.append(Op(
                index=len(ops), opdef=OPS["MakeExtraOutput"], args={"in_place": False}, in_features=size,
                out_features=size, module_index=node.module_index, module_name=node.module_name,
                location=node.location, extra_output=n_hidden, writes_back_to=extra_input,
            ))
            n_hidden += 1
    ops = [replace(op, number=number) for op, number in zip(ops, spec_numbers(ops))]
    return Pipeline(graph.name, graph.file, graph.location, tuple(ops), len(graph.inputs) - 1,
                    len(graph.outputs) - 1, graph, tuple(specialise))
