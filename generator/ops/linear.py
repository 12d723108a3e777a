"""Linear layers: BasicLinear (y = x W^T) and Linear (BasicLinear followed by Bias).

GEMMs run in cuBLAS through torch (the gemm stages), so these ops have no device functor.
The reference functions below are shipped by source into the output's ``_reference.py``
(ops/shipped.py): they may use only ``torch``, ``math`` and other shipped functions.
"""

from .opdef import DEVICE, DTYPE, Arg, OpDef, Param, check_features, register


def linear(x, weight):
    return x @ weight.t()


def linear_bwd(dy, x, weight):
    """(dx, dweight) of y = x W^T for 2-D x, dy."""
    return dy @ weight, dy.t() @ x


register(OpDef(
    "BasicLinear", "linear",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          DEVICE, DTYPE),
    params=(Param("weight", lambda a: (a["out_features"], a["in_features"]), lambda a: "kaiming_uniform"),),
    fixed_in=lambda a: a["in_features"],
    out_features=lambda a, n: a["out_features"],
    reference=(linear, linear_bwd),
    summary="y = x W^T",
    needs_input_in_backward=True,
))
register(OpDef(
    "Linear", "container",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          Arg("bias", "bool", True, keyword_only=True), DEVICE, DTYPE),
    expand=lambda a: [("BasicLinear", {"in_features": a["in_features"], "out_features": a["out_features"],
                                       "device": a["device"], "dtype": a["dtype"]}, "")]
    + ([("Bias", {"size": a["out_features"], "device": a["device"], "dtype": a["dtype"]}, "")] if a["bias"] else []),
    summary="BasicLinear followed by Bias",
))
