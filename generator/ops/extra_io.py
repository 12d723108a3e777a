"""Extra inputs and outputs of a pipeline: AddExtraInput (y = x + r) and MakeExtraOutput (y = x,
and x again as an extra output), TE's residual connections.

AddExtraInput runs in fused kernels as fg::Add with the extra input as a per-element operand;
MakeExtraOutput is a tee (its value handed out, its grad added), which needs no backward
reference. The reference functions below are shipped by source into the output's
``_reference.py`` (ops/shipped.py): they may use only ``torch``, ``math`` and other shipped
functions.

``in_place``: TE's ``MakeExtraOutput(in_place=True)`` accumulates the output grad into the extra
output's grad buffer in place; the values and grads are those of ``in_place=False``, so fusegen
accepts it and adds out of place. ``AddExtraInput(in_place=True)`` also writes the sum into the
caller's extra input tensor (catalog 2.10: ``r += x``, the caller's tensor is mutated):
``writes_back``, the sum is a hidden extra output of the fused stages that the generated module
copies into that tensor after the forward. Values and grads are those of ``in_place=False``.
"""

from .opdef import Arg, OpDef, Operand, register

_IN_PLACE = Arg("in_place", "bool", False, keyword_only=True, in_kernel=False)  # same values and grads


def add_extra_input(x, r):
    return x + r


def add_extra_input_bwd(x, r, dy):
    """(dx, dr): both are dy."""
    return dy, dy


def make_extra_output(x):
    return x


register(OpDef(
    "AddExtraInput", "add_extra_input",
    args=(_IN_PLACE,), writes_back=lambda a: a["in_place"],
    tag=lambda a: "add",
    device_struct="fg::Add", operand=Operand("extra_input", "element", grad="element"),
    reference=(add_extra_input, add_extra_input_bwd),
    summary="y = x + r (r is an extra input)", extra_inputs=1, changes_grad=False,
))
register(OpDef(
    "MakeExtraOutput", "make_extra_output",
    args=(_IN_PLACE,),
    tag=lambda a: "tee",
    reference=(make_extra_output, None),
    summary="y = x, and x again as an extra output", extra_outputs=1, changes_value=False,
))
