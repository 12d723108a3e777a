"""``torch.nn`` modules that have a te.ops equivalent, as a spec may write them: each is a container
(like ``Linear``) that expands to the te.ops basic ops, so it fuses exactly as they do and keeps
torch's parameter names (``weight``, ``bias``) and state_dict keys.

``nn.GELU`` maps only with ``approximate="tanh"`` (fusegen's GELU is TE's tanh approximation);
``nn.RMSNorm`` needs an explicit ``eps`` (torch's default is the input dtype's machine epsilon,
which a kernel specialised ahead of time cannot know); a LayerNorm or RMSNorm without affine
parameters has no te.ops equivalent. Each refusal is an error at the call, with the reason.
"""

from .opdef import (DEVICE, DTYPE, Arg, OpDef, check_eps, check_features, check_norm_shape, check_probability,
                    register)

TORCH_NN = ("torch.nn",)
_INPLACE = Arg("inplace", "bool", False, in_kernel=False)  # the values are the same either way


def _affine(kind):
    def check(a):
        if not a["elementwise_affine"] or not a.get("bias", True):
            return (f"a {kind} without its affine parameters has no te.ops equivalent; use "
                    "elementwise_affine=True" + (" and bias=True" if "bias" in a else ""))
        return None
    return check


def _norm(name, a):
    return [(name, {"normalized_shape": a["normalized_shape"], "eps": a["eps"], "device": a["device"],
                    "dtype": a["dtype"], "zero_centered_gamma": False, "sm_margin": 0}, "")]


register(OpDef(
    "nn.Linear", "container", modules=TORCH_NN, spelled="Linear",
    args=(Arg("in_features", "int", check=check_features), Arg("out_features", "int", check=check_features),
          Arg("bias", "bool", True), DEVICE, DTYPE),
    expand=lambda a: [("BasicLinear", {"in_features": a["in_features"], "out_features": a["out_features"],
                                       "device": a["device"], "dtype": a["dtype"]}, "")]
    + ([("Bias", {"size": a["out_features"], "device": a["device"], "dtype": a["dtype"]}, "")] if a["bias"] else []),
    summary="torch.nn.Linear: BasicLinear followed by Bias",
))
register(OpDef(
    "nn.LayerNorm", "container", modules=TORCH_NN, spelled="LayerNorm",
    args=(Arg("normalized_shape", "shape", check=check_norm_shape), Arg("eps", "float", 1e-5, check=check_eps),
          Arg("elementwise_affine", "bool", True), Arg("bias", "bool", True), DEVICE, DTYPE),
    validate=_affine("LayerNorm"), expand=lambda a: _norm("LayerNorm", a),
    summary="torch.nn.LayerNorm: LayerNorm",
))
def _rms_norm(a):
    if a["eps"] is None:
        return ("eps=None, torch's default, is the input dtype's machine epsilon, which a kernel specialised "
                "ahead of time cannot know; give eps explicitly (TE's RMSNorm default: eps=1e-5)")
    return _affine("RMSNorm")(a)


register(OpDef(
    "nn.RMSNorm", "container", modules=TORCH_NN, spelled="RMSNorm",
    args=(Arg("normalized_shape", "shape", check=check_norm_shape), Arg("eps", "float", None, check=check_eps),
          Arg("elementwise_affine", "bool", True), DEVICE, DTYPE),
    validate=_rms_norm, expand=lambda a: _norm("RMSNorm", a),
    summary="torch.nn.RMSNorm: RMSNorm (give eps: torch's default depends on the input dtype)",
))
register(OpDef(
    "nn.GELU", "container", modules=TORCH_NN, spelled="GELU",
    args=(Arg("approximate", "str", "none"),),
    validate=lambda a: None if a["approximate"] == "tanh" else (
        f"approximate={a['approximate']!r} is the exact GELU; fusegen's GELU is TE's tanh approximation: write "
        "GELU(approximate='tanh')"),
    expand=lambda a: [("GELU", {"cache_quantized_input": False}, "")],
    summary="torch.nn.GELU(approximate='tanh'): GELU",
))
register(OpDef(
    "nn.SiLU", "container", modules=TORCH_NN, spelled="SiLU", args=(_INPLACE,),
    expand=lambda a: [("SiLU", {"cache_quantized_input": False}, "")], summary="torch.nn.SiLU: SiLU",
))
register(OpDef(
    "nn.ReLU", "container", modules=TORCH_NN, spelled="ReLU", args=(_INPLACE,),
    expand=lambda a: [("ReLU", {"cache_quantized_input": False}, "")], summary="torch.nn.ReLU: ReLU",
))
register(OpDef(
    "nn.Dropout", "container", modules=TORCH_NN, spelled="Dropout",
    args=(Arg("p", "float", 0.5, check=check_probability), _INPLACE),
    expand=lambda a: [("Dropout", {"p": a["p"]}, "")], summary="torch.nn.Dropout: Dropout",
))
register(OpDef(
    "nn.Identity", "container", modules=TORCH_NN, spelled="Identity",
    expand=lambda a: [("Identity", {}, "")], summary="torch.nn.Identity: Identity",
))
