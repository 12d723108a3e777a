"""Views: ops that move no data.

Identity: y = x. A view in the graph IR; the planner's chain (pipeline.py) drops it (it would only
break fusion windows), so it has no reference math and no functor.

Reshape(shape): y = x.reshape(shape) (catalog 2.9), backward the grad reshaped back. The running
tensor's last dim becomes ``shape[-1]`` and its leading dims ``shape[:-1]`` (one may be -1); its
stage (stages/reshape.py) reshapes the 2-D [rows, features] tensors fused stages work on, and the
generated module gives its outputs the leading dims the reshape made. As in TE it breaks fusion
windows.
"""

from .opdef import MAX_FEATURES, Arg, OpDef, register

register(OpDef("Identity", "identity", summary="y = x", changes_value=False, changes_grad=False, view=True))


def _check_shape(shape):
    if shape.count(-1) > 1:
        return "may hold -1 at most once (the one size torch infers)"
    if any(d < -1 or d == 0 for d in shape):
        return "must hold positive sizes (and at most one -1)"
    if shape[-1] == -1:
        return ("must give its last dim (the feature size the ops after it see); put the -1 in a leading "
                "dim, e.g. Reshape((-1, 64))")
    if shape[-1] > MAX_FEATURES:
        return f"must give a last dim of at most {MAX_FEATURES} (fusegen's bound on feature sizes)"
    return None


register(OpDef(
    "Reshape", "reshape", args=(Arg("shape", "dims", check=_check_shape),),
    fixed_out=lambda a: a["shape"][-1], out_features=lambda a, n: a["shape"][-1], reshape=lambda a: a["shape"],
    tag=lambda a: "reshape", summary="y = x.reshape(shape)", changes_value=False, changes_grad=False,
))
