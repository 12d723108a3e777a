"""The ``te.`` spellings of the design note: ``import transformer_engine.pytorch as te`` and
``te.Sequential(te.RMSNorm(4096), te.Linear(4096, 6144, bias=False), te.SwiGLU(), ...)``.

fusegen reads every te.ops op spelled from ``transformer_engine.pytorch`` as that te.ops op, with
te.ops' signature and meaning (opdef.SPEC_MODULES lists the module, so the registry's ``op_named``
and the frontend's scope find them there). In real Transformer Engine, ``te.Linear``,
``te.LayerNorm`` and ``te.RMSNorm`` are TE's monolithic modules, whose constructors take further
arguments: those fusegen gives a meaning are read as te.ops' argument of that meaning
(``MODULE_KEYWORDS``: ``params_dtype`` is ``dtype``, a norm's ``hidden_size`` its
``normalized_shape``, te.Linear's ``fuse_wgrad_accumulation`` te.ops' ``accumulate_into_main_grad``); any other is refused here by name rather than read with a meaning it does
not have. TE's modules with no te.ops op of their name (``te.LayerNormMLP``, ...) are macros
(ops/te_modules.py), or not supported yet (``MODULES_NOT_YET``).
"""

from __future__ import annotations

TE_NAMESPACE = "transformer_engine.pytorch"

_NORM_MODULE_ONLY = ("sequence_parallel",)

# Arguments of TE's modules (transformer_engine/pytorch/module/) that te.ops' op of the same name
# does not take, by the name the spec spells: a spec giving one means TE's module.
MODULE_ONLY_ARGS: dict[str, tuple[str, ...]] = {
    "Linear": ("tp_group", "tp_size", "get_rng_state_tracker",
               "rng_tracker_name", "init_method", "return_bias", "parallel_mode", "parameters_split",
               "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name",
               "delay_wgrad_compute", "symmetric_ar_type", "save_original_input", "name"),
    "LayerNorm": _NORM_MODULE_ONLY,
    "RMSNorm": _NORM_MODULE_ONLY,
}

# Arguments of TE's modules read as te.ops' argument of the same meaning, by the te. spelling
_PARAMS_DTYPE = {"params_dtype": "dtype"}
MODULE_KEYWORDS: dict[str, dict[str, str]] = {
    "Linear": {**_PARAMS_DTYPE, "fuse_wgrad_accumulation": "accumulate_into_main_grad"},
    "LayerNorm": {**_PARAMS_DTYPE, "hidden_size": "normalized_shape"},
    "RMSNorm": {**_PARAMS_DTYPE, "hidden_size": "normalized_shape"},
}

# TE's modules in the te. namespace with no te.ops op of their name and no macro yet (none now: TE's
# modules are macros, ops/te_modules.py and te_layer.py): a spec naming one gets this.
MODULES_NOT_YET = dict.fromkeys(
    (),
    "this TE module is not supported yet (a later part of issue 39); write its ops in the Sequential instead "
    "(te.LayerNormLinear or te.ops ops for the projections, te.ops.MultiHeadedSelfAttention, te.LayerNormMLP)")


def module_keyword(module: str, attribute: str, argument: str) -> str:
    """The te.ops argument a keyword of ``<module>.<attribute>(...)`` gives: a TE module's name for
    it where the te. spelling reads it (``params_dtype``: ``dtype``), else the keyword itself."""
    return MODULE_KEYWORDS.get(attribute, {}).get(argument, argument) if module == TE_NAMESPACE else argument


def module_only_argument(module: str, attribute: str, argument: str) -> str | None:
    """Why ``argument`` of ``<module>.<attribute>(...)`` is refused (it belongs to TE's monolithic
    module of that name, not to the te.ops op fusegen reads the spelling as), or None."""
    if module != TE_NAMESPACE or argument not in MODULE_ONLY_ARGS.get(attribute, ()):
        return None
    return (f"te.{attribute}(): '{argument}' is an argument of Transformer Engine's monolithic module "
            f"te.{attribute} that fusegen gives no meaning yet; fusegen reads te.{attribute} as te.ops.{attribute}, "
            f"whose arguments it takes (and params_dtype=, a norm's hidden_size=): leave {argument!r} out")
