"""Identity: y = x. The pipeline builder drops it (it would only break fusion windows), so it has
no reference math and no functor."""

from .opdef import OpDef, register

register(OpDef("Identity", "identity", summary="y = x", changes_value=False, changes_grad=False))
