"""Extra inputs and outputs of a pipeline: AddExtraInput (y = x + r) and MakeExtraOutput (y = x,
and x again as an extra output), TE's residual connections.

AddExtraInput runs in fused kernels as fg::Add with the extra input as a per-element operand;
MakeExtraOutput is a tee (its value handed out, its grad added), which needs no backward
reference. The reference functions below are shipped by source into the output's
``_reference.py`` (ops/shipped.py): they may use only ``torch``, ``math`` and other shipped
functions.

``in_place``: TE's ``MakeExtraOutput(in_place=True)`` accumulates the output grad into the extra
output's grad buffer in place; the values and grads are those of ``in_place=False``, so fusegen
accepts it and adds out of place. ``AddExtraInput(in_place=True)`` writes the sum into the
caller's extra input tensor, which fusegen's generated modules never do: refused with that reason.
"""

from .opdef import Arg, OpDef, Operand, register

_ADD_IN_PLACE = Arg(
    "in_place", "bool", False, keyword_only=True,
    check=lambda v: ("must be False: fusegen never writes into the caller's tensors (TE's in_place=True adds into "
                     "the extra input); drop in_place") if v else None,
)
_TEE_IN_PLACE = Arg("in_place", "bool", False, keyword_only=True, in_kernel=False)  # same values and grads


def add_extra_input(x, r):
    return x + r


def add_extra_input_bwd(x, r, dy):
    """(dx, dr): both are dy."""
    return dy, dy


def make_extra_output(x):
    return x


register(OpDef(
    "AddExtraInput", "add_extra_input",
    args=(_ADD_IN_PLACE,),
    tag=lambda a: "add",
    device_struct="fg::Add", operand=Operand("extra_input", "element", grad="element"),
    reference=(add_extra_input, add_extra_input_bwd),
    summary="y = x + r (r is an extra input)", extra_inputs=1, changes_grad=False,
))
register(OpDef(
    "MakeExtraOutput", "make_extra_output",
    args=(_TEE_IN_PLACE,),
    tag=lambda a: "tee",
    reference=(make_extra_output, None),
    summary="y = x, and x again as an extra output", extra_outputs=1, changes_value=False,
))
