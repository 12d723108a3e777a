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
from .base import StageImpl

# each op's collective in the runtime (its forward; its backward is the runtime's too)
RUNS = {"AllGather": "all_gather", "ReduceScatter": "reduce_scatter", "AllReduce": "all_reduce",
        "TensorParallelCopy": "copy_to_group"}
PAIRS = {"AllGather": "reduce-scatter", "ReduceScatter": "all-gather", "AllReduce": "the grad as it is",
         "TensorParallelCopy": "all-reduce"}


class CollectiveStage(StageImpl):
    name = "collective"
    replayable = False
    between_functions = True

    def check(self, pass_, chain):
        return None if list(chain) == ["collective"] else "a collective stage runs one collective op"

    def runs_as(self, pass_, stage, kernels):
        op = stage.ops[0].opdef.name
        what = RUNS[op].replace("_", "-") if pass_ == "forward" else PAIRS[op]
        return f"torch.distributed: {what} over the tensor-parallel group" if what != "copy-to-group" else \
            "y = x (its backward: all-reduce over the tensor-parallel group)"

    def rows_factor(self, stage):
        op = stage.ops[0]
        return {"AllGather": Fraction(op.args["size"]), "ReduceScatter": Fraction(1, op.args["size"])}.get(
            op.opdef.name, Fraction(1))

    def forward(self, em, stage, block):
        op = stage.ops[0]
        block.add(TorchCall(f"{{y}} = collectives.{RUNS[op.opdef.name]}({{x}}, {{group}})",
                            dict(x=stage.input, group=em.pipeline.group), dict(y=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        return d_in  # autograd runs the collective's pair; d_in is the grad output of the Function before it


COLLECTIVE = CollectiveStage()
