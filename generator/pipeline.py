"""From a parsed spec to a typed pipeline: basic ops with feature sizes, parameters and channels.

``Linear`` expands to BasicLinear + Bias (as in TE); ``Identity`` is dropped (it would only break
fusion windows, catalog 6.2 item 13). Feature sizes flow from op to op; a size one op fixes and
its neighbour contradicts is a SpecError at the contradicting call.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import names
from .ops import MAX_FEATURES, REQUIRED, OpDef, basic_ops
from .errors import Location, SpecError
from .frontend import OpCall, SequentialSpec


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

    def describe(self) -> str:
        """The op as a spec would write it: required arguments by position, others if not default."""
        shown = []
        for a in self.opdef.args:
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

    @property
    def class_name(self) -> str:
        return names.class_name(self.name)

    @property
    def in_features(self) -> int:
        return self.ops[0].in_features

    @property
    def out_features(self) -> int:
        return self.ops[-1].out_features

    @property
    def params(self) -> list[tuple[Op, str, str, tuple[int, ...], str]]:
        return [(op, *p) for op in self.ops for p in op.params]

    def width(self, position: int) -> int:
        """Feature size of value ``position`` (0 = pipeline input)."""
        return self.ops[position].in_features if position < len(self.ops) else self.out_features


def _infer_features(spec: SequentialSpec, expanded: list[tuple[OpDef, dict, OpCall]]) -> list[int]:
    """Input feature size of each basic op, checked against every size an op fixes."""
    sizes: list[int | None] = [None] * (len(expanded) + 1)
    fixed_by: list[OpCall | None] = [None] * (len(expanded) + 1)
    for i, (op, args, call) in enumerate(expanded):
        want = op.fixed_in(args)
        if want is not None:
            if sizes[i] is not None and sizes[i] != want:
                before = fixed_by[i]
                raise SpecError(
                    f"{call.op}() expects {want} input features, but the op before it "
                    f"({before.op} at line {before.location.line}) produces {sizes[i]}; "
                    "make the feature sizes of neighbouring ops agree",
                    call.location,
                )
            sizes[i], fixed_by[i] = want, call
        if sizes[i] is not None:
            if op.kind == "glu" and sizes[i] % 2:
                raise SpecError(
                    f"{call.op}() splits its input into two halves, but it receives {sizes[i]} "
                    "features (odd); give the op before it an even output size",
                    call.location,
                )
            sizes[i + 1], fixed_by[i + 1] = op.out_features(args, sizes[i]), call
    # Ops before the first one that fixes a size take it from their successor.
    for i in range(len(expanded) - 1, -1, -1):
        if sizes[i] is None and sizes[i + 1] is not None:
            op, args, call = expanded[i]
            sizes[i] = sizes[i + 1] * 2 if op.kind == "glu" else sizes[i + 1]
            if sizes[i] > MAX_FEATURES:  # GLUs double the size backwards; the registry bounds only given sizes
                raise SpecError(
                    f"{call.op}() would need {sizes[i]} input features to produce the {sizes[i + 1]} that "
                    f"follow it, more than fusegen's bound of {MAX_FEATURES} (2**24); give the pipeline "
                    "fewer GLUs or smaller sizes",
                    call.location,
                )
    if sizes[0] is None:
        raise SpecError(
            f"pipeline '{spec.name}' has no op that fixes the feature size; add an op with a size "
            "(Linear, LayerNorm, RMSNorm, Bias) so kernels can be specialised",
            spec.location,
        )
    return sizes  # type: ignore[return-value]


def build_pipeline(spec: SequentialSpec) -> Pipeline:
    if not spec.calls:
        raise SpecError(f"pipeline '{spec.name}' is empty; give Sequential at least one op", spec.location)
    expanded: list[tuple[OpDef, dict, OpCall, int]] = []
    for module_index, call in enumerate(spec.calls):
        for op, args in basic_ops(call.op, call.args):
            expanded.append((op, args, call, module_index))
    sizes = _infer_features(spec, [(op, args, call) for op, args, call, _ in expanded])
    ops: list[Op] = []
    n_in = n_out = 0
    for i, (op, args, call, module_index) in enumerate(expanded):
        if op.kind == "identity":
            continue
        ops.append(Op(
            index=len(ops), opdef=op, args=args, in_features=sizes[i], out_features=sizes[i + 1],
            module_index=module_index, module_name=call.op, location=call.location,
            extra_input=n_in if op.extra_inputs else None,
            extra_output=n_out if op.extra_outputs else None,
        ))
        n_in += op.extra_inputs
        n_out += op.extra_outputs
    if not ops:
        raise SpecError(f"pipeline '{spec.name}' has only Identity ops; there is nothing to generate", spec.location)
    return Pipeline(spec.name, spec.file, spec.location, tuple(ops), n_in, n_out)


