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
- between them each rank holds its share of the features: elementwise ops and GLUs run on it as
  they are, a Bias holds size / k values (as te.ops.Bias(tensor_parallel=True), which holds them
  anywhere), attention runs heads / k query and kv_heads / k key/value heads (OpDef.split_features,
  Megatron's and TE's split: attention heads column-wise, the output projection row-wise); an op
  that reads a whole row (a norm, a Linear of neither mode) is an error there;
- the spec's AllGather, ReduceScatter and AllReduce take the size.

At k = 1 the modes are ignored and the collectives left out, as TE does for a group of one rank:
the pipeline is the unsharded one. Everything after the graph (rules, kernels specialised on the
local sizes, parameters of the local shapes) needs nothing else. A size the group does not
divide is a SpecError at the op.
"""

from __future__ import annotations

from .errors import SpecError
from .ops import OPS
from .ops.collectives import KINDS as COLLECTIVES, rows_times


class Localiser:
    """The ops of a spec's calls, in order, as a rank of a group of ``size`` runs them. ``share``:
    whether the running value holds the rank's share of the features (after a column-parallel
    Linear, until a row-parallel one); ``reduction``: a row-parallel Linear's, which waits for its
    te.ops.Linear's Bias (each rank adds it in full before the reduction, as TE's te.ops)."""

    def __init__(self, size: int):
        self.size, self.share, self.reduction, self.width = size, False, None, 0
        self.rows = 1  # the ranks whose rows the running value holds (after a sequence-parallel all-gather: all)
        self.attended = None  # the rows the first attention read: every one must read the same sequences

    def __call__(self, parts: list[tuple], call) -> list[list[tuple]]:
        """The basic parts of one spec call (ops.basic_parts: (op, args, part, held)), each as the
        ops it becomes: itself localised, with the collectives it needs (none at size 1, where the
        spec's own collectives are left out), so a TE layer's residuals still open and close at
        their parts (OpDef.residuals)."""
        if call.args.get("tp_size", 1) not in (1, self.size):  # TE's modules' tp_size, where the spec fixes it
            raise SpecError(f"{call.op}(): tp_size={call.args['tp_size']}, but the pipeline is built for a tensor-"
                            f"parallel group of {self.size}; set [tool.fusegen.pipelines.<name>] tensor_parallel_size "
                            f"= {call.args['tp_size']} (or leave tp_size out: the group given at run time has the "
                            "build's size)", call.location)
        if self.size == 1:
            return [[] if part[0].kind in COLLECTIVES else [part] for part in parts]
        # TE's modules (their parallel_mode, set_parallel_mode) add a row-parallel Linear's bias once, after the
        # reduction; te.ops' Linear before it (each rank's)
        bias_first = not (call.args.get("parallel_mode") or call.args.get("set_parallel_mode"))
        groups = []
        for op, args, part, held in parts:
            if op.reads_sequences and self.attended not in (None, self.rows):
                raise SpecError(f"{call.op}(): its attention reads the tokens of {self.rows} rank(s), but an attention "
                                f"before it those of {self.attended}: the module's call gives one set of sequences; "
                                "give every Linear around attention the same sequence_parallel", call.location)
            if op.reads_sequences:
                self.attended = self.rows
            if self.reduction is not None and (op.name != "Bias" or not bias_first):
                groups[-1].append(self.reduction)  # (right after the Linear)
                self.reduction = None
            if op.name == "BasicLinear" and args["tensor_parallel_mode"] is not None:
                group = self._linear(op, args, part, held, call)
            elif op.kind in COLLECTIVES:
                self._whole_rows(op, call)
                group = [self._collective(op, {**args, "size": self.size}, part)]
            elif op.name == "Bias" and (self.share or args["tensor_parallel"]):
                # a column-parallel Linear's bias, or te.ops.Bias(tensor_parallel=True): a share of it
                local = _shard(args["size"], self.size, f"size={args['size']}", call)
                group = [(op, dict(args, size=local, tensor_parallel=True), part, held and held.shard(self.size))]
            else:
                group = [(op, self._on_share(op, args, call) if self.share else args, part, held)]
            if op.name == "Bias" and self.reduction is not None:  # te.ops.Linear's: then the reduction
                group.append(self.reduction)
                self.reduction = None
            groups.append(group)
        if self.reduction is not None:  # the call's last op: its output is reduced before the next call
            groups[-1].append(self.reduction)
            self.reduction = None
        return groups

    def _linear(self, op, args, part, held, call) -> list[tuple]:
        """A column-parallel Linear's N / k outputs after its input's all-gather (sequence
        parallel) or copy; a row-parallel one's K / k inputs, its reduction pending."""
        mode, group = args["tensor_parallel_mode"], args["tensor_parallel_group"]
        if self.share and mode == "column":
            raise SpecError(f"{call.op}(): a column-parallel Linear reads whole rows of features, but the ops before "
                            "it hold a rank's share of them (after another column-parallel Linear): make it "
                            "row-parallel, or put a row-parallel Linear before it", call.location)
        features = "out_features" if mode == "column" else "in_features"
        local = dict(args, **{features: _shard(args[features], self.size, f"{features}={args[features]}", call)})
        if held is not None and mode == "column":  # TE's QKV layouts: a share of each block, whole GQA groups
            for name, rows in held.blocks:
                _shard(rows, self.size, f"its {name} rows ({rows})", call)
            if held.groups is not None:
                _shard(held.groups[0], self.size, f"its {held.groups[0]} GQA groups", call)
            held = held.shard(self.size)
        self.share, self.width = mode == "column", local["out_features"]
        shared = {"process_group": group, "size": self.size}
        if mode == "row":
            reduction = OPS["ReduceScatter" if args["sequence_parallel"] else "AllReduce"]
            self.reduction = self._collective(reduction, {**_defaults(reduction), **shared}, part)
            return [(op, local, part, held)]
        gather = OPS["AllGather" if args["sequence_parallel"] else "TensorParallelCopy"]
        return [self._collective(gather, shared, part), (op, local, part, held)]

    def _collective(self, op, args, part) -> tuple:
        """A collective's part, the rows it leaves a rank counted (an all-gather's: the group's)."""
        self.rows = int(self.rows * rows_times(op, args))
        return (op, args, part, None)

    def _on_share(self, op, args, call) -> dict:
        """An op's arguments on the rank's share of the features: as they are for an op of each
        value alone (an activation, a GLU on its halves, dropout, a scale by one learnable value),
        the op's own split (attention's heads), else an error."""
        if op.split_features is not None:
            split = op.split_features(args, self.size)
            if isinstance(split, str):
                raise SpecError(f"{call.op}(): runs on a rank's share of the features here (after a "
                                f"column-parallel Linear, over {self.size} ranks), but {split}", call.location)
            return split
        operand, interleave = op.operand, op.interleave(args)
        if interleave is not None and self.width % (2 * interleave):
            raise SpecError(f"{call.op}(): its blocks of {interleave} alternate gates and linears, but a rank's share "
                            f"of the features ({self.width}) is not a whole number of pairs of blocks; give the "
                            "column-parallel Linear a multiple of 2 * glu_interleave_size * the group size",
                            call.location)
        if op.functor_form in ("unary", "gate") or (operand is not None and operand.broadcast in ("scalar", "random")):
            return args
        raise SpecError(f"{call.op}(): reads whole rows of features, but here each rank holds 1/{self.size} of them "
                        f"(after a column-parallel Linear, before a row-parallel one); move it before the "
                        "column-parallel Linear or after the row-parallel one", call.location)

    def _whole_rows(self, op, call) -> None:
        if self.share:
            raise SpecError(f"{call.op}(): a collective between a column-parallel Linear and a row-parallel one, where "
                            "each rank holds a share of the features; move it before or after them", call.location)


def _defaults(op) -> dict:
    return {arg.name: arg.default for arg in op.args}


def _shard(features: int, size: int, what: str, call) -> int:
    if features % size:
        raise SpecError(f"{call.op}(): {what} does not split over the {size} ranks of the tensor-parallel group the "
                        f"pipeline is built for ([tool.fusegen.pipelines.<name>] tensor_parallel_size = {size}); "
                        f"give it a multiple of {size}, or build the pipeline for a size that divides it",
                        call.location)
    return features // size


def spec_size(calls) -> int | None:
    """The group size a spec fixes with TE's modules' ``tp_size`` (where not 1), or None: the build's
    size where its pyproject table gives none. Two sizes in one spec are an error at the second."""
    sizes = {}  # each size given, and the first call giving it
    for call in calls:
        for size in (spec_size(call.inner) if call.inner else None, call.args.get("tp_size", 1)):
            if size not in (None, 1):
                sizes.setdefault(size, call)
    if len(sizes) > 1:
        first, (size, call) = next(iter(sizes)), list(sizes.items())[1]
        raise SpecError(f"{call.op}(): tp_size={size}, but an op before it gives tp_size={first}; one pipeline is "
                        "built for one tensor-parallel size", call.location)
    return next(iter(sizes), None)


def sequence_ranks(ops) -> int:
    """How many ranks' tokens the ops that read the packed sequences see: the group's after a
    sequence-parallel all-gather (attention between the column- and row-parallel Linears), 1
    without; the module's call form gives the sequences of all of them, in rank order."""
    ranks, seen = 1, set()
    for op in ops:
        if op.opdef.kind in COLLECTIVES:
            ranks = int(ranks * rows_times(op.opdef, op.args))
        elif op.opdef.reads_sequences:
            seen.add(ranks)
    if len(seen) > 1:  # (the Localiser refuses such a spec)
        raise AssertionError(f"ops reading the sequences see the tokens of {sorted(seen)} ranks")
    return seen.pop() if seen else 1


def sequence_major(pipeline) -> bool:
    """Whether the pipeline's rows run in x's [seq, batch] order: TE's "sbhd" under sequence
    parallelism, each rank's share of every sequence gathered along seq (dim 0, TE's), so the
    attention stage reorders its own rows batch-major and back; without it "sbhd" runs batch-major
    rows throughout (the module transposes x once)."""
    return pipeline.sequence_format == "sbhd" and sequence_ranks(pipeline.ops) > 1


def shards(pipeline) -> dict[str, int | str | tuple[int, ...]]:
    """Each sharded parameter's state_dict key and how its ranks' shards split the unsharded one,
    for the runtime's full_state_dict and load_full_state_dict: 1 (a row-parallel weight's
    columns), sections of rows (a column-parallel weight's or bias's: each section split in rank
    order, so a rank's rows are its share of each; one section where the op after it reads the
    features alike, a GLU's two halves, attention's q, k and v heads: OpDef.feature_sections) or
    "sum" (a row-parallel Linear's bias, each rank's added before the reduction). Replicated
    parameters are left out."""
    if pipeline.tensor_parallel == 1:
        return {}
    ops = pipeline.ops
    rows = {op.module_index for op in ops
            if op.opdef.name == "BasicLinear" and op.args["tensor_parallel_mode"] == "row"}
    split = {}
    for op, attr, key, shape, _ in pipeline.params:
        mode = op.args.get("tensor_parallel_mode") if op.opdef.name == "BasicLinear" else None
        by_rows = mode == "column" or (op.opdef.name == "Bias" and op.args["tensor_parallel"])
        if mode == "row":
            split[key] = 1
        elif by_rows and op.held_rows:
            for name, held in op.held_rows.held(attr, shape):  # TE's QKV blocks (or grouped rows): each in rank order
                split[f"{op.module_index}.{op.holder_attribute(name)}"] = (held[0] * pipeline.tensor_parallel,)
        elif by_rows:
            split[key] = _sections(ops[op.index + 1:], pipeline.tensor_parallel * (
                op.args["out_features"] if mode else op.args["size"]))
        elif op.opdef.name == "Bias" and op.module_index in rows and ops[op.index - 1].opdef.kind not in COLLECTIVES:
            split[key] = "sum"  # (te.ops'; a TE module's, after the reduction, is every rank's the same)
    return split


def _sections(after, features: int) -> tuple[int, ...]:
    """How the op reading a column-parallel Linear's features groups them (``after``: the ops
    after the Linear): attention's q, k and v, a GLU's two halves (its interleaved blocks: split
    as they are), else one section."""
    for op in after:
        if op.opdef.name == "BasicLinear":
            break
        if op.opdef.feature_sections is not None:
            return op.opdef.feature_sections(op.args, features)
        if op.opdef.halves_width:
            return (features // 2,) * 2 if op.opdef.interleave(op.args) is None else (features,)
    return (features,)
