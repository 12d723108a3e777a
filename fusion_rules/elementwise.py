"""A maximal run of elementwise ops → ONE generated kernel per pass.

Forward: bias, activations (GLU included), ConstantScale, AddExtraInput and MakeExtraOutput in one
pass over memory. Backward: one kernel producing the run's input grad, with every Bias gradient
(column sum) fused in as deterministic per-block partials; forward values are recomputed from the
saved run input instead of being saved. A run holds at most one GLU (it halves the width).
"""

from fusegen.ops import ELEMENTWISE_KINDS
from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import ELEMENTWISE


def _run(ops):
    n = glus = 0
    for op in ops:
        if op.kind not in ELEMENTWISE_KINDS:
            break
        glus += op.kind == "glu"
        if glus > 1:
            break
        n += 1
    return n


FORWARD_ELEMENTWISE = Rule(
    name="elementwise", pass_=FORWARD, stage=ELEMENTWISE,
    doc="one kernel for a run of elementwise ops", match=_run, covers=ELEMENTWISE_KINDS,
)
BACKWARD_ELEMENTWISE = Rule(
    name="elementwise_backward", pass_=BACKWARD, stage=ELEMENTWISE,
    doc="one kernel: run input grad with fused deterministic dbias", match=_run, covers=ELEMENTWISE_KINDS,
)
