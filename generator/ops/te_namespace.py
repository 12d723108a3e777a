"""The ``te.`` spellings of the design note: ``import transformer_engine.pytorch as te`` and
``te.Sequential(te.RMSNorm(4096), te.Linear(4096, 6144, bias=False), te.SwiGLU(), ...)``.

fusegen reads every te.ops op spelled from ``transformer_engine.pytorch`` as that te.ops op, with
te.ops' signature and meaning (opdef.SPEC_MODULES lists the module, so the registry's ``op_named``
and the frontend's scope find them there). In real Transformer Engine, ``te.Linear``,
``te.LayerNorm`` and ``te.RMSNorm`` are TE's monolithic modules, whose constructors take further
arguments; fusegen does not support those modules yet (issue 39), so an argument only they take is
refused here by name rather than read with a meaning it does not have.
"""

from __future__ import annotations

TE_NAMESPACE = "transformer_engine.pytorch"

_NORM_MODULE_ONLY = ("hidden_size", "params_dtype", "sequence_parallel")

# Arguments of TE's modules (transformer_engine/pytorch/module/) that te.ops' op of the same name
# does not take, by the name the spec spells: a spec giving one means TE's module.
MODULE_ONLY_ARGS: dict[str, tuple[str, ...]] = {
    "Linear": ("fuse_wgrad_accumulation", "tp_group", "tp_size", "get_rng_state_tracker",
               "rng_tracker_name", "init_method", "return_bias", "params_dtype", "parallel_mode", "parameters_split",
               "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name",
               "delay_wgrad_compute", "symmetric_ar_type", "save_original_input", "name"),
    "LayerNorm": _NORM_MODULE_ONLY,
    "RMSNorm": _NORM_MODULE_ONLY,
}

# TE's modules in the te. namespace with no te.ops op of their name: a spec naming one gets this.
MODULES_NOT_YET = dict.fromkeys(
    ("LayerNormLinear", "LayerNormMLP", "TransformerLayer", "MultiheadAttention"),
    "TE's monolithic modules are not supported yet (issue 39); write its te.ops ops in the Sequential instead "
    "(LayerNormLinear: te.LayerNorm(...), te.Linear(...))")


# What to write instead, where te.ops' op has the argument under another name
INSTEAD = {"params_dtype": "give dtype= instead", "hidden_size": "give the size as normalized_shape instead"}


def module_only_argument(module: str, attribute: str, argument: str) -> str | None:
    """Why ``argument`` of ``<module>.<attribute>(...)`` is refused (it belongs to TE's monolithic
    module of that name, not to the te.ops op fusegen reads the spelling as), or None."""
    if module != TE_NAMESPACE or argument not in MODULE_ONLY_ARGS.get(attribute, ()):
        return None
    return (f"te.{attribute}(): '{argument}' is an argument of Transformer Engine's monolithic module "
            f"te.{attribute}, which fusegen does not support yet (issue 39); fusegen reads te.{attribute} as "
            f"te.ops.{attribute}, whose arguments it takes: {INSTEAD.get(argument, f'leave {argument!r} out')}")
