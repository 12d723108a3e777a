"""Communication over the tensor-parallel group (catalog 2.13; TE's ops/basic/all_gather.py,
reduce_scatter.py, all_reduce.py), and the collective TE's BasicLinear runs inside itself.

- AllGather: the ranks' rows joined in rank order (the leading dims' first one times the group's
  size); backward: the grad reduce-scattered (summed over the ranks, each keeping its rows).
- ReduceScatter: the ranks' tensors summed, each rank keeping its share of the rows (the first
  leading dim divided by the group's size); backward: the grad all-gathered.
- AllReduce: the ranks' tensors summed, every rank keeping the sum; backward: the grad as it is
  (TE's ``reduce_in_backward`` is stored but unused there, so here too).
- TensorParallelCopy (no spec names it): y = x, and the grad all-reduced; a column-parallel
  BasicLinear without sequence parallelism reads its input through it (TE's dgrad all-reduce).

The group is the generated module's (its constructor's ``tensor_parallel_group``), whatever the
spec's ``process_group`` expression; ``size`` is the group size the pipeline is built for
([tool.fusegen.pipelines.<name>] tensor_parallel_size), which generator/tensor_parallel.py sets:
at size 1 a collective is the identity (as TE's are) and the graph leaves it out. They run as
PyTorch's collectives (templates/runtime/collectives.py, through stages/collective.py), so they
have no reference math of their own here.
"""

from fractions import Fraction

from .lazy import torch
from .opdef import Arg, OpDef, register

PROCESS_GROUP = Arg("process_group", "group", None, in_kernel=False)


def _size_set_by_build(v):
    return None if v == 1 else ("is the tensor-parallel size the pipeline is built for: set it with "
                                "[tool.fusegen.pipelines.<name>] tensor_parallel_size, not in the spec")


# the group size the pipeline is built for (generator/tensor_parallel.py sets it; a spec cannot)
SIZE = Arg("size", "int", 1, keyword_only=True, in_kernel=False, te_only=True, check=_size_set_by_build)

# The collectives' op kinds (a rule fusing an all-gather into the GEMM after it names its own)
KINDS = frozenset({"all_gather", "reduce_scatter", "all_reduce", "copy_to_group"})

# Each op's collective in the generated package's runtime (_runtime/collectives.py, an autograd
# Function), and what its forward and its backward run, as plans say it
_OVER = " over the tensor-parallel group"
RUNS = {
    "AllGather": ("all_gather", "torch.distributed: all-gather" + _OVER, "torch.distributed: reduce-scatter" + _OVER),
    "ReduceScatter": ("reduce_scatter", "torch.distributed: reduce-scatter" + _OVER,
                      "torch.distributed: all-gather" + _OVER),
    "AllReduce": ("all_reduce", "torch.distributed: all-reduce" + _OVER, "no communication: the grad as it is"),
    "TensorParallelCopy": ("copy_to_group", "y = x (its backward: all-reduce" + _OVER + ")",
                           "torch.distributed: all-reduce" + _OVER),
}


def tensor_parallel_lead(module, op, lead, dims):
    """The leading dims after a collective that joins the group's rows (``dims`` (k, 1): the first
    dim k times longer, AllGather) or splits them (``dims`` (1, k): k times shorter,
    ReduceScatter), as TE's gather and scatter along dim 0; or a clear error naming the module
    and the op."""
    times, over = dims
    if len(lead) == 0:
        raise ValueError(f"{module}: {op} joins or splits the first dim over the tensor-parallel "
                         "group, but the input is 1-D (its features only); give it rows: "
                         "[rows, features] or [seq, batch, features]")
    if lead[0] % over:
        raise ValueError(f"{module}: {op} splits the first dim over the {over} ranks of the "
                         f"tensor-parallel group, so it must be a multiple of {over}, got "
                         f"{lead[0]} (leading dims {list(lead)}); give each rank a multiple of "
                         f"{over} rows")
    return torch.Size((lead[0] * times // over, *lead[1:]))


def rows_times(opdef, args) -> Fraction:
    """How many times a rank's rows a collective's output holds: an AllGather's group size, a
    ReduceScatter's 1 / size (their ``new_lead``), 1 for the others."""
    if opdef.new_lead is None:
        return Fraction(1)
    times, over = opdef.new_lead(args)[1]
    return Fraction(times, over)


register(OpDef(
    "AllGather", "all_gather", args=(PROCESS_GROUP, SIZE),
    new_lead=lambda a: (tensor_parallel_lead, (a["size"], 1)), reference_helpers=(tensor_parallel_lead,),
    summary="the ranks' rows joined in rank order; backward: the grad reduce-scattered",
))
register(OpDef(
    "ReduceScatter", "reduce_scatter", args=(PROCESS_GROUP, SIZE),
    new_lead=lambda a: (tensor_parallel_lead, (1, a["size"])),
    summary="the ranks' tensors summed, each rank keeping its share of the rows; backward: the grad all-gathered",
))
register(OpDef(
    "AllReduce", "all_reduce",
    args=(PROCESS_GROUP, Arg("reduce_in_backward", "bool", True, in_kernel=False), SIZE),
    summary="the ranks' tensors summed; backward: the grad as it is",
))
register(OpDef(
    "TensorParallelCopy", "copy_to_group", args=(PROCESS_GROUP, SIZE), modules=(),
    summary="y = x; backward: the grad all-reduced (a column-parallel BasicLinear's input, without sequence "
            "parallelism)",
    changes_value=False,
))

