"""A module from the user's code between fusible ops (TE's Sequential runs any ``nn.Module`` as an
opaque block between fused groups): ``from mymodel.layers import Attention`` then
``Attention(64, heads=4)`` in a Sequential, with literal arguments.

The frontend makes the call a ``Module`` op (``target``: where the class is imported from;
``call``: the call as written; ``positional``/``keywords``: its folded arguments). The generated
module constructs it (importing ``target`` when the module is built, so the package imports
without it), owns its parameters under the Sequential's index, and runs it unfused between the
fused stages (stages/module.py), on the running tensor with its leading dims; fusegen cannot see
inside, so it must keep the tensor's shape (checked at run time), and the ops around it fix the
feature size.
"""

from .opdef import Arg, OpDef, register

register(OpDef(
    "Module", "module", modules=(),  # made by the frontend for calls of the user's classes
    args=(Arg("target", "str"), Arg("call", "str")), user_module=True,
    tag=lambda a: "module", summary="a module of the user's code, run as it is between fused stages",
))
