"""Tensor and sequence parallelism (issue 41): a spec's ops as one rank runs them.

A pipeline is built for one tensor-parallel size k ([tool.fusegen.pipelines.<name>]
tensor_parallel_size, default 1). Its graph holds each rank's share of the work, TE's schedule
(catalog 2.1-2.3, TE's BasicLinear._canonicalize_tensor_parallelism and ops/linear.py):

- a column-parallel BasicLinear(K, N) computes N / k output features: its input is all-gathered
  first with sequence parallelism (AllGather), else read through TensorParallelCopy (its grad
  all-reduced in the backward);
- a row-parallel BasicLinear(K, N) reads K / k input features, and the spec op's output (after a
  Linear's Bias, which each rank adds in full before the reduction, as TE's te.ops.Linear) is
  reduce-scattered with sequence parallelism (ReduceScatter), else all-reduced (AllReduce);
- a Bias with tensor_parallel=True (a column-parallel Linear's) holds size / k values;
- the spec's AllGather, ReduceScatter and AllReduce take the size.

At k = 1 the modes are ignored and the collectives left out, as TE does for a group of one rank:
the pipeline is the unsharded one. Everything after the graph (rules, kernels specialised on the
local sizes, parameters of the local shapes) needs nothing else. A size the group does not
divide is a SpecError at the op.
"""

from __future__ import annotations

from .errors import SpecError
from .ops import OPS
from .ops.collectives import KINDS as COLLECTIVES


def localised(parts: list[tuple], size: int, call) -> list[tuple]:
    """The basic parts of one spec call (ops.basic_parts: (op, args, part, held)) as a rank of a
    group of ``size`` runs them."""
    if size == 1:
        return [part for part in parts if part[0].kind not in COLLECTIVES]
    before, ops, after = [], [], []
    column = False
    for op, args, part, held in parts:
        if op.kind in COLLECTIVES:
            ops.append((op, {**args, "size": size}, part, held))
        elif op.name == "BasicLinear" and args["tensor_parallel_mode"] is not None:
            mode, group, sequence = args["tensor_parallel_mode"], args["tensor_parallel_group"], args["sequence_parallel"]
            features = "out_features" if mode == "column" else "in_features"
            local = dict(args, **{features: _shard(args[features], size, f"{features}={args[features]}", call)})
            ops.append((op, local, part, held))
            if mode == "column":
                column = True
                gather = "AllGather" if sequence else "TensorParallelCopy"
                before.append((OPS[gather], {"process_group": group, "size": size}, part, None))
            else:
                reduction = OPS["ReduceScatter" if sequence else "AllReduce"]
                after.append((reduction, {**_defaults(reduction), "process_group": group, "size": size}, part, None))
        elif op.name == "Bias" and (column or args["tensor_parallel"]):
            # a column-parallel Linear's bias, or te.ops.Bias(tensor_parallel=True): a share of it
            ops.append((op, dict(args, size=_shard(args["size"], size, f"size={args['size']}", call), tensor_parallel=True),
                        part, held))
        else:
            ops.append((op, args, part, held))
    return before + ops + after


def _defaults(op) -> dict:
    return {arg.name: arg.default for arg in op.args}


def _shard(features: int, size: int, what: str, call) -> int:
    if features % size:
        raise SpecError(f"{call.op}(): {what} does not split over the {size} ranks of the tensor-parallel group the "
                        f"pipeline is built for ([tool.fusegen.pipelines.<name>] tensor_parallel_size = {size}); "
                        f"give it a multiple of {size}, or build the pipeline for a size that divides it",
                        call.location)
    return features // size


def shards(pipeline) -> dict[str, int | str]:
    """Each sharded parameter's state_dict key and how its ranks' shards split the unsharded one,
    for the runtime's full_state_dict and load_full_state_dict: 0 (a column-parallel weight's or
    bias's rows, in rank order), 1 (a row-parallel weight's columns), "glu" (a column-parallel
    Linear's rows feeding a GLU, which each rank splits into its own two halves: each half split in
    rank order, so the ranks together compute the unsharded GLU) or "sum" (a row-parallel Linear's
    bias, each rank's added before the reduction). Replicated parameters are left out."""
    if pipeline.tensor_parallel == 1:
        return {}
    ops = pipeline.ops
    rows = {op.module_index for op in ops if op.opdef.name == "BasicLinear" and op.args["tensor_parallel_mode"] == "row"}
    split = {}
    for op, _, key, _, _ in pipeline.params:
        mode = op.args.get("tensor_parallel_mode") if op.opdef.name == "BasicLinear" else None
        if mode == "row":
            split[key] = 1
        elif mode == "column" or (op.opdef.name == "Bias" and op.args["tensor_parallel"]):
            after = next((o for o in ops[op.index + 1:] if o.opdef.name != "Bias"), None)
            glu = after is not None and after.opdef.halves_width and after.opdef.interleave(after.args) is None
            split[key] = "glu" if glu else 0
        elif op.opdef.name == "Bias" and op.module_index in rows:
            split[key] = "sum"
    return split
