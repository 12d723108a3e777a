"""An all-gather and the BasicLinear that reads it, a BasicLinear and the reduce-scatter of its
output (a sequence-parallel column- and row-parallel Linear) → one stage that micro-pipelines the
collective with the GEMM over symmetric memory (stages/collective.py's COLLECTIVE_GEMM), forward
and backward (there the all-gather's pair, a reduce-scatter, with the dgrad GEMM, and the
reverse)."""

from fusegen.plan import BACKWARD, FORWARD, Rule
from fusegen.stages import COLLECTIVE_GEMM

FORWARD_ALL_GATHER_LINEAR = Rule(
    name="all_gather_linear", pass_=FORWARD, stage=COLLECTIVE_GEMM,
    doc="all-gather and GEMM, micro-pipelined", pattern=("all_gather", "linear"),
)
BACKWARD_ALL_GATHER_LINEAR = Rule(
    name="all_gather_linear_backward", pass_=BACKWARD, stage=COLLECTIVE_GEMM,
    doc="dgrad GEMM and reduce-scatter, micro-pipelined; wgrad GEMM", pattern=("all_gather", "linear"),
)
FORWARD_LINEAR_REDUCE_SCATTER = Rule(
    name="linear_reduce_scatter", pass_=FORWARD, stage=COLLECTIVE_GEMM,
    doc="GEMM and reduce-scatter, micro-pipelined", pattern=("linear", "reduce_scatter"),
)
BACKWARD_LINEAR_REDUCE_SCATTER = Rule(
    name="linear_reduce_scatter_backward", pass_=BACKWARD, stage=COLLECTIVE_GEMM,
    doc="all-gather of dy and dgrad GEMM, micro-pipelined; wgrad GEMM", pattern=("linear", "reduce_scatter"),
)
