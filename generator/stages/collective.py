"""Collective stages: a communication op over the tensor-parallel group (ops/collectives.py),
through PyTorch's collectives (templates/runtime/collectives.py: NCCL on CUDA, gloo on CPU).

Each runs between the fused stages under autograd, as a user's module does (emit/segments.py):
the runtime's collective is an autograd Function whose backward is its pair (an all-gather's a
reduce-scatter, and the reverse; an all-reduce's the grad as it is; TensorParallelCopy's an
all-reduce), so the stage emits no backward; the Function reading its output starts that backward
early (``starts_pair_early``). It replays in no CUDA graph of fusegen's own (a gloo collective
cannot be captured): a user captures a whole step with NCCL's, README "Tensor and sequence
parallelism". COLLECTIVE_GEMM runs an all-gather or a reduce-scatter inside the fused Function,
micro-pipelined with its GEMM.
"""

from __future__ import annotations

from ..calls import TorchCall
from ..ops.collectives import KINDS as COLLECTIVES, RUNS, rows_times
from ..values import X_DTYPE, Role
from .base import Saves, StageImpl


class CollectiveStage(StageImpl):
    name = "collective"
    replayable = False
    between_functions = True
    starts_pair_early = True  # the reading Function starts the backward's collective before its weight grads

    def check(self, pass_, chain):
        return None if len(chain) == 1 and chain[0] in COLLECTIVES else "a collective stage runs one collective op"

    def runs_as(self, pass_, stage, kernels):
        _, forward, backward = RUNS[stage.ops[0].opdef.name]
        return forward if pass_ == "forward" else backward

    def rows_factor(self, stage):
        return rows_times(stage.ops[0].opdef, stage.ops[0].args)

    def forward(self, em, stage, block):
        op = stage.ops[0]
        block.add(TorchCall(f"{{y}} = collectives.{RUNS[op.opdef.name][0]}({{x}}, {{group}})",
                            dict(x=stage.input, group=em.pipeline.group), dict(y=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        return d_in  # autograd runs the collective's pair; d_in is the grad output of the Function before it


COLLECTIVE = CollectiveStage()


class CollectiveGemmStage(StageImpl):
    """An all-gather and the GEMM that reads it, or a GEMM and the reduce-scatter of its output,
    as one call that micro-pipelines them (the runtime's all_gather_matmul and
    matmul_reduce_scatter: PyTorch's ``torch.ops.symm_mem.fused_all_gather_matmul`` and
    ``fused_matmul_reduce_scatter`` on CUDA, each rank's share of the rows multiplied as it
    arrives or leaves over symmetric memory, without NVLink multicast; the collective then the
    GEMM elsewhere). Measured on 4 H100s at the Llama MLP block's shapes (bench/results/
    tp_h100.md) they beat NCCL's collective before or after the GEMM. The backward is the pair:
    an all-gather-GEMM's dgrad is a GEMM-reduce-scatter and the reverse; the weight grad reads the
    gathered operand (the forward's gathered x; the backward's gathered dy). Inside the fused
    Function, so no CUDA graph of fusegen's own captures it."""

    name = "collective_gemm"
    replayable = False
    FORMS = {("all_gather", "linear"): "all-gather micro-pipelined with the GEMM (symmetric memory)",
             ("linear", "reduce_scatter"): "GEMM micro-pipelined with the reduce-scatter (symmetric memory)"}
    BACKWARD = {("all_gather", "linear"): "dgrad GEMM micro-pipelined with the reduce-scatter, wgrad GEMM",
                ("linear", "reduce_scatter"): "all-gather of dy micro-pipelined with the dgrad GEMM, wgrad GEMM"}

    def check(self, pass_, chain):
        forms = ", ".join(" + ".join(form) for form in self.FORMS)
        return None if tuple(chain) in self.FORMS else f"a collective GEMM stage runs one of {forms}"

    def runs_as(self, pass_, stage, kernels):
        return (self.FORMS if pass_ != "backward" else self.BACKWARD)[tuple(op.kind for op in stage.ops)]

    def rows_factor(self, stage):
        op = stage.first("all_gather") or stage.first("reduce_scatter")
        return rows_times(op.opdef, op.args)

    def saves(self, pipeline, stage, have):
        # a GEMM-reduce-scatter's weight grad reads its x; an all-gather-GEMM's the gathered x,
        # which the stage makes (its own value, em.stats)
        return Saves(values=frozenset() if stage.first("all_gather") else frozenset({stage.first("linear").input}))

    def saved_shapes(self, em, stage):
        shapes = {em.name(em.pipeline.group): ("—", "the module's process group (a Python object, not a tensor)")}
        gather = stage.first("all_gather")
        if gather is not None:  # the gathered x: the group's rows
            gathered = em.stats[stage.first("linear").index][0]
            shapes[em.name(gathered)] = (f"[rows * {gather.args['size']}, {em.pipeline.features(stage.input)}]",
                                         "x's dtype")
        return shapes

    def forward(self, em, stage, block):
        linear, reads = stage.first("linear"), dict(x=stage.input, w=stage.first("linear").param("weight"),
                                                    group=em.pipeline.group)
        if stage.first("reduce_scatter") is not None:
            block.add(TorchCall("{y} = collectives.matmul_reduce_scatter({x}, {w}.t(), {group})", reads,
                                dict(y=stage.output)))
        elif not em.saving:  # the no-grad forward: the gathered x is not kept
            block.add(TorchCall("_, {y} = collectives.all_gather_matmul({x}, {w}.t(), {group})", reads,
                                dict(y=stage.output)))
        else:
            gathered = em.table.add(Role.ACTIVATION, X_DTYPE, f"{em.name(stage.input)}_gathered")
            em.stats[linear.index] = [gathered]
            block.add(TorchCall("{g}, {y} = collectives.all_gather_matmul({x}, {w}.t(), {group})", reads,
                                dict(g=gathered, y=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        linear = stage.first("linear")
        weight, group = linear.param("weight"), em.pipeline.group
        if stage.first("all_gather") is not None:  # dx = reduce-scatter(dy W); dW = dy^T gathered x
            block.add(TorchCall("{dx} = collectives.matmul_reduce_scatter({dy}, {w}, {group})",
                                dict(dy=dy, w=weight, group=group), dict(dx=d_in)))
            x, wgrad_dy = em.stats[linear.index][0], dy
        else:  # dy gathered, dx = gathered dy W; dW = gathered dy^T x
            wgrad_dy = em.grad(linear.output)  # (the GEMM's output before the reduce-scatter: its grad is dy gathered)
            block.add(TorchCall("{g}, {dx} = collectives.all_gather_matmul({dy}, {w}, {group})",
                                dict(dy=dy, w=weight, group=group), dict(g=wgrad_dy, dx=d_in)))
            x = linear.input
        helper = "accumulate_into_main_grad(" if linear.args["accumulate_into_main_grad"] else "weight_grad(ctx, "
        wgrad = TorchCall(f"ref.{helper}{{w}}, {{dy}}, {{x}})", dict(w=weight, dy=wgrad_dy, x=x))
        block.weight_grad_calls.append((em.grad(weight), wgrad))
        return d_in


COLLECTIVE_GEMM = CollectiveGemmStage()
