"""Linear layers: BasicLinear (y = x W^T) and Linear (BasicLinear followed by Bias).

GEMMs run in cuBLAS through torch (the gemm stages), so these ops have no device functor.
The reference functions below are shipped by source into the output's ``_reference.py``
(ops/shipped.py): they may use only ``torch``, ``math`` and other shipped functions.
"""

from .lazy import torch
from .opdef import DEVICE, DTYPE, LINEAR_PARALLEL, Arg, OpDef, Param, check_features, register

# TE's accumulate_into_main_grad: the weight gradient is added into ``weight.main_grad``.
MAIN_GRAD = Arg("accumulate_into_main_grad", "bool", False, keyword_only=True, in_kernel=False)


def linear(x, weight):
    return x @ weight.t()


def linear_bwd(dy, x, weight):
    """(dx, dweight) of y = x W^T for 2-D x, dy."""
    return dy @ weight, dy.t() @ x


def accumulate_into_main_grad(weight, dy, x, alpha=1.0):
    """TE's accumulate_into_main_grad (catalog 2.1): dW = alpha dy^T x is added into ``weight.main_grad``
    in that tensor's dtype (float32, as Megatron keeps it). Returns what autograd gets as the
    weight's grad: with Megatron's ``grad_added_to_main_grad`` attribute, that flag set and a
    placeholder (zeros when ``weight.zero_out_wgrad``), else None."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(
            "a Linear with accumulate_into_main_grad=True adds its weight gradient into weight.main_grad, "
            "but the weight has no main_grad: set weight.main_grad to a tensor of the weight's shape "
            "(usually float32, zeroed per step) before backward, as Megatron's DDP does")
    if tuple(main_grad.shape) != tuple(weight.shape):
        raise RuntimeError(f"weight.main_grad has shape {list(main_grad.shape)}, but the weight is "
                           f"{list(weight.shape)}; give it the weight's shape")
    main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype), alpha=alpha)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    placeholder = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return placeholder(weight.shape, dtype=weight.dtype, device=weight.device)


register(OpDef(
    "BasicLinear", "linear",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          DEVICE, DTYPE, *LINEAR_PARALLEL, MAIN_GRAD),
    params=(Param("weight", lambda a: (a["out_features"], a["in_features"]), lambda a: "kaiming_uniform"),),
    fixed_in=lambda a: a["in_features"],
    out_features=lambda a, n: a["out_features"],
    reference=(linear, linear_bwd), reference_helpers=(accumulate_into_main_grad,),
    summary="y = x W^T",
    needs_input_in_backward=True,
))
register(OpDef(
    "Linear", "container",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          Arg("bias", "bool", True, keyword_only=True), DEVICE, DTYPE, *LINEAR_PARALLEL, MAIN_GRAD),
    expand=lambda a: [("BasicLinear", {"in_features": a["in_features"], "out_features": a["out_features"],
                                       "device": a["device"], "dtype": a["dtype"],
                                       **{arg.name: a[arg.name] for arg in LINEAR_PARALLEL},
                                       "accumulate_into_main_grad": a["accumulate_into_main_grad"]}, "")]
    + ([("Bias", {"size": a["out_features"], "device": a["device"], "dtype": a["dtype"]}, "")] if a["bias"] else []),
    summary="BasicLinear followed by Bias",
))
