"""Bias: y = x + b, a learned vector over the last dim.

Fused kernels add it inline (no functor: the bias is a tensor operand, not a constant) and sum its
gradient over rows as deterministic per-block partials. The reference functions below are shipped
by source into the output's ``_reference.py`` (ops/shipped.py): they may use only ``torch``,
``math`` and other shipped functions.
"""

from .opdef import Arg, OpDef, Param, check_features, register


def bias(x, b):
    return x + b


def bias_bwd(dy):
    """Bias gradient: the column sum of dy over all rows (dx is dy itself)."""
    return dy.reshape(-1, dy.shape[-1]).sum(0)


register(OpDef(
    "Bias", "bias",
    args=(Arg("size", "int", check=check_features),),
    params=(Param("bias", lambda a: (a["size"],), lambda a: "zeros"),),
    fixed_in=lambda a: a["size"],
    tag=lambda a: "bias",
    reference=(bias, bias_bwd),
    summary="y = x + b",
    changes_grad=False,
))
