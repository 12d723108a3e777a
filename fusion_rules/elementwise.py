"""A maximal run of elementwise ops → ONE generated kernel per pass.

Forward: bias, activations (GLU included), ConstantScale, AddExtraInput, MakeExtraOutput and any
plugin op with a device functor, in one pass over memory (a Residual's tee and its add in
two runs). Backward: one kernel producing the
run's input grad, with every Bias gradient (column sum) fused in as deterministic per-block
partials; forward values are recomputed from the saved run input instead of being saved. A run
holds at most one GLU (it halves the width).
"""

from fusegen.ops import elementwise_kinds
from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import ELEMENTWISE


def _run(ops):
    n = glus = 0
    kept = set()  # the values the run's tees write
    for op in ops:
        if op.opdef.functor_form is None:
            break
        glus += op.opdef.halves_width
        if glus > 1:
            break
        # a Residual's add whose tee is in the run starts a kernel of its own, which reads the
        # residual from memory (one kernel holding both would read the value it writes)
        if op.extra_in is not None and op.extra_in in kept:
            break
        kept.add(op.extra_out)
        n += 1
    return n


FORWARD_ELEMENTWISE = Rule(
    name="elementwise", pass_=FORWARD, stage=ELEMENTWISE,
    doc="one kernel for a run of elementwise ops", match=_run, covers=elementwise_kinds(),
)
BACKWARD_ELEMENTWISE = Rule(
    name="elementwise_backward", pass_=BACKWARD, stage=ELEMENTWISE,
    doc="one kernel for the run's input grad; a Bias's grad, if any, summed in a fixed order: at a few "
        "rows by the kernel itself (one launch), else as per-block partials added by a column-sum kernel",
    match=_run, covers=elementwise_kinds(),
)
