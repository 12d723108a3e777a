"""What an op is: ``OpDef`` and its ``Arg``s and ``Param``s, the argument checks and limits the
family modules share, and the registry table ``OPS`` that ``register`` fills. Semantics follow
Transformer Engine's ``te.ops`` (see shared/reference/te_ops_catalog.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from . import shipped, te_namespace

REQUIRED = object()  # marker: argument has no default
# Where a spec imports the shipped ops (and Sequential) from: te.ops, the note's te. (ops/te_namespace.py:
# the same ops and arguments) or fusegen's eager module; a plugin's ops from its module (OpDef.modules).
SPEC_MODULES = ("transformer_engine.pytorch.ops", te_namespace.TE_NAMESPACE, "fusegen.eager")


@dataclass(frozen=True)
class TorchDtype:
    """A ``torch.<dtype>`` a spec names (read, never imported): ``dtype=torch.bfloat16``."""

    name: str  # torch's canonical name: float32, float16, bfloat16, float64

    def __repr__(self) -> str:
        return f"torch.{self.name}"


# torch's dtype attributes a spec may name, by their canonical names
TORCH_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                "bfloat16": "bfloat16", "float64": "float64", "double": "float64"}


@dataclass(frozen=True)
class Arg:
    """One constructor argument. ``kind`` is one of int, float, bool, shape (as TE's ``normalized_shape``: an int
    for one dim, a tuple of ints for several), device (None or "cuda", "cuda:1", "cpu") and dtype (None
    or a ``TorchDtype``)."""

    name: str
    kind: str
    default: object = REQUIRED
    keyword_only: bool = False
    check: Callable[[object], str | None] | None = None  # returns an error text, or None
    in_kernel: bool = True  # False: no part of what a kernel computes (placement, TE's no-op hints)
    # True: one of TE's arguments accepted only at its default (parallelism), left out of signatures shown
    te_only: bool = False
    objects: tuple[str, ...] = ()  # import paths of objects a spec may pass, read as their last name


@dataclass(frozen=True)
class Param:
    """A trainable parameter of an op; ``shape`` maps the op's arguments to a shape."""

    name: str
    shape: Callable[[dict], tuple[int, ...]]
    init: Callable[[dict], str]  # "ones" | "zeros" | "kaiming_uniform"


@dataclass(frozen=True)
class Operand:
    """A tensor an elementwise op reads beside the running value: its parameter or an extra input.

    The op's functor takes it as a second argument, ``fwd(x, t)`` and ``bwd(x, t, dy, dx, dt)``,
    as do its reference functions (``f(x, t, *constants)``; ``f_bwd(x, t, dy, *constants)``
    returning ``(dx, dt)``; x and t are None where the backward does not read them).
    """

    source: str  # "param": the op's one parameter | "extra_input": the op's extra input |
    #              "random": a key the generated module draws per call (Dropout)
    broadcast: str  # "column": one value per feature | "element": one per value | "scalar": one value |
    #                 "random": one draw per element, uniform in [0, 1), from the key (fg::draws)
    grad: str  # dt reduced to the operand's grad: "column" (summed over rows), "scalar" (summed over
    #            all, deterministically), "element" (an addend: its grad is the running grad) or
    #            "none" (the operand has no gradient)
    read_in_backward: bool = False  # the backward needs t (a product does; a sum does not)


@dataclass(frozen=True)
class OpDef:
    """A fusible operation, as a spec names it.
    kind -- what the planner sees: linear, bias, norm, activation, glu, scale, add_extra_input,
            make_extra_output, identity, ... (``Linear``: "container", expanding to ``expand``'s ops).
    tag -- the op's word in kernel names (may depend on arguments).
    device_struct -- the functor with the op's fwd/bwd math (in ``device_header``); a fused kernel
                     constructs it from ``device_args`` (compile-time constants).
    device_header -- its header: one of templates/cuda/, or of a plugin's ``.cuh`` folder.
    operand -- the tensor the functor reads besides the running value (Bias's vector, an extra
               input, a learnable scalar), and how its gradient is reduced.
    device_args -- the op's constants, in the order the functor's fields and the reference
                   functions' trailing parameters take them.
    reference -- the op's reference math (forward, backward), functions of its family module;
                 None where there is none (the backward of an op whose grad is the incoming one).
                 They are shipped by source into the output's ``_reference.py`` and called there
                 by name (``reference_names``).
    reference_args -- the trailing arguments of the reference forward after the input and the
                      parameters (default: ``device_args``, the functor's constants).
    reference_helpers -- further functions of the op modules that ``reference`` calls, shipped
                         with it (``compute`` and ``init_parameter`` always are).
    """

    name: str
    kind: str
    args: tuple[Arg, ...] = ()
    params: tuple[Param, ...] = ()
    fixed_in: Callable[[dict], int | None] = lambda a: None  # its input size, or None: any
    out_features: Callable[[dict, int], int] = lambda a, n: n  # its output size given the input's
    fixed_out: Callable[[dict], int | None] = lambda a: None  # its output size whatever its input's; -1: run time
    # The shape the op gives the running tensor (Reshape: torch.reshape's argument), or None
    reshape: Callable[[dict], tuple[int, ...]] | None = None
    # A check of the op's input and output sizes once all are known (ints, or run-time Syms): an error text, or None
    check_sizes: Callable[[dict, object, object], str | None] = lambda a, n_in, n_out: None
    # A view that moves dims between the leading shape and the features (identity.py's FlattenRows, UnflattenRows):
    # the shipped helper that gives the new leading dims (naming the module and op if its first parameters say so)
    new_lead: Callable[[dict], tuple[Callable, tuple[int, ...]]] | None = None
    # The trailing dims the op reads as one row where they are several (a norm's multi-dim
    # normalized_shape): the graph runs it on their product, between views that flatten them into
    # the features and back (ir.build_graph)
    row_shape: Callable[[dict], tuple[int, ...] | None] = lambda a: None
    user_module: bool = False  # a module of the user's code, run as it is (ops/module.py)
    reads_sequences: bool = False  # reads the call's packed sequences (Op.cu_seqlens, Op.max_seqlen: attention)
    uses_training: Callable[[dict], bool] = lambda a: False  # reads the training flag (attention's dropout)
    # A GLU's glu_interleave_size: its input rows alternate blocks [a(k), b(k), a(k), ...]; None: [a | b]
    interleave: Callable[[dict], int | None] = lambda a: None
    # On a rank's share of the features (generator/tensor_parallel.py): its arguments for 1/k of them (k given), or
    # an error text; and the sections of its (unsharded) input features that each split in rank order (q, k, v)
    split_features: Callable[[dict, int], dict | str] | None = None
    feature_sections: Callable[[dict, int], tuple[int, ...]] | None = None
    tag: Callable[[dict], str] = lambda a: ""
    device_struct: str = ""
    device_header: str = "activations.cuh"
    operand: Operand | None = None
    device_args: Callable[[dict], tuple[float, ...]] = lambda a: ()
    reference: tuple[Callable | None, Callable | None] = (None, None)
    reference_helpers: tuple[Callable, ...] = ()
    reference_args: Callable[[dict], tuple] | None = None
    summary: str = ""
    expand: Callable[[dict], list[tuple]] | None = None  # -> (op, args, part: ops.part_attribute[, held_rows.HeldRows])
    modules: tuple[str, ...] = SPEC_MODULES  # the modules a spec may import the op from
    spelled: str = ""  # its name in those modules, where that is not ``name`` (torch.nn's Linear)
    hint_stem: str = ""  # its generated names' stem where its name is long ("mha" for MultiheadAttention: mha0_...)
    residuals: Callable[[dict], tuple[tuple[int, int, str], ...]] = lambda a: ()  # expand's (first, end, name): x + items(x)
    validate: Callable[[dict], str | None] | None = None  # a check across arguments: an error text, or None
    view: bool = False  # moves no data (Identity): a graph node whose output is its input
    opaque: bool = False  # runs unfused as its reference math in PyTorch (stages/opaque.py)
    extra_inputs: int = 0
    extra_outputs: int = 0
    # Whether the op's output is also written into its extra input (TE's AddExtraInput(in_place=True)
    # mutates the caller's tensor): the planner hands the value out as a hidden extra output and
    # the generated module copies it into that tensor.
    writes_back: Callable[[dict], bool] = lambda a: False
    needs_input_in_backward: bool = False  # backward reads the forward input value
    # its backward gives the same result from its output as from its input (ReLU: y > 0 exactly
    # where x > 0), so a stage that materialised only the output (a GEMM epilogue) serves it
    backward_from_output: bool = False
    changes_value: bool = True  # forward output differs from input (identity-like ops don't)
    changes_grad: bool = True  # backward grad differs from incoming grad (False: identity-like ops)

    def describe(self, args: dict, kernel: bool = False, name: str = "") -> str:
        """A call of the op as a spec would write it (``name``: as spelled there, else the op's name): required
        arguments by position, others if not default. ``kernel=True``: as a kernel sees it, without the arguments
        that are no part of what it computes (``Arg.in_kernel``). A user's module: its call as written."""
        if self.user_module:
            return args["call"]
        shown = []
        for a in self.args:
            if kernel and not a.in_kernel:
                continue
            value = args[a.name]
            if a.default is REQUIRED:
                shown.append(repr(value))
            elif value != a.default:
                shown.append(f"{a.name}={value!r}")
        return f"{name or self.name}({', '.join(shown)})"

    @property
    def functor_form(self) -> str | None:
        """How a fused elementwise kernel applies the op: 'unary' (fwd(x), bwd(x, dy)), 'gate' (a
        GLU: fwd(a, b), bwd(a, b, dy, da, db)), 'binary' (with an ``operand`` t: fwd(x, t),
        bwd(x, t, dy, dx, dt)), 'tee' (an extra output: the value is handed out, its grad added),
        or None (the op does not run in elementwise kernels)."""
        if self.extra_outputs:
            return "tee"
        if not self.device_struct:
            return None
        if self.operand is not None:
            return "binary"
        return "gate" if self.kind == "glu" else "unary"

    @property
    def halves_width(self) -> bool:
        """A GLU: its output is half its input, and a run may hold only one."""
        return self.kind == "glu"

    @property
    def attribute(self) -> str:
        """The name a spec imports it by from its ``modules``."""
        return self.spelled or self.name

    def reference_arguments(self, args: dict) -> tuple:
        """The trailing arguments of the reference forward (``reference_args``)."""
        return (self.reference_args or self.device_args)(args)

    @property
    def reference_names(self) -> tuple[str, str]:
        """(forward, backward) names in ``_reference.py``; "" where the op has none."""
        forward, backward = self.reference
        return (forward.__name__ if forward else "", backward.__name__ if backward else "")

    def signature(self) -> str:
        parts, star = [], False
        for a in self.args:
            if a.keyword_only and not star:
                parts.append("*")
                star = True
            if not a.te_only:
                parts.append(a.name if a.default is REQUIRED else f"{a.name}={a.default!r}")
        return f"{self.name}({', '.join(parts)})"


OPS: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Add ``op`` to the registry, refusing one whose reference math cannot be shipped (shipped.py)."""
    if op.name in OPS:
        raise ValueError(f"op {op.name} is registered twice")
    if op.opaque and (op.device_struct or None in op.reference):
        raise ValueError(f"op {op.name}: an opaque op runs as its reference math, so it needs a reference "
                         "forward and backward and no device functor")
    shipped.check_shippable(op, OPS.values())
    OPS[op.name] = op
    return op


# --- limits and argument checks -----------------------------------------------------------------

# Feature sizes a real model never reaches, so a typo (or 2**62) is an error here rather than a
# failed allocation or an int32 overflow in a kernel later. LM heads, the widest layers, have about
# 256k outputs; 2**24 leaves 64 times that.
MAX_FEATURES = 2 ** 24
# A norm kernel is specialised for its hidden size and holds the whole row in registers, hidden/512
# values per thread (templates/cuda/norm.cuh, stages/norm/tuning.py: norm_threads). NVRTC 13 for sm_90: the
# forward fits in registers up to 32768 and spills a little at 65536 (the backward, holding five
# such arrays, spills from 16384); compiling takes ~1.5 s per kernel at 65536, ~4 s at 2**17 and
# minutes at 10**6, growing faster than the size. The largest models' hidden sizes are below 32768.
MAX_NORM_FEATURES = 2 ** 16
# Float arguments reach the CUDA kernels as float32 literals: outside this range they become inf or 0.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_MIN_NORMAL = 2.0 ** -126


def _size(limit: int, why: str):
    def check(v):
        if v <= 0:
            return "must be positive"
        return None if v <= limit else f"must be at most {limit} (2**{limit.bit_length() - 1}), got {v}; {why}"

    return check


check_features = _size(MAX_FEATURES, "that is fusegen's bound on feature sizes, far above any model's")
check_norm_features = _size(MAX_NORM_FEATURES, "a norm kernel keeps its whole row in registers, and wider rows "
                            "spill to memory and compile for minutes")


def dims_of(shape) -> tuple[int, ...]:
    """A ``shape`` argument's dims: (n,) for an int."""
    return shape if isinstance(shape, tuple) else (shape,)


def check_norm_shape(shape):
    """A norm's normalized_shape: positive sizes whose product (the row the kernel normalises)
    is within the norm kernels' bound."""
    dims = dims_of(shape)
    if any(d <= 0 for d in dims):
        return "must hold positive sizes"
    problem = check_norm_features(math.prod(dims))
    if problem and len(dims) > 1:
        return f"{problem} (the product of its sizes, which the kernels normalise as one row)"
    return problem


def check_finite(v):
    if not math.isfinite(v):
        return "must be finite"
    if abs(v) > FLOAT32_MAX:
        return (f"must be at most {FLOAT32_MAX:.7g} in magnitude (the kernels multiply in float32, where it would "
                "be inf)")
    return None


def check_positive_finite(v):
    return check_finite(v) or (None if v > 0 else "must be positive")


# Where and in which dtype an op's parameters are made (TE's device=, dtype=; the module's device=/dtype= override)
DEVICE = Arg("device", "device", None, keyword_only=True, in_kernel=False)
DTYPE = Arg("dtype", "dtype", None, keyword_only=True, in_kernel=False)

# TE's performance hints that have no effect in fusegen's kernels: accepted so a TE spec compiles
# unchanged, and documented as no-ops (README).
CACHE_QUANTIZED_INPUT = Arg("cache_quantized_input", "bool", False, keyword_only=True, in_kernel=False)  # FP8
SM_MARGIN = Arg("sm_margin", "int", 0, keyword_only=True, in_kernel=False,
                check=lambda v: None if v >= 0 else "must be 0 or more (SMs left to other kernels)")


def _check_mode(v):
    return None if v in (None, "column", "row") else ('must be None, "column" (the output features split over the '
                                                      f'group) or "row" (the input features), as TE\'s; got {v!r}')


# TE's tensor- and sequence-parallel arguments (generator/tensor_parallel.py localises the ops). A group is any
# expression (the spec is never run): the generated module takes the group at construction. TE's modules' names:
# parallel_mode (their row-parallel bias added after the reduction) and tp_size (the build's size where not 1)
_TE_ONLY = dict(keyword_only=True, in_kernel=False, te_only=True)
TENSOR_PARALLEL_MODE = Arg("tensor_parallel_mode", "str", None, check=_check_mode, **_TE_ONLY)
TENSOR_PARALLEL_GROUP = Arg("tensor_parallel_group", "group", None, **_TE_ONLY)
SEQUENCE_PARALLEL = Arg("sequence_parallel", "bool", False, **_TE_ONLY)
TENSOR_PARALLEL = Arg("tensor_parallel", "bool", False, **_TE_ONLY)
RNG_STATE_TRACKER = Arg("rng_state_tracker_function", "str", None, **_TE_ONLY,
                        check=lambda v: "must be None: fusegen initialises parameters with PyTorch's generator")
USERBUFFERS = Arg("userbuffers_options", "str", None, **_TE_ONLY,
                  check=lambda v: f"must be left at its default: userbuffers are not supported yet (got {v!r})")
LINEAR_PARALLEL = (TENSOR_PARALLEL_MODE, TENSOR_PARALLEL_GROUP, SEQUENCE_PARALLEL, RNG_STATE_TRACKER, USERBUFFERS)
MODULE_PARALLEL_MODE = Arg("parallel_mode", "str", None, check=_check_mode, **_TE_ONLY)
TP_SIZE = Arg("tp_size", "int", 1, check=lambda v: None if v > 0 else "must be positive", **_TE_ONLY)


def check_probability(v):
    """A dropout probability (TE's Dropout and torch.nn.Dropout both refuse others)."""
    return None if 0.0 <= v <= 1.0 else f"must be a probability, from 0 to 1, got {v!r}"


def check_eps(v):
    """eps is added to the variance in float32 kernels: positive, finite, and not lost in float32."""
    if not math.isfinite(v):
        return "must be finite"
    if v <= 0:
        return "must be positive"
    if not FLOAT32_MIN_NORMAL <= v <= FLOAT32_MAX:
        return (f"must be between {FLOAT32_MIN_NORMAL:.7g} and {FLOAT32_MAX:.7g} (the kernels add it in "
                "float32, where it would become 0 or inf)")
    return None


def float_tag(v: float) -> str:
    """A float as an identifier fragment: 0.5 -> 0p5, -2.0 -> m2p0, 1e-06 -> 1em06."""
    return repr(float(v)).replace("-", "m").replace(".", "p").replace("+", "")
