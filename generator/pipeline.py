"""The planner's view of a graph (ir.py): the chain of basic ops a Sequential runs, each with
its feature sizes, parameters and extra input/output numbers.

Rules match consecutive ops of this chain, as TE's fuser matches its op list. Views (``Identity``)
are left out (they would only break fusion windows, catalog 6.2 item 13).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import names
from .errors import Location, SpecError
from .frontend import SequentialSpec
from .ir import Graph, build_graph
from .ops import REQUIRED, OpDef


@dataclass(frozen=True)
class Op:
    """One basic op of a pipeline. Its input is value ``index``, its output value ``index + 1``."""

    index: int
    opdef: OpDef
    args: dict
    in_features: int
    out_features: int
    module_index: int  # position in the spec's Sequential: the state_dict prefix
    module_name: str  # the spec-level op ("Linear" for its BasicLinear and Bias)
    location: Location
    extra_input: int | None = None  # index among the pipeline's extra inputs
    extra_output: int | None = None  # index among the pipeline's extra outputs

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
        """The op as a spec would write it: required arguments by position, others if not default.
        ``kernel=True``: as a kernel sees it, without the arguments that are no part of what it
        computes (device=, dtype=, TE's no-op hints: ``Arg.in_kernel``)."""
        shown = []
        for a in self.opdef.args:
            if kernel and not a.in_kernel:
                continue
            value = self.args[a.name]
            if a.default is REQUIRED:
                shown.append(repr(value))
            elif value != a.default:
                shown.append(f"{a.name}={value!r}")
        return f"{self.opdef.name}({', '.join(shown)})"


@dataclass(frozen=True)
class Pipeline:
    name: str
    file: str
    location: Location
    ops: tuple[Op, ...]
    num_extra_inputs: int
    num_extra_outputs: int
    graph: Graph  # what this chain is a view of

    @property
    def class_name(self) -> str:
        return names.class_name(self.name)

    @property
    def in_features(self) -> int:
        return self.graph.features(self.graph.inputs[0])

    @property
    def out_features(self) -> int:
        return self.graph.features(self.graph.outputs[0])

    @property
    def params(self) -> list[tuple[Op, str, str, tuple[int, ...], str]]:
        return [(op, *p) for op in self.ops for p in op.params]

    def width(self, position: int) -> int:
        """Feature size of value ``position`` (0 = pipeline input)."""
        return self.ops[position].in_features if position < len(self.ops) else self.out_features


def build_pipeline(spec: SequentialSpec) -> Pipeline:
    return chain(build_graph(spec))


def chain(graph: Graph) -> Pipeline:
    """The planner's view of a graph: its nodes in order, views left out, each op reading the
    running value its predecessor wrote; extra inputs and outputs numbered by their order among
    the graph's inputs and outputs. Kernels are specialised on feature sizes, so every size must
    be fixed here."""
    if graph.symbolic:
        raise SpecError(
            f"pipeline '{graph.name}' has no op that fixes the feature size; add an op with a size "
            "(Linear, LayerNorm, RMSNorm, Bias) so kernels can be specialised",
            graph.location,
        )
    ops: list[Op] = []
    n_out = 0
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
    if not ops:
        raise SpecError(f"pipeline '{graph.name}' has only Identity ops; there is nothing to generate", graph.location)
    return Pipeline(graph.name, graph.file, graph.location, tuple(ops), len(graph.inputs) - 1,
                    len(graph.outputs) - 1, graph)
