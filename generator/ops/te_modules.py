"""Transformer Engine's monolithic modules as macros: ``te.LayerNormLinear`` and ``te.LayerNormMLP``
in a spec expand to the te.ops basic ops they compute (``OpDef.expand``), so they fuse exactly as
the hand-written chain does, while their parameters keep TE's names and shapes (each basic op's
part: ``fc1`` gives ``fc1_weight``, ``fc1_bias``; ops.part_attribute), so a TE checkpoint's
``state_dict`` loads into the generated module and into fusegen.eager's module of the same name.

Each module's arguments are TE's, in TE's order with TE's defaults (read from TE's
transformer_engine/pytorch/module/layernorm_linear.py and layernorm_mlp.py), each either honoured
or refused at its position in the spec with the reason:
- honoured: the sizes, eps, bias, normalization, activation, zero_centered_gamma, params_dtype (the
  parameters' dtype), device, fuse_wgrad_accumulation (the weight grads added into
  ``weight.main_grad``: te.ops' accumulate_into_main_grad), return_layernorm_output (the norm's
  output handed out as the pipeline's next extra output: a MakeExtraOutput after the norm);
- accepted as TE's own no-ops for the values (``_hint``): what TE ignores without tensor or
  sequence parallelism (the ub_* userbuffers overlaps, return_layernorm_output_gathered), the JIT
  warm-up sizes (seq_length, micro_batch_size), ``name`` (debugging), ``ub_name``, ``checkpoint``
  (TE's recompute of fc1 in the backward: the same values, fusegen saves what its plan saves);
- refused where given another value than TE's default: parallelism (issue 41), initialisers and
  the RNG tracker (fusegen initialises as te.ops does; load a checkpoint instead), return_bias and
  parameters_split (other outputs and parameter names), delay_wgrad_compute (no backward_dw),
  activation_params (a dict: write te.ops.ClampedSwiGLU(limit=...) in a Sequential instead).
TE's modules default ``device="cuda"``; here, as for every op, the generated module's ``device=``
places the parameters unless the spec gives one.
"""

from .opdef import Arg, OpDef, check_eps, check_features, register
from .te_namespace import TE_NAMESPACE

TE_MODULES = (TE_NAMESPACE, "fusegen.eager")  # a te.ops spelling (transformer_engine.pytorch.ops) is no module
# The ops that are TE's modules: their holders keep TE's _extra_state entry (the runtime's TeModuleOp, eager's)
TE_MACROS = ("LayerNormLinear", "LayerNormMLP")

# TE's activation names (layernorm_mlp.py: _get_act_func_supported_list) -> fusegen's op; a gated one
# (a GLU) halves its input, so fc1 makes twice ffn_hidden_size, as TE's fc1_weight is laid out.
ACTIVATIONS = {"gelu": "GELU", "geglu": "GEGLU", "glu": "GLU", "qgelu": "QGELU", "qgeglu": "QGEGLU", "relu": "ReLU",
               "reglu": "ReGLU", "srelu": "SReLU", "sreglu": "SReGLU", "silu": "SiLU", "swiglu": "SwiGLU",
               "clamped_swiglu": "ClampedSwiGLU"}
GATED = frozenset(("geglu", "glu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"))


def _refused(why: str, default: object = None):
    """A check refusing any value but TE's default, with why and what to do."""
    return lambda v: None if v == default else why


_PARALLEL = ("is tensor or sequence parallelism, which fusegen does not support yet (issue 41): leave it at "
             "its default and generate the unsharded module")
_INIT = ("is an initialiser, which a spec cannot carry (fusegen never runs it): fusegen initialises the parameters "
         "as te.ops does; load a checkpoint or initialise them after construction, and leave it out")


def _hint(name, kind, default):
    """One of TE's hints that change no value fusegen computes (module docstring): any value is accepted."""
    return Arg(name, kind, default, in_kernel=False)


def _refuse(name, kind, default, why):
    """An argument refused but at TE's default; shown in the signature, which is TE's in full (so a
    positional argument's place reads as in TE)."""
    return Arg(name, kind, default, in_kernel=False, check=_refused(why, default))


def _parallel(name, kind, default):
    return _refuse(name, kind, default, _PARALLEL)


_EPS = Arg("eps", "float", 1e-5, check=check_eps)
_BIAS = Arg("bias", "bool", True)
_NORMALIZATION = Arg("normalization", "str", "LayerNorm", check=lambda v: None if v in ("LayerNorm", "RMSNorm") else (
    f"must be 'LayerNorm' or 'RMSNorm' (TE's two), got {v!r}"))
_ZCG = Arg("zero_centered_gamma", "bool", False)
_PARAMS_DTYPE = Arg("params_dtype", "dtype", None, in_kernel=False)
_WGRAD = Arg("fuse_wgrad_accumulation", "bool", False, in_kernel=False)  # honoured: accumulate_into_main_grad
_RETURN_LN = Arg("return_layernorm_output", "bool", False)
_RETURN_BIAS = _refuse("return_bias", "bool", False,
                       "returns the bias unadded beside the output, which fusegen's module does not; give bias=False "
                       "and add a te.ops.Bias after the module in the Sequential instead")
_DELAY = _refuse("delay_wgrad_compute", "bool", False,
                 "defers the weight grads to a backward_dw() call, which fusegen's module does not have; leave it False")
_TRACKER = _refuse("get_rng_state_tracker", "object", None, _INIT)
_UB = tuple(_hint(name, "bool", False) for name in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad"))
_UB_BULK = (_hint("ub_bulk_dgrad", "bool", False), _hint("ub_bulk_wgrad", "bool", False))
_SYMMETRIC_AR = _parallel("symmetric_ar_type", "object", None)
_NAME = _hint("name", "str", None)
# TE's device (default "cuda" there): positional as in TE; None here, the generated module's device=
_DEVICE = Arg("device", "device", None, in_kernel=False)


def _norm(a: dict, size: int) -> tuple:
    kind = "RMSNorm" if a["normalization"] == "RMSNorm" else "LayerNorm"
    return (kind, {"normalized_shape": size, "eps": a["eps"], "device": a["device"], "dtype": a["params_dtype"],
                   "zero_centered_gamma": a["zero_centered_gamma"]}, "layer_norm")


def _linear(a: dict, part: str, in_features: int, out_features: int) -> list[tuple]:
    """TE's GEMM with its optional bias: BasicLinear, then Bias where ``bias``."""
    placed = {"device": a["device"], "dtype": a["params_dtype"]}
    ops = [("BasicLinear", {"in_features": in_features, "out_features": out_features, **placed,
                            "accumulate_into_main_grad": a["fuse_wgrad_accumulation"]}, part)]
    return ops + ([("Bias", {"size": out_features, **placed}, part)] if a["bias"] else [])


def _layernorm_output(a: dict) -> list[tuple]:
    """return_layernorm_output: the norm's output handed out (TE returns (out, ln_out))."""
    return [("MakeExtraOutput", {"in_place": False}, "layer_norm_output")] if a["return_layernorm_output"] else []


def _layernorm_linear(a: dict) -> list[tuple]:
    return [_norm(a, a["in_features"]), *_layernorm_output(a), *_linear(a, "", a["in_features"], a["out_features"])]


register(OpDef(
    "LayerNormLinear", "container", modules=TE_MODULES,
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features), _EPS,
          _parallel("sequence_parallel", "bool", False), _WGRAD, _parallel("tp_group", "object", None),
          _parallel("tp_size", "int", 1), _TRACKER, _refuse("init_method", "object", None, _INIT), _BIAS,
          _NORMALIZATION, _RETURN_BIAS, _PARAMS_DTYPE, _parallel("parallel_mode", "object", None), _RETURN_LN,
          _hint("return_layernorm_output_gathered", "bool", False),
          _refuse("parameters_split", "object", None,
                  "splits the weight into parameters of other names, which fusegen does not lay out yet (the "
                  "MultiheadAttention part of issue 39); leave it out"),
          _ZCG, _DEVICE, *_UB, *reversed(_UB_BULK), _hint("ub_name", "str", None), _DELAY, _SYMMETRIC_AR,
          _NAME),
    expand=_layernorm_linear,
    summary="TE's module: LayerNorm or RMSNorm (layer_norm_weight, layer_norm_bias), then Linear (weight, bias)",
))


def _layernorm_mlp(a: dict) -> list[tuple]:
    hidden, ffn, activation = a["hidden_size"], a["ffn_hidden_size"], a["activation"]
    fc1_out = 2 * ffn if activation in GATED else ffn
    return [_norm(a, hidden), *_layernorm_output(a), *_linear(a, "fc1", hidden, fc1_out),
            (ACTIVATIONS[activation], {}, "activation"), *_linear(a, "fc2", ffn, hidden)]


register(OpDef(
    "LayerNormMLP", "container", modules=TE_MODULES,
    args=(Arg("hidden_size", "int", check=check_features), Arg("ffn_hidden_size", "int", check=check_features), _EPS,
          _parallel("sequence_parallel", "bool", False), _RETURN_BIAS, _TRACKER, _parallel("tp_group", "object", None),
          _parallel("tp_size", "int", 1), _refuse("init_method", "object", None, _INIT), _BIAS, _NORMALIZATION,
          Arg("activation", "str", "gelu", check=lambda v: None if v in ACTIVATIONS else (
              f"must be one of TE's activations: {', '.join(ACTIVATIONS)}; got {v!r}")),
          _refuse("activation_params", "object", None,
                  "is a dict of clamped_swiglu's constants, which fusegen reads only at TE's defaults (limit=7.0, "
                  "alpha=1.702, glu_linear_offset=1.0); for others write te.ops.ClampedSwiGLU(limit=...) between "
                  "te.ops.Linear ops in the Sequential"),
          _refuse("output_layer_init_method", "object", None, _INIT), _WGRAD, _PARAMS_DTYPE, _RETURN_LN,
          _hint("return_layernorm_output_gathered", "bool", False), _hint("seq_length", "int", None),
          _hint("micro_batch_size", "int", None), _parallel("set_parallel_mode", "bool", False), _ZCG, _DEVICE,
          _UB[0], _NAME, *_UB[1:], *_UB_BULK, _DELAY, _SYMMETRIC_AR, _hint("checkpoint", "bool", False)),
    expand=_layernorm_mlp,
    summary="TE's module: LayerNorm or RMSNorm (layer_norm_weight, layer_norm_bias), fc1 (fc1_weight, fc1_bias; "
            "twice ffn_hidden_size for a gated activation), the activation, fc2 (fc2_weight, fc2_bias)",
))
