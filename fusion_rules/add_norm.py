"""Forward: AddExtraInput, [MakeExtraOutput], LayerNorm|RMSNorm → one residual-add + norm kernel.

The kernel reads x and the residual, writes h = x + r (the residual stream: MakeExtraOutput's
extra output, and the norm input saved for backward) and norm(h).
"""

from fusegen.plan import FORWARD, Rule
from fusegen.stages import NORM

FORWARD_ADD_NORM = Rule(
    name="add_norm", pass_=FORWARD, stage=NORM,
    doc="residual add fused into the norm kernel; the sum is written once for the residual stream",
    pattern=("add_extra_input", "make_extra_output?", "norm"),
)
