"""Identity: y = x. A view in the graph IR; the planner's chain (pipeline.py) drops it (it would
only break fusion windows), so it has no reference math and no functor."""

from .opdef import OpDef, register

register(OpDef("Identity", "identity", summary="y = x", changes_value=False, changes_grad=False, view=True))
