"""The op catalog: the one place that describes an operation.

Every other stage reads this table: the frontend (constructor signatures and argument checks),
the pipeline builder (feature-size rules, parameters), the planner (what kind of stage an op can
join), the eager reference module and the emitted code (reference math, device functions).
Semantics follow Transformer Engine's ``te.ops`` (see shared/reference/te_ops_catalog.md).

Adding an elementwise op means one ``OpDef`` here plus one device struct in
``templates/cuda/activations.cuh`` and its reference math in ``generator/reference.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

REQUIRED = object()  # marker: argument has no default


@dataclass(frozen=True)
class Arg:
    """One constructor argument. ``kind`` is one of int, float, bool."""

    name: str
    kind: str
    default: object = REQUIRED
    keyword_only: bool = False
    check: Callable[[object], str | None] | None = None  # returns an error text, or None


@dataclass(frozen=True)
class Param:
    """A trainable parameter of an op; ``shape`` maps the op's arguments to a shape."""

    name: str
    shape: Callable[[dict], tuple[int, ...]]
    init: Callable[[dict], str]  # "ones" | "zeros" | "kaiming_uniform"


@dataclass(frozen=True)
class OpDef:
    """A fusible operation, as a spec names it.

    kind -- what the planner sees: linear, bias, norm, activation, glu, scale,
            add_extra_input, make_extra_output, identity. ``Linear`` has kind "container": it
            expands to the basic ops listed in ``expand``.
    features -- (in, out) feature rule: fixed_in(args) -> int | None, out(in) -> int.
    tag -- the op's word in kernel names (may depend on arguments).
    device_struct -- the functor in templates/cuda/activations.cuh with the op's fwd/bwd math; a
                     fused kernel constructs it from ``device_args`` (compile-time constants).
    device_args -- the op's constants, in the order the functor's fields and the reference
                   functions' trailing parameters take them.
    reference -- the function names in reference.py (forward, backward) for this op; "" where the
                 backward is the identity on the incoming gradient.
    """

    name: str
    kind: str
    args: tuple[Arg, ...] = ()
    params: tuple[Param, ...] = ()
    fixed_in: Callable[[dict], int | None] = lambda a: None
    out_features: Callable[[dict, int], int] = lambda a, n: n
    tag: Callable[[dict], str] = lambda a: ""
    device_struct: str = ""
    device_args: Callable[[dict], tuple[float, ...]] = lambda a: ()
    reference: tuple[str, str] = ("", "")
    summary: str = ""
    expand: Callable[[dict], list[tuple[str, dict, str]]] | None = None  # -> (op, args, param prefix)
    extra_inputs: int = 0
    extra_outputs: int = 0
    needs_input_in_backward: bool = False  # backward reads the forward input value
    changes_value: bool = True  # forward output differs from input (identity-like ops don't)
    changes_grad: bool = True  # backward grad differs from incoming grad

    @property
    def functor_form(self) -> str | None:
        """How a fused elementwise kernel applies the op's functor: 'unary' (fwd(x), bwd(x, dy)),
        'gate' (a GLU: fwd(a, b), bwd(a, b, dy, da, db)), or None (the op has no functor)."""
        if not self.device_struct:
            return None
        return "gate" if self.kind == "glu" else "unary"

    def signature(self) -> str:
        parts, star = [], False
        for a in self.args:
            if a.keyword_only and not star:
                parts.append("*")
                star = True
            parts.append(a.name if a.default is REQUIRED else f"{a.name}={a.default!r}")
        return f"{self.name}({', '.join(parts)})"


# Feature sizes a real model never reaches, so a typo (or 2**62) is an error here rather than a
# failed allocation or an int32 overflow in a kernel later. LM heads, the widest layers, have about
# 256k outputs; 2**24 leaves 64 times that.
MAX_FEATURES = 2 ** 24
# A norm kernel is specialised for its hidden size and holds the whole row in registers, hidden/512
# values per thread (templates/cuda/norm.cuh, kernels.norm_threads). NVRTC 13 for sm_90: the
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


_FEATURES = _size(MAX_FEATURES, "that is fusegen's bound on feature sizes, far above any model's")
_NORM_FEATURES = _size(MAX_NORM_FEATURES, "a norm kernel keeps its whole row in registers, and wider rows spill "
                       "to memory and compile for minutes")


def _finite(v):
    if not math.isfinite(v):
        return "must be finite"
    if abs(v) > FLOAT32_MAX:
        return (f"must be at most {FLOAT32_MAX:.7g} in magnitude (the kernels multiply in float32, where it would "
                "be inf)")
    return None


def _positive_finite(v):
    return _finite(v) or (None if v > 0 else "must be positive")


def _eps(v):
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


def _norm_tag(base: str, defaults_eps: float):
    def tag(a: dict) -> str:
        t = base
        if a["zero_centered_gamma"]:
            t += "_zc"
        if a["eps"] != defaults_eps:
            t += "_eps" + float_tag(a["eps"])
        return t

    return tag


_EPS = Arg("eps", "float", 1e-5, keyword_only=True, check=_eps)
_ZCG = Arg("zero_centered_gamma", "bool", False, keyword_only=True)
_IN_PLACE = Arg(
    "in_place", "bool", False, keyword_only=True,
    check=lambda v: "must be False: fusegen owns its buffers and never mutates the caller's tensors" if v else None,
)
_GAMMA_INIT = lambda a: "zeros" if a["zero_centered_gamma"] else "ones"  # noqa: E731

OPS: dict[str, OpDef] = {}


def _register(op: OpDef) -> None:
    OPS[op.name] = op


_register(OpDef(
    "BasicLinear", "linear",
    args=(Arg("in_features", "int", check=_FEATURES), Arg("out_features", "int", check=_FEATURES)),
    params=(Param("weight", lambda a: (a["out_features"], a["in_features"]), lambda a: "kaiming_uniform"),),
    fixed_in=lambda a: a["in_features"],
    out_features=lambda a, n: a["out_features"],
    reference=("linear", "linear_bwd"),
    summary="y = x W^T",
    needs_input_in_backward=True,
))
_register(OpDef(
    "Linear", "container",
    args=(Arg("in_features", "int", check=_FEATURES), Arg("out_features", "int", check=_FEATURES),
          Arg("bias", "bool", True, keyword_only=True)),
    expand=lambda a: [("BasicLinear", {"in_features": a["in_features"], "out_features": a["out_features"]}, "")]
    + ([("Bias", {"size": a["out_features"]}, "")] if a["bias"] else []),
    summary="BasicLinear followed by Bias",
))
_register(OpDef(
    "Bias", "bias",
    args=(Arg("size", "int", check=_FEATURES),),
    params=(Param("bias", lambda a: (a["size"],), lambda a: "zeros"),),
    fixed_in=lambda a: a["size"],
    tag=lambda a: "bias",
    reference=("bias", "bias_bwd"),
    summary="y = x + b",
    changes_grad=False,
))
_register(OpDef(
    "LayerNorm", "norm",
    args=(Arg("normalized_shape", "int", check=_NORM_FEATURES), _EPS, _ZCG),
    params=(Param("weight", lambda a: (a["normalized_shape"],), _GAMMA_INIT),
            Param("bias", lambda a: (a["normalized_shape"],), lambda a: "zeros")),
    fixed_in=lambda a: a["normalized_shape"],
    tag=_norm_tag("layernorm", 1e-5),
    reference=("layer_norm", "layer_norm_bwd"),
    summary="y = (x - mean) * rstd * gamma + beta",
    needs_input_in_backward=True,
))
_register(OpDef(
    "RMSNorm", "norm",
    args=(Arg("normalized_shape", "int", check=_NORM_FEATURES), _EPS, _ZCG),
    params=(Param("weight", lambda a: (a["normalized_shape"],), _GAMMA_INIT),),
    fixed_in=lambda a: a["normalized_shape"],
    tag=_norm_tag("rmsnorm", 1e-5),
    reference=("rms_norm", "rms_norm_bwd"),
    summary="y = x * rsqrt(mean(x^2) + eps) * gamma",
    needs_input_in_backward=True,
))

for _name, _tag, _struct, _ref, _summary in [
    ("GELU", "gelu", "fg::Gelu", "gelu", "tanh-approximated GELU"),
    ("ReLU", "relu", "fg::Relu", "relu", "max(x, 0)"),
    ("SiLU", "silu", "fg::Silu", "silu", "x * sigmoid(x)"),
    ("SReLU", "srelu", "fg::Srelu", "srelu", "relu(x)^2"),
]:
    _register(OpDef(
        _name, "activation", tag=lambda a, t=_tag: t, device_struct=_struct,
        reference=(_ref, _ref + "_bwd"), summary=_summary, needs_input_in_backward=True,
    ))

for _name, _tag, _struct, _ref, _summary in [
    ("SwiGLU", "swiglu", "fg::SwiGLU", "swiglu", "silu(a) * b, a = first half"),
    ("GEGLU", "geglu", "fg::GeGLU", "geglu", "gelu_tanh(a) * b, a = first half"),
]:
    _register(OpDef(
        _name, "glu", tag=lambda a, t=_tag: t, device_struct=_struct,
        out_features=lambda a, n: n // 2,
        reference=(_ref, _ref + "_bwd"), summary=_summary, needs_input_in_backward=True,
    ))

_register(OpDef(
    # GPT-OSS: a' = min(a, limit); y = a' * sigmoid(alpha * a') * (clamp(b, -limit, limit) + offset)
    "ClampedSwiGLU", "glu",
    args=(Arg("limit", "float", 7.0, keyword_only=True, check=_positive_finite),
          Arg("alpha", "float", 1.702, keyword_only=True, check=_finite),
          Arg("glu_linear_offset", "float", 1.0, keyword_only=True, check=_finite)),
    tag=lambda a: "clamped_swiglu" + "".join(
        f"_{key}{float_tag(a[name])}" for key, name, default in
        (("l", "limit", 7.0), ("a", "alpha", 1.702), ("o", "glu_linear_offset", 1.0)) if a[name] != default),
    device_struct="fg::ClampedSwiGLU", device_args=lambda a: (a["limit"], a["alpha"], a["glu_linear_offset"]),
    out_features=lambda a, n: n // 2,
    reference=("clamped_swiglu", "clamped_swiglu_bwd"),
    summary="min(a, limit) * sigmoid(alpha * min(a, limit)) * (clamp(b, -limit, limit) + offset), a = first half",
    needs_input_in_backward=True,
))
_register(OpDef(
    "ConstantScale", "scale",
    args=(Arg("scale", "float", check=_finite),),
    tag=lambda a: "scale" + float_tag(a["scale"]),
    device_struct="fg::Scale", device_args=lambda a: (a["scale"],),
    reference=("constant_scale", "constant_scale_bwd"),
    summary="y = scale * x",
))
_register(OpDef(
    "AddExtraInput", "add_extra_input",
    args=(_IN_PLACE,),
    tag=lambda a: "add",
    reference=("add_extra_input", ""),
    summary="y = x + r (r is an extra input)", extra_inputs=1, changes_grad=False,
))
_register(OpDef(
    "MakeExtraOutput", "make_extra_output",
    args=(_IN_PLACE,),
    tag=lambda a: "tee",
    reference=("make_extra_output", ""),
    summary="y = x, and x again as an extra output", extra_outputs=1, changes_value=False,
))
_register(OpDef(
    "Identity", "identity", summary="y = x", changes_value=False, changes_grad=False,
))

def basic_ops(name: str, args: dict) -> list[tuple[OpDef, dict]]:
    """The basic ops a spec-level op stands for (``Linear`` is BasicLinear + Bias)."""
    op = OPS[name]
    if op.expand is None:
        return [(op, args)]
    return [(OPS[sub], sub_args) for sub, sub_args, _ in op.expand(args)]


# Spellings a spec may use for the pipeline container.
SEQUENTIAL = "Sequential"

ELEMENTWISE_KINDS = frozenset({"bias", "activation", "glu", "scale", "add_extra_input", "make_extra_output"})
