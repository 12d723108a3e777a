"""The ``te.`` spellings of the design note: ``import transformer_engine.pytorch as te`` and
``te.Sequential(te.RMSNorm(4096), te.Linear(4096, 6144, bias=False), te.SwiGLU(), ...)``.

fusegen reads every te.ops op spelled from ``transformer_engine.pytorch`` as that te.ops op, with
te.ops' signature and meaning (opdef.SPEC_MODULES lists the module, so the registry's ``op_named``
and the frontend's scope find them there). In real Transformer Engine, ``te.Linear``,
``te.LayerNorm`` and ``te.RMSNorm`` are TE's monolithic modules, whose constructors take further
arguments and another positional order: the te. spelling binds positional arguments in TE's order
(``MODULE_POSITIONAL``), reads TE's names for te.ops' arguments as those (``MODULE_KEYWORDS``:
``params_dtype`` is ``dtype``, a norm's ``hidden_size`` its ``normalized_shape``, te.Linear's
``fuse_wgrad_accumulation`` te.ops' ``accumulate_into_main_grad``, its ``tp_group`` te.ops'
``tensor_parallel_group``; its ``parallel_mode`` and ``tp_size`` are arguments of the Linear op that
only this spelling gives: ops/linear.py, tensor_parallel.py), and accepts the arguments only
TE's module takes where they change nothing fusegen computes (``MODULE_ONLY_ARGS``: TE's no-ops at
any value, the others at TE's default; another value is refused with why). TE's modules with no
te.ops op of their name (``te.LayerNormMLP``, ...) are macros (ops/te_modules.py), or refused
as ops of a Sequential with why (``MODULES_NOT_YET``: te.DotProductAttention).
"""

from __future__ import annotations

TE_NAMESPACE = "transformer_engine.pytorch"

ANY = object()  # a module-only argument accepted at any value (TE's no-op without parallelism or FP8)
_INIT = ("is an initialiser, which a spec cannot carry (fusegen never runs it): fusegen initialises the parameters "
         "as te.ops does; load a checkpoint or initialise them after construction, and leave it out")

# Arguments of TE's modules (transformer_engine/pytorch/module/linear.py, layernorm.py, rmsnorm.py)
# that te.ops' op of the same name does not take, by the name the spec spells: each accepted at
# any value (ANY: what TE ignores without tensor parallelism, userbuffers or FP8, and names), or
# at TE's default only, another value refused with why (a spec giving one means TE's module).
MODULE_ONLY_ARGS: dict[str, dict[str, tuple[object, str]]] = {
    "Linear": {
        "get_rng_state_tracker": (None, _INIT),
        "rng_tracker_name": (ANY, ""), "init_method": (None, _INIT),
        "return_bias": (False, "returns the bias unadded beside the output, which fusegen's module does not; give "
                               "bias=False and add a te.ops.Bias after it in the Sequential instead"),
        "parameters_split": (None, "splits the weight into parameters of other names, which fusegen's te.Linear "
                                   "does not hold; leave it out (te.LayerNormLinear's parameters_split and "
                                   "te.MultiheadAttention's fuse_qkv_params=False are read)"),
        **{name: (ANY, "") for name in ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad",
                                        "ub_bulk_wgrad", "ub_name", "save_original_input", "name")},
        "delay_wgrad_compute": (False, "defers the weight grads to a backward_dw() call, which fusegen's module "
                                       "does not have; leave it False"),
        "symmetric_ar_type": (ANY, "")},  # how TE all-reduces (symmetric memory): fusegen's runtime chooses
    "LayerNorm": {"sequence_parallel": (ANY, "")},  # TE: a flag for Megatron-LM, read by nothing in the module
    "RMSNorm": {"sequence_parallel": (ANY, "")},
}

# The order TE's modules take positional arguments in (their __init__), where it differs from
# te.ops' op of the name: ``te.LayerNorm(4096, 1e-6)`` is eps=1e-6, as in TE
MODULE_POSITIONAL: dict[str, tuple[str, ...]] = {
    "Linear": ("in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size",
               "get_rng_state_tracker", "rng_tracker_name", "init_method", "bias", "return_bias", "params_dtype",
               "parallel_mode", "parameters_split", "device"),
    "LayerNorm": ("normalized_shape", "eps", "sequence_parallel", "params_dtype", "zero_centered_gamma",
                  "hidden_size"),
    "RMSNorm": ("normalized_shape", "eps", "sequence_parallel", "params_dtype", "zero_centered_gamma",
                "hidden_size"),
}

# Arguments of TE's modules read as te.ops' argument of the same meaning, by the te. spelling
_PARAMS_DTYPE = {"params_dtype": "dtype"}
MODULE_KEYWORDS: dict[str, dict[str, str]] = {
    "Linear": {**_PARAMS_DTYPE, "fuse_wgrad_accumulation": "accumulate_into_main_grad",
               "tp_group": "tensor_parallel_group"},
    "LayerNorm": {**_PARAMS_DTYPE, "hidden_size": "normalized_shape"},
    "RMSNorm": {**_PARAMS_DTYPE, "hidden_size": "normalized_shape"},
}

# TE's modules in the te. namespace with no te.ops op of their name and no macro (TE's others are
# macros, ops/te_modules.py and te_layer.py): a spec calling one as an op of its Sequential gets this.
MODULES_NOT_YET = {
    "DotProductAttention": (
        "TE's core attention takes query, key and value (three inputs), which an op of a Sequential (one running "
        "value) is not; write te.MultiheadAttention (its QKV projection, this attention and the output "
        "projection), or after the QKV projection te.GroupedQueryAttention(hidden, heads, kv_heads, "
        "te.DotProductAttention), which names it as its backend"),
}


def module_keyword(module: str, attribute: str, argument: str) -> str:
    """The te.ops argument a keyword of ``<module>.<attribute>(...)`` gives: a TE module's name for
    it where the te. spelling reads it (``params_dtype``: ``dtype``), else the keyword itself."""
    return MODULE_KEYWORDS.get(attribute, {}).get(argument, argument) if module == TE_NAMESPACE else argument


def module_positional(module: str, attribute: str) -> tuple[str, ...] | None:
    """The names TE's module ``<module>.<attribute>`` gives its positional arguments, in order, or
    None where the spelling is not one of TE's modules with an order of its own."""
    return MODULE_POSITIONAL.get(attribute) if module == TE_NAMESPACE else None


def module_only_argument(module: str, attribute: str, argument: str) -> tuple[object, str] | None:
    """(TE's default, why another value is refused) for an ``argument`` of ``<module>.<attribute>(...)``
    that only TE's monolithic module of that name takes (default ANY: accepted at any value), or
    None where te.ops' op takes it."""
    if module != TE_NAMESPACE:
        return None
    return MODULE_ONLY_ARGS.get(attribute, {}).get(argument)
