"""Bias: y = x + b, a learned vector over the last dim.

Fused kernels apply it as fg::Add with the bias as a per-column operand, and sum its gradient
over rows as deterministic per-block partials. The reference functions below are shipped by
source into the output's ``_reference.py`` (ops/shipped.py): they may use only ``torch``,
``math`` and other shipped functions.
"""

from .opdef import DEVICE, DTYPE, TENSOR_PARALLEL, TENSOR_PARALLEL_GROUP, Arg, OpDef, Operand, Param, check_features, register


def bias(x, b):
    return x + b


def bias_bwd(x, b, dy):
    """(dx, db) elementwise: both are dy (the caller sums db over rows)."""
    return dy, dy


register(OpDef(
    "Bias", "bias",
    args=(Arg("size", "int", check=check_features), DEVICE, DTYPE, TENSOR_PARALLEL, TENSOR_PARALLEL_GROUP),
    params=(Param("bias", lambda a: (a["size"],), lambda a: "zeros"),),
    fixed_in=lambda a: a["size"],
    tag=lambda a: "bias",
    device_struct="fg::Add", operand=Operand("param", "column", grad="column"),
    reference=(bias, bias_bwd),
    summary="y = x + b",
    changes_grad=False,
))
