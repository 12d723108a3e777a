"""The op registry: every operation a spec can name, one module per op family.

An ``OpDef`` owns everything about its op, and every other stage reads it from ``OPS``: the
frontend (constructor signatures and argument checks), the pipeline builder (feature-size rules,
parameters), the planner (what kind of stage an op can join), the kernel specs (tag, device
functor and its constants), fusegen's eager ``Sequential`` and the output's ``_reference.py``
(the op's reference forward and backward, copied by source: ops/shipped.py).

The compiler never imports torch, and it imports this package: op modules name torch through
``from .lazy import torch``, imported when a reference function first runs.

How to add an elementwise op (an op is one entry):
  1. In its family module (activations.py, glu.py, ... or a new module, named in ``FAMILIES``
     below where ``OPS`` should list it): the reference forward and backward as module-level
     functions, fp32 math matching the kernel's, then one ``register(OpDef(...))`` naming them in
     ``reference``, its ``tag``, its ``device_struct`` and, for arguments the kernel needs, its
     ``args`` with checks and ``device_args``. The functions are shipped by source: they may read
     only torch, math, ``compute`` and the functions the op ships (``reference_helpers``), which
     ``register`` checks.
  2. One functor in templates/cuda/activations.cuh, named by ``device_struct``: fwd/bwd taking
     the constants as fields in ``device_args`` order.
  3. Its tests: CPU and GPU against an independent float64 reference (tests/references.py,
     tests/ops/test_activation_ops.py); tests/ops/test_ops_registry.py checks the entry's shape.
Nothing else changes: templates, emit, planner and the eager module have no per-op code for it.
"""

from __future__ import annotations

import importlib

from . import shipped
from .held_rows import HeldRows
from .opdef import (FLOAT32_MAX, FLOAT32_MIN_NORMAL, MAX_FEATURES, MAX_NORM_FEATURES, OPS, REQUIRED,
                    SPEC_MODULES, Arg, OpDef, Operand, Param, float_tag, register)

# The family modules register their ops when imported, so this order is the order of OPS (and of
# _reference.py); imported by name so that no import sorter can reorder them.
FAMILIES = tuple(importlib.import_module(f".{name}", __name__) for name in (
    "linear", "bias", "norms", "activations", "glu", "row_scaled", "scale", "dropout", "extra_io", "identity",
    "attention", "collectives", "torch_nn", "te_modules", "te_layer", "module"))

# Spellings a spec may use for the pipeline container, and the modules it comes from.
SEQUENTIAL = "Sequential"
SEQUENTIAL_MODULES = (*SPEC_MODULES, "torch.nn")
# The residual container, y = x + ops(x): data flow, not an op (ir.py expands it into its ops
# between a tee and an add joined by one value); spelled where the ops are (te.ops, te. as
# Transformer Engine's design note writes it, fusegen.eager); torch.nn has none.
RESIDUAL = "Residual"
RESIDUAL_MODULES = SPEC_MODULES


def elementwise_kinds() -> frozenset[str]:
    """Kinds of the ops that run in fused elementwise kernels (those with a ``functor_form``),
    plugins' included."""
    return frozenset(op.kind for op in OPS.values() if op.functor_form is not None)


# te.ops operations fusegen does not generate yet, and why: a spec naming one gets this, not "unknown op".
NOT_YET = {
    "GroupedLinear": "grouped (MoE expert) GEMMs are not supported yet",
}


def op_modules() -> tuple[str, ...]:
    """Every module a spec may import ops from: Transformer Engine's, fusegen's, plugins'."""
    return tuple(dict.fromkeys([*SPEC_MODULES, *(m for op in OPS.values() for m in op.modules)]))


def op_named(module: str, attribute: str) -> str | None:
    """The registry name of the op ``from <module> import <attribute>`` gives a spec (SEQUENTIAL
    for the container, RESIDUAL for the residual container), or None."""
    if attribute == SEQUENTIAL:
        return SEQUENTIAL if module in SEQUENTIAL_MODULES else None
    if attribute == RESIDUAL:
        return RESIDUAL if module in RESIDUAL_MODULES else None
    return next((name for name, op in OPS.items() if op.attribute == attribute and module in op.modules), None)


def part_attribute(part: str, name: str) -> str:
    """A basic op's parameter as its spec-level op holds it: ``fc1_weight`` for the weight of a
    te.LayerNormMLP's part "fc1" (TE's names); the parameter's own name where the part is "". A
    part inside one of TE's submodules names it before a dot (te.MultiheadAttention's
    "layernorm_qkv.layer_norm" gives ``layernorm_qkv.layer_norm_weight``, "proj." ``proj.weight``):
    the holder has that submodule (``part_submodule``)."""
    submodule, _, prefix = part.rpartition(".")
    attribute = f"{prefix}_{name}" if prefix else name
    return f"{submodule}.{attribute}" if submodule else attribute


def part_submodule(part: str) -> str:
    """The TE submodule a part lies in ("layernorm_qkv" of "layernorm_qkv.layer_norm"), or ""."""
    return part.rpartition(".")[0]


def basic_ops(name: str, args: dict) -> list[tuple[OpDef, dict]]:
    """The basic ops a spec-level op stands for (``Linear`` is BasicLinear + Bias)."""
    return [(op, op_args) for op, op_args, _, _ in basic_parts(name, args)]


def basic_parts(name: str, args: dict) -> list[tuple[OpDef, dict, str, HeldRows | None]]:
    """``basic_ops`` with each basic op's part of the spec-level op (``OpDef.expand``'s third
    item: "fc1" of a te.LayerNormMLP, whose parameters are then ``fc1_weight``, ``fc1_bias``;
    "" for most, whose parameters keep their own names) and how the part holds its parameters
    where they are not one tensor each (the optional fourth item: held_rows.HeldRows, else None)."""
    op = OPS[name]
    if op.expand is None:
        return [(op, args, "", None)]
    # arguments an expansion leaves out take their defaults (TE-only arguments of a torch.nn module's op)
    return [(OPS[sub], {**{a.name: a.default for a in OPS[sub].args if a.default is not REQUIRED}, **sub_args},
             part, *(held or (None,)))
            for sub, sub_args, part, *held in op.expand(args)]


def reference_source() -> str:
    """The text of the output package's ``_reference.py`` (plain code with ``import torch``)."""
    return shipped.reference_source(OPS.values())


__all__ = [
    "FLOAT32_MAX", "FLOAT32_MIN_NORMAL", "MAX_FEATURES", "MAX_NORM_FEATURES", "OPS", "REQUIRED", "RESIDUAL",
    "RESIDUAL_MODULES", "SEQUENTIAL", "Arg",
    "SPEC_MODULES", "NOT_YET", "HeldRows", "OpDef", "Operand", "Param", "basic_ops", "basic_parts", "elementwise_kinds",
    "float_tag", "op_named", "part_attribute", "part_submodule",
    "op_modules", "reference_source", "register",
]
