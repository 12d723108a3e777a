"""Collective stages: a communication op over the tensor-parallel group (ops/collectives.py),
through PyTorch's collectives (templates/runtime/collectives.py: NCCL on CUDA, gloo on CPU).

Each runs between the fused stages under autograd, as a user's module does (emit/segments.py):
the runtime's collective is an autograd Function whose backward is its pair (an all-gather's a
reduce-scatter, and the reverse; an all-reduce's the grad as it is; TensorParallelCopy's an
all-reduce), so the stage emits no backward. It captures into no CUDA graph of fusegen's own (a
gloo collective cannot be captured; NCCL's overlap with the GEMMs is planned next, issue 41).
"""

from __future__ import annotations

from fractions import Fraction

from ..calls import TorchCall
from ..ops.collectives import RUNS
from .base import StageImpl

class CollectiveStage(StageImpl):
    name = "collective"
    replayable = False
    between_functions = True
    starts_pair_early = True  # the reading Function starts the backward's collective before its weight grads

    def check(self, pass_, chain):
        return None if list(chain) == ["collective"] else "a collective stage runs one collective op"

    def runs_as(self, pass_, stage, kernels):
        _, forward, backward = RUNS[stage.ops[0].opdef.name]
        return forward if pass_ == "forward" else backward

    def rows_factor(self, stage):
        op = stage.ops[0]  # an AllGather's rows times the group's size, a ReduceScatter's over it (new_lead)
        times, over = op.opdef.new_lead(op.args)[1] if op.opdef.new_lead else (1, 1)
        return Fraction(times, over)

    def forward(self, em, stage, block):
        op = stage.ops[0]
        block.add(TorchCall(f"{{y}} = collectives.{RUNS[op.opdef.name][0]}({{x}}, {{group}})",
                            dict(x=stage.input, group=em.pipeline.group), dict(y=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        return d_in  # autograd runs the collective's pair; d_in is the grad output of the Function before it


COLLECTIVE = CollectiveStage()
