"""TE's row-scaled activations (catalog 2.6; MoE routing "probs"): ScaledSwiGLU, ScaledSReLU,
ScaledSiTUGLU, ScaledClampedQGeGLU. One extra input, the per-row scales ``s`` of shape [rows] (the
output's shape without its last dim): y = f(x) * s[row], ds[row] = sum_j dy * f(x).

Each is a container of two basic ops: the activation (with its glu_interleave_size and constants)
and ``RowScale``, a product with a per-row operand whose gradient is reduced over the row. So the
scale fuses into the activation's elementwise kernel, and the kernels take the activation from the
registry; RowScale is fusegen's own, not importable from a spec. ``activation_recompute_in_mlp``
only matters inside TE's grouped MLP, where fusegen does not run these yet: it must be False.
"""

from .opdef import Arg, OpDef, Operand, check_finite, check_positive_finite, register

# positional here, as in TE's row-scaled ops (keyword-only in the plain GLUs)
INTERLEAVE = Arg("glu_interleave_size", "int", None, check=lambda v: None if v > 0 else "must be positive")


def row_scale(x, s):
    """s: one scale per row, broadcast over the row (its last dim)."""
    return x * s


def row_scale_bwd(x, s, dy):
    """(dx, ds) elementwise: ds is summed over each row by the caller."""
    return dy * s, dy * x


register(OpDef(
    "RowScale", "row_scale", modules=(),  # built by the Scaled* containers only
    tag=lambda a: "rowscale", device_struct="fg::RowScale",
    operand=Operand("extra_input", "row", grad="row", read_in_backward=True),
    reference=(row_scale, row_scale_bwd), extra_inputs=1, needs_input_in_backward=True,
    summary="y = x * s[row] (s: an extra input of one scale per row)",
))

RECOMPUTE = Arg("activation_recompute_in_mlp", "bool", False, keyword_only=True, in_kernel=False,
                check=lambda v: ("must be False: it applies only inside TE's fused grouped MLP, which fusegen does "
                                 "not generate yet") if v else None)


def _scaled(name, activation, args, activation_args, summary):
    register(OpDef(
        name, "container", args=args,
        expand=lambda a: [(activation, activation_args(a), ""), ("RowScale", {}, "")],
        summary=summary,
    ))


_scaled("ScaledSwiGLU", "SwiGLU", (INTERLEAVE, RECOMPUTE),
        lambda a: {"glu_interleave_size": a["glu_interleave_size"]}, "SwiGLU(x) * s[row]")
_scaled("ScaledSReLU", "SReLU", (RECOMPUTE,), lambda a: {}, "SReLU(x) * s[row]")
_scaled("ScaledSiTUGLU", "SiTUGLU",
        (INTERLEAVE, RECOMPUTE, Arg("beta1", "float", 4.0, keyword_only=True, check=check_positive_finite),
         Arg("beta2", "float", 25.0, keyword_only=True, check=check_positive_finite)),
        lambda a: {"glu_interleave_size": a["glu_interleave_size"], "beta1": a["beta1"], "beta2": a["beta2"]},
        "SiTUGLU(x) * s[row]")
_scaled("ScaledClampedQGeGLU", "ClampedSwiGLU",
        (INTERLEAVE, RECOMPUTE, Arg("limit", "float", 7.0, keyword_only=True, check=check_positive_finite),
         Arg("alpha", "float", 1.702, keyword_only=True, check=check_finite),
         Arg("glu_linear_offset", "float", 1.0, keyword_only=True, check=check_finite)),
        lambda a: {"glu_interleave_size": a["glu_interleave_size"], "limit": a["limit"], "alpha": a["alpha"],
                   "glu_linear_offset": a["glu_linear_offset"]},
        "ClampedSwiGLU(x) * s[row] (cuDNN's geglu numerics)")
