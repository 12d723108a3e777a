"""ConstantScale: y = scale * x, the scale a compile-time constant of the fused kernel.

Its functor is fg::Scale in templates/cuda/activations.cuh, constructed from ``device_args``. The
reference functions below are shipped by source into the output's ``_reference.py``
(ops/shipped.py): they may use only ``torch``, ``math`` and other shipped functions.
"""

from .opdef import Arg, OpDef, check_finite, float_tag, register


def constant_scale(x, scale):
    return x * scale


def constant_scale_bwd(x, dy, scale):
    return dy * scale


register(OpDef(
    "ConstantScale", "scale",
    args=(Arg("scale", "float", check=check_finite),),
    tag=lambda a: "scale" + float_tag(a["scale"]),
    device_struct="fg::Scale", device_args=lambda a: (a["scale"],),
    reference=(constant_scale, constant_scale_bwd),
    summary="y = scale * x",
))
