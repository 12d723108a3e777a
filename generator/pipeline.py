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
from dataclasses import dataclass, replace

from . import names
from .errors import Location, SpecError
from .frontend import SequentialSpec
from .ir import Graph, Size, Sym, build_graph, size_at
from .ops import OPS, HeldRows, OpDef, part_attribute
from .ops.attention import reads_rotary_table
from .ops.collectives import KINDS as COLLECTIVES
from .tensor_parallel import spec_size
from .values import (HOST_INT, HOST_OBJECT, X_DTYPE, Role, Value, activation_name, extra_input_name,
                     extra_output_name, lead_name, module_name, param_name, residual_name, seed_name)


@dataclass(frozen=True)
class Op:
    """One basic op of a pipeline: ``index`` is its position in the chain (the order ops run
    in), ``input`` and ``output`` the ids of the values it reads and writes (values.py)."""

    index: int
    opdef: OpDef
    args: dict
    in_features: Size
    out_features: Size
    module_index: str  # the spec-level op's path in the eager module, the state_dict prefix: "3", "0.1" (ir.Node)
    module_name: str  # the spec-level op ("Linear" for its BasicLinear and Bias)
    location: Location
    extra_input: int | None = None  # index among the pipeline's extra inputs
    extra_output: int | None = None  # index among the pipeline's extra outputs
    # A hidden extra output (numbered after the public ones): the value goes into this extra
    # input of the caller's after the forward (OpDef.writes_back)
    writes_back_to: int | None = None
    number: str = ""  # how plans, code and kernels' launch comments cite it (spec_numbers)
    input: int = 0  # the running value it reads
    output: int = 0  # the value it writes
    extra_in: int | None = None  # the value of its extra input
    extra_out: int | None = None  # the value of its extra output
    param_ids: tuple[tuple[str, int], ...] = ()  # (attribute, value) of each parameter
    seed: int | None = None  # a random op's key, drawn once per call
    module_object: int | None = None  # a user module op's module, handed in by the generated module
    lead: int | None = None  # ... and the leading dims it runs at
    # the call's packed sequences, for an op that reads them (OpDef.reads_sequences): the
    # pipeline's int32 offsets cu_seqlens [batch + 1] on x's device and its host int max_seqlen
    cu_seqlens: int | None = None
    max_seqlen: int | None = None
    rotary_table: int | None = None  # TE's per-call rotary table where it reads one (``reads_rotary_table``)
    # a Residual's tee (its extra_out) and add (its extra_in): the Residual's path; the two are
    # joined by one internal value, neither an extra input nor an extra output of the pipeline
    residual: str = ""
    node: int = 0  # the graph node it runs (a hidden tee: its add's), the spec's order of ops
    part: str = ""  # its part of the spec-level op ("fc1" of a te.LayerNormMLP: ir.Node.part)
    spec_op: str = ""  # the spec-level op's registry name (ir.Node.spec_op)
    held_rows: HeldRows | None = None  # how it holds its parameters where not one tensor each (ir.Node.held)

    def param(self, attr: str) -> int:
        """The value of parameter ``attr``."""
        return dict(self.param_ids)[attr]

    @property
    def kind(self) -> str:
        return self.opdef.kind

    @property
    def tag(self) -> str:
        return self.opdef.tag(self.args)

    @property
    def hint(self) -> str:
        """A readable, unique stem for names in generated code, e.g. ``linear1``."""
        part = self.part.split(".", 1)[1] if self.part.count(".") > 1 else self.part  # a TE layer's attention's
        part = part.replace(".", "_").strip("_")  # a TE submodule's part: "proj." -> proj (short: 100 columns)
        return self.module_hint + (f"_{part}" if part else "")

    @property
    def module_hint(self) -> str:
        """The stem of its spec-level op, ``layernormmlp0``: its parameters' names start with it."""
        stem = getattr(OPS.get(self.spec_op), "hint_stem", "") or self.module_name.lower()
        return f"{stem}{self.module_index.replace('.', '_')}"

    @property
    def params(self) -> list[tuple[str, str, tuple[int, ...], str]]:
        """(attribute, state_dict key, shape, init) for each parameter: the attribute is the basic
        op's ("weight", as its stage asks for it), the key the spec-level op's (``0.fc1_weight``
        of a te.LayerNormMLP: ``holder_attribute``)."""
        return [
            (p.name, f"{self.module_index}.{self.holder_attribute(p.name)}", p.shape(self.args), p.init(self.args))
            for p in self.opdef.params
        ]

    def holder_attribute(self, attr: str) -> str:
        """Parameter ``attr``'s attribute on the generated module's child that holds it (ops.part_attribute)."""
        return part_attribute(self.part, attr)

    def describe(self, kernel: bool = False) -> str:
        """The basic op as a spec would write it (OpDef.describe); a Residual's tee and add, which
        the spec does not write, as what they do there (a kernel names them by their op)."""
        if self.residual and not kernel:
            return "Residual: keeps x" if self.opdef.extra_outputs else "Residual: x + ops(x)"
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
    values: tuple[Value, ...] = ()  # every value the pipeline's code handles, by id (values.py)
    training: int | None = None  # the training FLAG, where the forward depends on it (a Dropout)
    input_width: int | None = None  # a size-generic pipeline's input width n (a backward's reshape reads it)
    # (cu_seqlens, max_seqlen): the packed sequences, made once where an op reads them (reads_sequences)
    sequences: tuple[int, int] | None = None
    # how x is read where an op reads the sequences (TE's qkv_format: "sbhd", "bshd", "thd"), or None
    # for fusegen's own call forms; "sbhd" makes the module run batch-major rows inside (pipeline.py.j2)
    sequence_format: str | None = None
    rotary_table: int | None = None  # TE's forward(rotary_pos_emb=...), float32 [max_s, d] ([0, d]: None)
    fp8: object = None  # config.Fp8Build: its FP8 recipes and rows ([tool.fusegen] fp8: build.with_fp8)
    # the tensor-parallel size it is built for (generator/tensor_parallel.py), and the GROUP value
    # its collectives run on (None: it has none)
    tensor_parallel: int = 1
    group: int | None = None
    # where the pipeline's table builds it for several sizes: the spec's name, which this size's pipeline
    # (named "<it>_tp<size>") is one of; its table's settings are that name's
    variant_of: str = ""

    @property
    def table_name(self) -> str:
        """The name its [tool.fusegen.pipelines.<name>] table has."""
        return self.variant_of or self.name

    def value(self, id: int) -> Value:
        return self.values[id]

    @property
    def output(self) -> int:
        """The pipeline output's value (the chain's last; x where no op runs)."""
        return self.ops[-1].output if self.ops else 0

    @property
    def extra_input_values(self) -> tuple[int, ...]:
        """The extra inputs' values in order (``extra_input0``, ...)."""
        return self.graph.inputs[1:]

    def features(self, value: int, n: int | None = None) -> Size:
        """Feature size of activation ``value``; at input size ``n`` if given."""
        return size_at(self.values[value].features, n)

    @property
    def residual_values(self) -> tuple[int, ...]:
        """The values Residuals' tees keep for their adds (internal: no extra input or output)."""
        return tuple(op.extra_out for op in self.ops if op.residual and op.extra_out is not None)

    def chain_order(self, value: int) -> int:
        """Where a running value comes in the chain (0: x; k: op k-1's output, or the value op
        k-1, a Residual's tee, keeps): saved values are kept in this order."""
        return 0 if value == 0 else next(op.index + 1 for op in self.ops if value in (op.output, op.extra_out))

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
        """Feature size at chain position ``position`` (op ``position``'s input; 0 = the pipeline
        input, ``len(ops)`` its output); at input size ``n`` if given."""
        size = self.ops[position].in_features if position < len(self.ops) else self.out_features
        return size_at(size, n)


def build_pipeline(spec: SequentialSpec, specialise: tuple[int, ...] = (),
                   tensor_parallel: int | None = None) -> Pipeline:
    """``tensor_parallel``: the group size to build for; None: the one the spec's tp_size fixes, else 1."""
    size = tensor_parallel or spec_size(spec.calls) or 1
    return chain(build_graph(spec, size), specialise, size)


def chain(graph: Graph, specialise: tuple[int, ...] = (), tensor_parallel: int = 1) -> Pipeline:
    """The planner's view of a graph: its nodes in order, views left out, each op reading the
    running value its predecessor wrote; extra inputs and outputs numbered by their order among
    the graph's inputs and outputs (a Residual's tee and add have neither: ir.build_graph joins
    them by a value of their own)."""
    ops: list[Op] = []
    n_out, n_hidden = 0, len(graph.outputs) - 1
    for node in graph.nodes:
        if node.opdef.view:
            continue
        public = not node.residual
        extra_input = graph.inputs.index(node.inputs[1]) - 1 if node.opdef.extra_inputs and public else None
        ops.append(Op(
            index=len(ops), opdef=node.opdef, args=node.args, in_features=graph.features(node.inputs[0]),
            out_features=graph.features(node.outputs[0]), module_index=node.module_index,
            module_name=node.module_name, location=node.location, extra_input=extra_input,
            extra_output=n_out if node.opdef.extra_outputs and public else None, residual=node.residual,
            node=node.index, part=node.part, spec_op=node.spec_op, held_rows=node.held,
        ))
        n_out += node.opdef.extra_outputs if public else 0
        if node.opdef.writes_back(node.args):  # its value handed out by a tee the spec does not show
            size = graph.features(node.outputs[0])
            ops.append(Op(
                index=len(ops), opdef=OPS["MakeExtraOutput"], args={"in_place": False}, in_features=size,
                out_features=size, module_index=node.module_index, module_name=node.module_name,
                location=node.location, extra_output=n_hidden, writes_back_to=extra_input, node=node.index,
            ))
            n_hidden += 1
    ops = [replace(op, number=number) for op, number in zip(ops, names.spec_numbers(ops))]
    ops, values, training, width, sequences, group = _values(graph, ops)
    return Pipeline(graph.name, graph.file, graph.location, tuple(ops), len(graph.inputs) - 1,
                    len(graph.outputs) - 1, graph, tuple(specialise), values, training, width, sequences,
                    _sequence_format(ops), next((op.rotary_table for op in ops if op.rotary_table), None),
                    tensor_parallel=tensor_parallel, group=group)


def _sequence_format(ops: list[Op]) -> str | None:
    """The one way x is read by the ops that read the sequences (their qkv_format): the module's
    forward makes one set of sequences from x, so ops that read x differently are a spec error."""
    readers = [op for op in ops if op.opdef.reads_sequences]
    formats = {op.args.get("qkv_format") for op in readers}
    if len(formats) > 1:
        listed = "; ".join(f"op {op.module_index} at line {op.location.line}: {op.args.get('qkv_format')!r}"
                           for op in readers)
        raise SpecError(f"the attention ops of one pipeline must read x in one format (qkv_format), got {listed}; "
                        "give them all the same qkv_format, or split the pipeline where the format changes",
                        readers[1].location)
    return formats.pop() if formats else None


def _values(graph: Graph, ops: list[Op]) -> tuple[list[Op], tuple[Value, ...], int | None, int | None,
                                                  tuple[int, int] | None, int | None]:
    """The pipeline's value table and each op's value ids. The graph numbers the input, each
    op's output and the extra inputs (ir.build_graph); the rest get ids after the graph's: the
    value a hidden tee writes (it has no graph node), extra outputs, parameters, random keys, the
    training flag, the packed sequences, user modules and their leading dims, a size-generic
    pipeline's input width. A Residual's value is the graph's too: its tee writes it, its add
    reads it."""
    table: dict[int, Value] = {}
    next_id = len(graph.values)

    def add(role: Role, dtype: str, name: str, features=None, id: int | None = None) -> int:
        nonlocal next_id
        if id is None:
            id, next_id = next_id, next_id + 1
        table[id] = Value(id, role, dtype, name, features)
        return id

    add(Role.ACTIVATION, X_DTYPE, "x", graph.features(0), id=0)
    sequences = rotary_table = None
    graph_nodes = iter(node for node in graph.nodes if not node.opdef.view)
    with_ids, running = [], 0
    for op in ops:
        node = None if op.writes_back_to is not None else next(graph_nodes)  # a hidden tee has none
        reader = ops[op.index + 1] if op.index + 1 < len(ops) else None
        output = add(Role.ACTIVATION, X_DTYPE, activation_name(op, reader), op.out_features,
                     id=None if node is None else node.outputs[0])
        fields = dict(input=running, output=output)
        if op.residual and op.opdef.extra_inputs:  # a Residual's add reads the value its tee kept
            fields["extra_in"] = node.inputs[1]
        if op.residual and op.opdef.extra_outputs:  # a Residual's tee keeps its input for the add
            fields["extra_out"] = add(Role.ACTIVATION, X_DTYPE, residual_name(op), op.in_features, id=node.outputs[1])
        if op.extra_input is not None:
            per_row = op.opdef.operand is not None and op.opdef.operand.broadcast == "row"
            fields["extra_in"] = add(Role.ROWWISE if per_row else Role.ACTIVATION, X_DTYPE, extra_input_name(op),
                                     1 if per_row else op.in_features, id=node.inputs[1])
        if op.extra_output is not None:
            fields["extra_out"] = add(Role.ACTIVATION, X_DTYPE, extra_output_name(op), op.in_features)
        fields["param_ids"] = tuple((attr, add(Role.PARAMETER, "param", param_name(op, attr)))
                                    for attr, *_ in op.params)
        if op.opdef.operand is not None and op.opdef.operand.source == "random":
            fields["seed"] = add(Role.METADATA, "int64", seed_name(op))
        if op.opdef.reads_sequences:  # one pair for the pipeline, made at the first op that reads it
            sequences = sequences or (add(Role.METADATA, "int32", "cu_seqlens"),
                                      add(Role.METADATA, HOST_INT, "max_seqlen"))
            fields["cu_seqlens"], fields["max_seqlen"] = sequences
        if reads_rotary_table(op.opdef, op.args):  # one table a pipeline, as TE's forward takes one
            rotary_table = fields["rotary_table"] = rotary_table or add(Role.METADATA, "float32", "rotary_table")
        if op.opdef.user_module:
            fields["module_object"] = add(Role.OBJECT, "object", module_name(op))
            fields["lead"] = add(Role.METADATA, "object", lead_name(op))
        with_ids.append(replace(op, **fields))
        running = output
    # the forward depends on the training mode: a random operand (Dropout), attention's dropout
    random = any(op.seed is not None or op.opdef.uses_training(op.args) for op in with_ids)
    training = add(Role.FLAG, "bool", "training") if random else None
    width = add(Role.METADATA, "int64", "n") if isinstance(graph.features(0), Sym) else None
    # the collectives' group: the module's, given at construction (tensor_parallel.py)
    group = add(Role.GROUP, HOST_OBJECT, "tensor_parallel_group") if any(
        op.opdef.kind in COLLECTIVES for op in with_ids) else None
    assert sorted(table) == list(range(len(table))), "value ids are the table's positions"
    return with_ids, tuple(table[id] for id in sorted(table)), training, width, sequences, group
