"""The graph IR: a parsed spec as values and the nodes that produce and consume them.

``build_graph`` turns a ``SequentialSpec`` into a ``Graph``. Every basic op is a ``Node`` (``Linear``
expanded to BasicLinear + Bias, as in TE) reading and writing ``Value``s by index; a value knows
its feature size, which is a ``Sym`` where no op fixes it. Extra inputs and outputs are values
like any other: an ``AddExtraInput`` node reads the running value and a graph input, a
``MakeExtraOutput`` node's input is also a graph output (the value handed out), in order, so the public
names (``extra_input0``, ...) are the positions of those values among the graph's inputs and
outputs. Views (``Identity``; later ``Reshape``) are nodes too: the planner's chain view
(pipeline.py) passes them through. An op that reads several trailing dims as one row (a norm's
multi-dim normalized_shape) runs between views that flatten them and back (``around_rows``).

Sizes flow from op to op (``OpDef.fixed_in``, ``out_features``; a GLU halves); a size one op
fixes and its neighbour contradicts is a SpecError at the contradicting call.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from .errors import Location, SpecError
from .frontend import OpCall, SequentialSpec
from .ops import MAX_FEATURES, OPS, RESIDUAL, HeldRows, OpDef, basic_parts
from .ops.identity import around_rows
from .tensor_parallel import Localiser


@dataclass(frozen=True)
class Sym:
    """A feature size no op of the pipeline fixes: ``factor`` times the pipeline input's ``n``,
    or, with ``width`` named, times the width a Reshape whose last dim is -1 makes at run time
    (``reshapeK_width``, a variable of the generated module's forward)."""

    factor: Fraction = Fraction(1)
    width: str = ""  # "": the input's n; else the run-time width of a Reshape((..., -1))

    def __mul__(self, k: int) -> Sym:
        return Sym(self.factor * k, self.width)

    def __floordiv__(self, k: int) -> Sym:
        return Sym(self.factor / k, self.width)

    def __add__(self, other: Size) -> Sym:
        if other == 0:  # sums of widths start from 0
            return self
        if not isinstance(other, Sym) or other.width != self.width:
            raise TypeError("a fixed size plus a symbolic one has no meaning in a pipeline")
        return Sym(self.factor + other.factor, self.width)

    __radd__ = __add__

    def __str__(self) -> str:  # as plans show it: n, n / 2, 2 * n
        return self.expr("n", "/")

    @property
    def of_input(self) -> bool:
        """Whether the size is a multiple of the pipeline input's n (not a Reshape's run-time width)."""
        return not self.width

    def at(self, n: int) -> int:
        """The size when the pipeline input has ``n`` features (``n`` must make it whole)."""
        size = self.factor * n
        if size.denominator != 1:
            raise ValueError(f"{self} is not a whole number of features at n = {n}")
        return int(size)

    @property
    def divisor(self) -> int:
        """What ``n`` must be a multiple of for this size to be whole (2 after a GLU)."""
        return self.factor.denominator

    def expr(self, var: str, div: str) -> str:
        """This size as an integer expression in ``var`` (``div``: the language's integer
        division, ``//`` in Python, ``/`` in C), e.g. ``n``, ``2 * n``, ``n // 2``; a Reshape's
        run-time width in its own variable whatever ``var``."""
        p, q = self.factor.numerator, self.factor.denominator
        var = self.width or var
        scaled = var if p == 1 else f"{p} * {var}"
        return scaled if q == 1 else f"{scaled} {div} {q}"


Size = int | Sym


def size_at(size: Size, n: int | None) -> Size:
    """``size`` with the pipeline's ``n`` substituted (None: as it is; a Reshape's run-time
    width stays symbolic)."""
    return size.at(n) if isinstance(size, Sym) and size.of_input and n is not None else size


def size_expr(size: Size, var: str, div: str) -> str:
    """A size as an expression: an int as its digits, a ``Sym`` in ``var``."""
    return size.expr(var, div) if isinstance(size, Sym) else str(size)


@dataclass(frozen=True)
class Value:
    """A tensor of the pipeline, [rows, features]."""

    index: int
    features: Size
    producer: int | None  # the node that writes it; None for a graph input


@dataclass(frozen=True)
class Node:
    """One basic op: reads ``inputs`` (the running value, then any extra input), writes
    ``outputs`` (a view writes nothing new: its output is its input)."""

    index: int
    opdef: OpDef
    args: dict
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    # the spec-level op's path in the eager module, its state_dict prefix: its position in the
    # Sequential ("3"), inside a Residual its position there too ("0.1": the first Residual's second op)
    module_index: str
    module_name: str  # the spec-level op as spelled ("Linear" for its BasicLinear and Bias; nn.Linear's too)
    location: Location
    module_call: str = ""  # the spec-level op's call, as the spec would write it: "Linear(4096, 28672)"
    residual: str = ""  # a Residual's tee and add: the Residual's path (their module_index too)
    part: str = ""  # its part of the spec-level op, which names its parameters: "fc1" of a te.LayerNormMLP
    spec_op: str = ""  # the spec-level op's registry name ("LayerNormMLP"; "Residual" for a Residual's tee and add)
    held: HeldRows | None = None  # how the part holds its parameters where not one tensor each (TE's QKV layouts)


@dataclass(frozen=True)
class Graph:
    name: str
    file: str
    location: Location
    values: tuple[Value, ...]
    nodes: tuple[Node, ...]  # in execution order
    inputs: tuple[int, ...]  # the pipeline input, then the extra inputs in order
    outputs: tuple[int, ...]  # the pipeline output, then the extra outputs in order
    # (value, graph input): a node's output also written into the extra input it read
    # (OpDef.writes_back: TE's AddExtraInput(in_place=True))
    written_back: tuple[tuple[int, int], ...] = ()

    def features(self, value: int) -> Size:
        return self.values[value].features

    @property
    def symbolic(self) -> bool:
        """Whether some feature size is not fixed by any op."""
        return any(isinstance(v.features, Sym) for v in self.values)


# OpDef.fixed_out's "known only at run time": a Reshape whose last dim is -1 (torch infers it from
# the elements it receives); the sizes after it are Syms of that width until an op fixes one
RUN_TIME = -1


def _fix_run_time_width(sizes: list, i: int, want: int, call: OpCall) -> None:
    """An op fixes ``want`` input features where a Reshape's run-time width reached it: that
    width is fixed at the spec's size, and every size made from it with it (each a power-of-two
    multiple of ``want``: only GLUs, halving, come between)."""
    width, scale = sizes[i].width, want / sizes[i].factor  # sizes[i] = factor * width
    made = {j: size.factor * scale for j, size in enumerate(sizes) if isinstance(size, Sym) and size.width == width}
    widest = max(made.values())
    if widest > MAX_FEATURES:
        raise SpecError(
            f"{call.op}() expects {want} input features, so the Reshape before it with a -1 last dim would make "
            f"{widest}, more than fusegen's bound of {MAX_FEATURES} (2**24); give the pipeline fewer GLUs or "
            "smaller sizes", call.location)
    for j, size in made.items():
        sizes[j] = int(size)


def _infer_sizes(spec: SequentialSpec, ops: list[tuple[OpDef, dict, OpCall]], hints: list[str]) -> list[Size]:
    """Feature size of the running value before each op (and after the last), checked against
    every size an op fixes; a ``Sym`` where no op fixes one (``hints``: each op's name stem in
    generated code, which names a Reshape's run-time width)."""
    sizes: list[Size | None] = [None] * (len(ops) + 1)
    fixed_by: list[OpCall | None] = [None] * (len(ops) + 1)
    for i, (op, args, call) in enumerate(ops):
        want = op.fixed_in(args)
        if want is not None:
            if isinstance(sizes[i], Sym) and not sizes[i].of_input:  # a Reshape's run-time width reaches it
                _fix_run_time_width(sizes, i, want, call)
            if sizes[i] is not None and sizes[i] != want:
                before = fixed_by[i]
                raise SpecError(
                    f"{call.op}() expects {want} input features, but the op before it "
                    f"({before.op} at line {before.location.line}) produces {sizes[i]}; "
                    "make the feature sizes of neighbouring ops agree",
                    call.location,
                )
            sizes[i], fixed_by[i] = want, call
        if op.reshape is not None and isinstance(sizes[i], Sym) and not sizes[i].of_input:
            raise SpecError(
                f"{call.op}() reshapes {sizes[i]} features, the width an earlier Reshape with a -1 last dim makes "
                "at run time, which fusegen does not support yet; give one of the two Reshapes its last dim",
                call.location)
        if op.fixed_out(args) == RUN_TIME:  # the width torch infers at run time
            sizes[i + 1], fixed_by[i + 1] = Sym(width=f"{hints[i]}_width"), call
        elif sizes[i] is not None:
            if op.halves_width and isinstance(sizes[i], int) and sizes[i] % 2:
                raise SpecError(
                    f"{call.op}() splits its input into two halves, but it receives {sizes[i]} "
                    "features (odd); give the op before it an even output size",
                    call.location,
                )
            sizes[i + 1], fixed_by[i + 1] = op.out_features(args, sizes[i]), call
        elif op.fixed_out(args) is not None:  # a Reshape: its output size whatever its input's
            sizes[i + 1], fixed_by[i + 1] = op.fixed_out(args), call
    # Ops before the first one that fixes a size take it from their successor (not through an op
    # whose output size does not depend on its input's: a Reshape).
    for i in range(len(ops) - 1, -1, -1):
        op, args, call = ops[i]
        if sizes[i] is None and sizes[i + 1] is not None and op.fixed_out(args) is None:
            sizes[i] = sizes[i + 1] * 2 if op.halves_width else sizes[i + 1]
            if sizes[i] > MAX_FEATURES:  # GLUs double the size backwards; the registry bounds only given sizes
                raise SpecError(
                    f"{call.op}() would need {sizes[i]} input features to produce the {sizes[i + 1]} that "
                    f"follow it, more than fusegen's bound of {MAX_FEATURES} (2**24); give the pipeline "
                    "fewer GLUs or smaller sizes",
                    call.location,
                )
    if sizes[0] is None:  # no op fixes the input's size: sizes up to the first one fixed are multiples of n
        sizes[0] = Sym()
        for i, (op, args, _) in enumerate(ops):
            if sizes[i + 1] is None:
                sizes[i + 1] = op.out_features(args, sizes[i])
    for i, (op, args, call) in enumerate(ops):  # every fixed size known, given or passed back
        problem = op.check_sizes(args, sizes[i], sizes[i + 1])
        if problem:
            raise SpecError(f"{op.describe(args)} {problem}", call.location)
        k = op.interleave(args)
        if k is not None and isinstance(sizes[i], int) and sizes[i] % (2 * k):
            raise SpecError(
                f"{call.op}() with glu_interleave_size={k} reads blocks [a({k}), b({k}), ...], but it receives "
                f"{sizes[i]} features, not a multiple of {2 * k}; give it a multiple of {2 * k}",
                call.location,
            )
    return sizes  # type: ignore[return-value]


@dataclass(frozen=True)
class _Expanded:
    """One basic op of the spec, Residuals opened: a Residual is its ops between a tee (OPEN, a
    MakeExtraOutput that keeps the Residual's input) and an add (CLOSE, an AddExtraInput of it)."""

    op: OpDef
    args: dict
    call: OpCall  # the spec-level call (the Residual's, for its tee and add)
    path: str  # module_index
    residual: str = ""  # OPEN or CLOSE a Residual's tee and add
    part: str = ""  # Node.part
    branch: str = ""  # the Residual's id (Node.residual): its path; in a TE layer's expansion "<path> <name>"
    held: HeldRows | None = None  # Node.held


OPEN, CLOSE = "open", "close"


def _expand(calls: tuple[OpCall, ...], localised: Localiser, prefix: str = "") -> list[_Expanded]:
    """The spec's basic ops in the order they run, each with its path in the eager module, as a
    rank of a tensor-parallel group runs them (``localised``, carried across the calls)."""
    expanded = []
    for position, call in enumerate(calls):
        path = f"{prefix}{position}"
        if call.op == RESIDUAL:
            plain = {"in_place": False}
            expanded.append(_Expanded(OPS["MakeExtraOutput"], plain, call, path, OPEN, branch=path))
            expanded += _expand(call.inner, localised, f"{path}.")
            expanded.append(_Expanded(OPS["AddExtraInput"], plain, call, path, CLOSE, branch=path))
            continue
        spans = OPS[call.op].residuals(call.args)  # a TE layer's residual branches, by position in its expansion
        for position, group in enumerate(localised(basic_parts(call.op, call.args), call)):
            for first, _, name in spans:
                if first == position:
                    expanded.append(_Expanded(OPS["MakeExtraOutput"], {"in_place": False}, call, path, OPEN,
                                              f"{name}_residual", f"{path} {name}"))
            expanded += [_Expanded(op, args, call, path, part=part, held=held)
                         for basic, basic_args, part, held in group for op, args in around_rows(basic, basic_args)]
            for _, end, name in spans:
                if end == position + 1:
                    expanded.append(_Expanded(OPS["AddExtraInput"], {"in_place": False}, call, path, CLOSE,
                                              f"{name}_residual", f"{path} {name}"))
    return expanded


def _check_residuals(expanded: list[_Expanded], sizes: list[Size]) -> None:
    """A Residual adds its ops' output to its input: they must give back the width they receive."""
    opened: dict[str, int] = {}
    for i, step in enumerate(expanded):
        if step.residual == OPEN:
            opened[step.branch] = i
        elif step.residual == CLOSE and sizes[i] != sizes[opened[step.branch]]:
            raise SpecError(
                f"Residual(...) adds its ops' output to its input, so they must give back the "
                f"{sizes[opened[step.branch]]} features they receive, but they make {sizes[i]}; make the last "
                "op's output size the Residual's input size", step.call.location)


def _module_call(call: OpCall) -> str:
    """A spec-level op's call as the generated module's child prints it (a Residual's children
    print its ops)."""
    if call.op == RESIDUAL:
        return f"{RESIDUAL}()"
    return OPS[call.op].describe(call.args, name=OPS[call.op].attribute)


def build_graph(spec: SequentialSpec, tensor_parallel: int = 1) -> Graph:
    """The graph of ``spec`` as one rank of a tensor-parallel group of ``tensor_parallel`` runs it."""
    if not spec.calls:
        raise SpecError(f"pipeline '{spec.name}' is empty; give Sequential at least one op", spec.location)
    expanded = _expand(spec.calls, Localiser(tensor_parallel))
    sizes = _infer_sizes(spec, [(step.op, step.args, step.call) for step in expanded],
                         [f"{step.call.op.lower() if step.residual else OPS[step.call.op].attribute.lower()}"
                          f"{step.path.replace('.', '_')}" for step in expanded])
    _check_residuals(expanded, sizes)
    values = [Value(0, sizes[0], None)]
    inputs, extra_outputs, nodes, written_back = [0], [], [], []
    running = 0
    kept: dict[str, int] = {}  # an open Residual's path: the value its tee keeps

    def new_value(features: Size, producer: int | None) -> int:
        values.append(Value(len(values), features, producer))
        return len(values) - 1

    for i, step in enumerate(expanded):
        op, args, call = step.op, step.args, step.call
        reads = [running]
        if step.residual == CLOSE:  # the add reads the value the tee kept: internal, no graph input
            reads.append(kept.pop(step.branch))
        else:
            for _ in range(op.extra_inputs):  # an extra input: a graph input of the running value's width
                reads.append(new_value(sizes[i], None))
                inputs.append(reads[-1])
        out = running if op.view else new_value(sizes[i + 1], len(nodes))
        writes = (out,)
        if step.residual == OPEN:  # the tee's second output: the Residual's input, kept for its add
            kept[step.branch] = new_value(sizes[i], len(nodes))
            writes = (out, kept[step.branch])
        else:
            extra_outputs += [running] * op.extra_outputs  # an extra output hands out the value it reads
        if op.writes_back(args):
            written_back.append((out, reads[1]))
        spelled = RESIDUAL if step.residual else OPS[call.op].attribute
        nodes.append(Node(len(nodes), op, args, tuple(reads), writes, step.path, spelled, call.location,
                          _module_call(call), step.branch if step.residual else "", step.part, call.op,
                          step.held))
        running = out
    return Graph(spec.name, spec.file, spec.location, tuple(values), tuple(nodes), tuple(inputs),
                 (running, *extra_outputs), tuple(written_back))
