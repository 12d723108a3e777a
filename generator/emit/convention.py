"""The generated calling convention, derived from the roles of a pipeline's free values.

A pipeline's free values are what its code takes rather than computes: x, the extra inputs, the
parameters, the training flag, the packed sequences where an op reads them (``cu_seqlens``,
``max_seqlen``: made by the module's forward from its call form), each user module and the leading
dims it runs at, the tensor-parallel group (values.py). In that order they are the autograd
Function's inputs (and the no-grad forward's, and a segment Function's where it reads them); each
role says how the module's ``forward`` passes the value, whether the Function returns a grad for
it, its type in the no-grad custom op's schema, and how the ``forward`` checks it before the call
(``check_lines``). A new kind of input is one role here and its rendering in ``argument`` (what is
passed and checked), ``TENSOR_ROLES`` (whether it has a grad) and ``Argument.schema``. Every
module's forward also takes the packed-sequence call form (``forward_parameters``), and ignores it
where no op reads the sequences (``ignored_sequences_lines``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..ir import Size, size_expr
from ..source_text import comment_text
from ..tensor_parallel import sequence_ranks
from ..values import Role, Value, module_name
from .held import fresh_parameters, held_parameters

# the roles of tensors with grads (the Function returns None for the others, which a custom op's schema has no tensor for)
TENSOR_ROLES = (Role.ACTIVATION, Role.ROWWISE, Role.PARAMETER)
# the roles of the tensors the caller hands the module (a CUDA graph is captured per their shapes)
CALLER_ROLES = (Role.ACTIVATION, Role.ROWWISE)
# the roles checked before the others: the tensors the caller hands must have their dtype and device
CHECKED_FIRST = (Role.PARAMETER,)


@dataclass(frozen=True)
class Argument:
    """One free value as the generated code takes it."""

    value: int
    role: Role
    name: str  # the Function's, the no-grad forward's and (x, extra inputs) the module forward's parameter
    passed: str  # what the module's forward passes for it (its ``args``)
    line: str  # the args line it shares with the arguments of the same key (parameters; a module and its dims)
    comment: str = ""  # the line's comment
    # the module forward's lines that check it before the call, which arguments of the same ``line``
    # share (the parameters' one check_parameters); None: nothing to check (a flag, an object, metadata)
    check: tuple[str, ...] | None = None
    checked_by: str = ""  # the runtime's function its check calls, which the module imports
    typed: str = ""  # its type in a custom op's schema where its role does not say (the sequences')
    # a tensor the module's forward makes anew each call (the sequences' offsets): a CUDA graph
    # copies it into its buffers as it does the caller's tensors, never reads it where it was
    per_call: bool = False
    compiled_per_call: bool = False  # made anew under torch.compile (TE's joined row blocks): copied in there

    @property
    def tensor(self) -> bool:
        return self.role in TENSOR_ROLES

    @property
    def schema(self) -> str:
        """Its type in a custom op's schema."""
        if self.typed or self.role is Role.FLAG:
            return self.typed or "bool"
        assert self.tensor, f"{self.name}: a {self.role.value} value has no type in a custom op's schema"
        return "Tensor"


def free_values(pipeline) -> list[int]:
    """The values the pipeline's code takes, in the Function's order."""
    p = pipeline
    modules = [value for op in p.ops if op.module_object is not None for value in (op.module_object, op.lead)]
    return ([0, *p.extra_input_values, *(value for op in p.ops for _, value in op.param_ids)]
            + ([p.training] if p.training is not None else []) + list(p.sequences or ())
            + ([p.rotary_table] if p.rotary_table is not None else []) + modules + ([p.group] if p.group else []))


@dataclass(frozen=True)
class ModuleForward:
    """What the module's forward renders its arguments' passing and checks by."""

    module: str  # the module's class name, which a failed check's error names
    leads: dict[int, str]  # the leading dims' name at each op's input (emit.leading_dims)
    reshapes: bool  # whether any op changes the leading dims (lines of its own compute them, after x's check)
    copied: frozenset[int] = frozenset()  # extra inputs passed as a copy (see ``arguments``)
    generic: bool = False  # x of any width n, taken at run time
    any_shape: bool = False  # x of any shape, 0-D included (takes_any_shape)
    divisor: int = 1  # what a size-generic x's width must be a multiple of
    in_features: Size = 0  # a fixed-size x's width
    like: str = "x"  # the tensor whose dtype and device the inputs must have: the first parameter, or x
    parameters_check: str = ""  # the parameters' one check line
    sequences: tuple[int, int] | None = None  # (cu_seqlens, max_seqlen) where an op reads them
    graphs: bool = False  # the module replays CUDA graphs (emit.replays_graphs)
    sequence_format: str | None = None  # how x is read (TE's qkv_format), None: fusegen's call forms
    te_masks: tuple[str, ...] = ()  # a TE attention module's masks: the module takes TE's forward keywords
    fresh: frozenset[int] = frozenset()  # parameters new each call, copied in as x by graphs (held.fresh_parameters)
    fresh_compiled: frozenset[int] = frozenset()  # under torch.compile
    rotary_table: int | None = None  # TE's per-call rotary table, where an attention op reads it
    head_dims: tuple[int, ...] = ()  # the head sizes of the attention ops that read it
    sequence_ranks: int = 1  # the ranks whose tokens the sequences span (tensor_parallel.sequence_ranks)

    @property
    def like_is(self) -> str:
        """check_input's like_is argument: "" for the parameters (its default), else x's."""
        return "" if self.like != "x" else ', like_is="x is"'


def takes_any_shape(pipeline) -> bool:
    """Whether x may have any shape, 0-D included, as TE's elementwise ops take: a size-generic
    pipeline in which every value is as wide as x (no GLU halves it). Its results before any
    Reshape have x's shape."""
    return pipeline.generic and all(value.features == pipeline.in_features for value in pipeline.values
                                    if value.role is Role.ACTIVATION)


def _tuple_literal(items) -> str:
    """A tuple literal of the given expressions: (a, b), (a,)."""
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _module_forward(pipeline, leads: dict[int, str], copied: set[int], lead_lines, graphs: bool) -> ModuleForward:
    """What the pipeline's module forward renders its arguments by."""
    p = pipeline
    # the tensors the module holds (TE's row blocks, not yet joined: held.py)
    held = held_parameters(p)
    params = [(key, shape, local) for param in held for _, key, shape, local in param.tensors]
    check = ""
    if params:  # check_parameters' arguments: the parameters' state_dict keys, their shapes, their names
        keys = _tuple_literal(f'"{key}"' for key, _, _ in params)
        shapes = _tuple_literal(repr(tuple(shape)) for _, shape, _ in params)
        check = f'check_parameters("{p.class_name}", {keys}, {shapes}, {_tuple_literal(name for _, _, name in params)})'
    return ModuleForward(p.class_name, leads, reshapes=bool(lead_lines), copied=frozenset(copied), generic=p.generic,
                         any_shape=takes_any_shape(p), divisor=p.divisor if p.generic else 1,
                         in_features=p.in_features, like=params[0][2] if params else "x", parameters_check=check,
                         sequences=p.sequences, graphs=graphs, sequence_format=p.sequence_format,
                         te_masks=te_masks(p), fresh=fresh_parameters(held),
                         fresh_compiled=fresh_parameters(held, compiled=True), rotary_table=p.rotary_table,
                         sequence_ranks=sequence_ranks(p.ops),
                         head_dims=tuple(sorted({op.args["hidden"] // op.args["heads"] for op in p.ops
                                                 if op.rotary_table is not None})))


def arguments(pipeline, leads: dict[int, str], copied: set[int], lead_lines=(), graphs=False) -> list[Argument]:
    """Each free value as an argument. ``leads``: the leading dims' name at each op's input
    (emit.leading_dims), ``lead_lines`` the lines that compute them; ``copied``: extra inputs the
    forward gets a copy of (the caller's tensor changes after it: a written-back one the backward
    reads); ``graphs``: the module replays CUDA graphs."""
    owner = {}
    for op in pipeline.ops:
        for value in (op.extra_in, *(v for _, v in op.param_ids), op.module_object, op.lead):
            owner.setdefault(value, op)
    forward = _module_forward(pipeline, leads, copied, lead_lines, graphs)
    return [argument(forward, pipeline.value(value), owner.get(value)) for value in free_values(pipeline)]


def argument(f: ModuleForward, value: Value, op) -> Argument:
    """How the module's forward passes and checks ``value`` (of ``op``; x has none), by its role."""
    name, like, like_is = value.name, f.like, f.like_is
    where = f'"{f.module}", "{name}", {name}'  # what a check's error names
    if value.role is Role.ACTIVATION and op is None:  # x: [rows, features], dense
        features = size_expr(value.features, "n", "//")
        return Argument(value.id, value.role, name, f"as_rows({name}, {features})", line=name, check=_x_check(f),
                        checked_by="check_input")
    if value.role is Role.ACTIVATION:  # an extra input: [rows, features], dense
        features = size_expr(value.features, "n", "//")
        if value.id in f.copied:
            passed = f"{name}.reshape(-1, {features}).clone(memory_format=torch.contiguous_format)"
        else:
            passed = f"as_rows({name}, {features})"
        if f.any_shape and f.leads[op.index] == "lead":  # x's shape, whatever it is
            check = f"check_input({where}, None, {like}{like_is}, shape=x.shape)"
        else:
            check = f"check_input({where}, {features}, {like}, {_lead(f, op)}{like_is})"
        return Argument(value.id, value.role, name, passed, line=name, check=(check,), checked_by="check_input")
    if value.role is Role.ROWWISE:  # one value per row
        check = f"check_row_input({where}, {like}, {_lead(f, op)}{like_is})"
        return Argument(value.id, value.role, name, f"{name}.reshape(-1).contiguous()", line=name, check=(check,),
                        checked_by="check_row_input")
    if value.role is Role.PARAMETER:  # the parameters, on one line, checked on one line
        return Argument(value.id, value.role, name, name, line="parameters", check=(f.parameters_check,),
                        checked_by="check_parameters", per_call=value.id in f.fresh,
                        compiled_per_call=value.id in f.fresh_compiled)
    if value.role is Role.FLAG:
        return Argument(value.id, value.role, name, "self.training", line=name,
                        comment="Dropout draws its masks in training only")
    if value.role in (Role.GROUP, Role.OBJECT):  # the TP group it was given; a user's module (beside its leading dims)
        held = f"self.{name}" if value.role is Role.GROUP else f'self._modules["{op.module_index}"]'
        return Argument(value.id, value.role, name, held, line=name)
    if value.role is Role.METADATA and f.sequences is not None and value.id in f.sequences:
        # the packed sequences, made once from the call form (x's rows; seq_lens=, max_seqlen=) and
        # checked there: int32 offsets on x's device, and a host int (bounded by the rows where a
        # module replays CUDA graphs: one graph serves every set of lengths of a row and batch count)
        few_rows = ", self.cuda_graphs.max_rows" if f.graphs else ""
        form = f', qkv_format="{f.sequence_format}"' if f.sequence_format else ""
        keywords = [k for k in TE_KEYWORDS if k != "rotary_pos_emb" or f.rotary_table is None]  # else read below
        check = (f'seq_lens, max_seqlen, offsets = te_sequences("{f.module}", seq_lens, max_seqlen, {f.te_masks!r}, '
                 f'{", ".join(f"{k}={k}" for k in keywords)})',) if f.te_masks else ()
        te = ", offsets=offsets" if f.te_masks else ""
        if f.rotary_table is not None:  # TE's table: float32 [max_s, d] ([0, d] for None), its rows bound the lengths
            check += (f'rotary_table = ref.rotary_table_argument("{f.module}", rotary_pos_emb, {f.head_dims!r}, x)',)
            te += ", positions=rotary_table.shape[0] or None"
        te += f", ranks={f.sequence_ranks}" if f.sequence_ranks > 1 else ""  # x: a rank's share (sequence parallel)
        check += (f'cu_seqlens, max_seqlen = packed_sequences("{f.module}", x, seq_lens, max_seqlen{few_rows}{form}{te})',)
        if f.sequence_format == "sbhd" and f.sequence_ranks == 1:  # TE's default: x [seq, batch] as batch-major rows
            check += ("x = x.transpose(0, 1)  # 'sbhd': batch-major rows inside (as_rows copies once), each batch column a sequence",)
        first = value.id == f.sequences[0]
        return Argument(value.id, value.role, name, name, line="sequences", check=check,
                        checked_by="packed_sequences", typed="Tensor" if first else "int", per_call=first,
                        comment="the packed sequences: offsets [batch + 1], a bound on the longest length" if not first else "")
    if value.role is Role.METADATA and value.id == f.rotary_table:  # made and checked with the sequences
        return Argument(value.id, value.role, name, name, line=name, typed="Tensor", per_call=True,
                        comment="TE's rotary_pos_emb: float32 angles [max_s, d]; [0, d] for None (no rotary)")
    if value.role is Role.METADATA and op is not None and op.lead == value.id:
        return Argument(value.id, value.role, name, f.leads[op.index], line=module_name(op),
                        comment=f"{comment_text(op.args['call'])}: run as it is")
    raise AssertionError(f"{f.module}: no argument for the {value.role.value} value {name}")


def _x_check(f: ModuleForward) -> tuple[str, ...]:
    """x's check, and its width ``n`` where that is known at run time only."""
    check = f'check_input("{f.module}", "x", x, '
    if f.any_shape:
        return ("# TE's elementwise ops take any shape: a 0-D x is one row of one value",
                f"{check}None, {f.like}{f.like_is}, any_shape=True)", "n = x.shape[-1] if x.dim() else 1")
    if f.generic:
        multiple = f", multiple_of={f.divisor}" if f.divisor > 1 else ""
        return f"{check}None, {f.like}{multiple}{f.like_is})", "n = x.shape[-1]"
    return (f"{check}{f.in_features}, {f.like}{f.like_is})",)


def _lead(f: ModuleForward, op) -> str:
    """The leading dims an extra input of ``op`` must have: where an op reshapes, their name
    (computed after x's check); else x's, as ``lead`` is named after the checks."""
    return f.leads[op.index] if f.reshapes else "x.shape[:-1]"


def check_lines(args: list[Argument], lead_lines: list[str]) -> list[str]:
    """The module forward's lines before its call: each argument's check once (the parameters'
    first: the tensors the caller hands must have their dtype and device), and ``lead``, the
    leading dims of x: with the lines after it that compute those each Reshape makes
    (``lead_lines``, emit.leading_dims) right after x's check, as the extra inputs' checks read
    them; where nothing reshapes, last."""
    ordered = ([arg for arg in args if arg.role in CHECKED_FIRST]
               + [arg for arg in args if arg.role not in CHECKED_FIRST])
    lines, shared = [], set()
    for arg in ordered:
        if arg.check is None or (arg.line, arg.check) in shared:
            continue
        shared.add((arg.line, arg.check))
        lines += arg.check
        if arg.value == 0 and lead_lines:
            lines += ["# the leading dims of the running tensor, which each Reshape changes",
                      "lead = x.shape[:-1]", *lead_lines]
    return lines + ([] if lead_lines else ["lead = x.shape[:-1]"])


def check_helpers(args: list[Argument]) -> list[str]:
    """The runtime's functions the checks call, in name order (the module imports them)."""
    helpers = {arg.checked_by for arg in args if arg.checked_by}
    if any(line.startswith("seq_lens, max_seqlen, offsets = te_sequences(") for arg in args for line in arg.check or ()):
        helpers.add("te_sequences")  # TE's forward keywords (TE_KEYWORDS)
    if ignores_sequences(args):  # the packed-sequence call form's check (ignored_sequences_lines)
        helpers.add("check_packed_form")
    return sorted(helpers)


# TE's attention modules' forward keywords (MultiheadAttention.forward, TransformerLayer.forward) a
# module built from them takes besides fusegen's call form, all None by default; runtime te_sequences
# turns them into seq_lens / max_seqlen and refuses what fusegen cannot honour; rotary_pos_emb, TE's
# per-call rotary table, becomes the rotary_table argument where an attention op reads it
# (Pipeline.rotary_table: ref.rotary_table_argument checks it), and te_sequences refuses a table
# elsewhere (attention ops that rotate by a rotary_base of their own), never dropping it
TE_KEYWORDS = ("cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv", "attention_mask",
               "self_attn_mask_type", "attn_mask_type", "window_size", "rotary_pos_emb")


def te_masks(pipeline) -> tuple[str, ...]:
    """The masks of a pipeline of TE's attention modules (its attention ops have a qkv_format): the
    module then takes TE's forward keywords. Empty elsewhere."""
    if pipeline.sequence_format is None:
        return ()
    return tuple(sorted({op.args["attn_mask_type"] for op in pipeline.ops if op.opdef.reads_sequences}))


def forward_parameters(args: list[Argument], masks: tuple[str, ...] = ()) -> str:
    """The module forward's parameters: the tensors the caller hands, then the packed-sequence call
    form, which every module takes: ``seq_lens`` (positional where x is the only tensor,
    ``m(x, seq_lens)``) and ``max_seqlen``, keyword-only; a module of TE's attention modules
    (``masks``, te_masks) also TE's forward keywords (TE_KEYWORDS), keyword-only."""
    tensors = caller_tensors(args)
    te = "".join(f", {k}=None" for k in TE_KEYWORDS) if masks else ""
    if len(tensors) == 1:
        return f"{tensors[0]}, seq_lens=None, *, max_seqlen=None{te}"
    return f"{', '.join(tensors)}, *, seq_lens=None, max_seqlen=None{te}"


def ignores_sequences(args: list[Argument]) -> bool:
    """Whether no op of the pipeline reads the packed sequences: the module takes and ignores them."""
    return not any(arg.checked_by == "packed_sequences" for arg in args)


def ignored_sequences_lines(module: str, args: list[Argument]) -> list[str]:
    """Where no op reads the packed sequences, the module forward's lines that take them: only the
    call form is checked (a 3-D x with seq_lens is an error), and only where seq_lens is given."""
    if not ignores_sequences(args):
        return []
    return ["if seq_lens is not None:  # no op reads packed sequences: the call form is checked, then ignored",
            f'    check_packed_form("{module}", x)']


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


def grad_inputs(args: list[Argument], x_grad, grad: Callable) -> list:
    """What the Function's backward returns for each input, as grad values: x's is ``x_grad`` (the
    grad the backward leaves it in), a tensor's ``grad(value)``, the rest's None (a flag, an
    object, metadata have no grad)."""
    return [x_grad if arg.value == 0 else grad(arg.value) if arg.tensor else None for arg in args]


def per_call_positions(args: list[Argument], compiled: bool = False) -> tuple[int, ...]:
    """The positions, among the Function's arguments, of the tensors made anew each call besides
    the caller's (the packed sequences' offsets; ``compiled``: under torch.compile): a CUDA graph
    copies them in (CudaGraphs' ``per_call``)."""
    return tuple(i for i, arg in enumerate(args) if arg.per_call or (compiled and arg.compiled_per_call))


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
