"""Tensor parallelism's collectives (issue 41) for a generated module built for a tensor-parallel
size above 1 ([tool.fusegen.pipelines.<name>] tensor_parallel_size): those its stages call between
the fused Functions (autograd records them, each backward its pair, as TE's te.ops comm ops) and
inside them (an all-gather or a reduce-scatter micro-pipelined with its GEMM). The group and the
shards: tensor_parallel.py.

They run as PyTorch's collectives on the group: NCCL on CUDA tensors, gloo on CPU ones, on the
current stream, along the first dim of the [rows, features] tensors the stages hand (which is the
first dim of the caller's tensor: TE gathers and scatters along dim 0). Under torch.compile they
are PyTorch's functional collectives (torch.distributed._functional_collectives), which Dynamo
traces into the graph and Inductor schedules: no early start of a backward collective (its side
effects cannot be traced), and the all-gather / reduce-scatter beside a GEMM as the collective and
the GEMM (Inductor's async-TP pass, torch._inductor.config._micro_pipeline_tp, fuses them again).
"""

import torch

try:
    from torch.distributed import _functional_collectives as funcol
except ImportError:  # a torch without torch.distributed: no module of this kind can be constructed
    funcol = None


def _single(name, before):
    """torch.distributed's collective ``name``, or its older spelling ``before`` (torch 2.13 renamed
    all_gather_into_tensor and reduce_scatter_tensor, deprecating the old names)."""
    return getattr(torch.distributed, name, None) or getattr(torch.distributed, before)


def _gathered(x, group, async_op=False):
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor(x.contiguous(), 0, group)
    ranks = torch.distributed.get_world_size(group)
    out = x.new_empty((x.shape[0] * ranks, *x.shape[1:]))
    work = _single("all_gather_single", "all_gather_into_tensor")(
        out, x.contiguous(), group=group, async_op=async_op)
    return (out, work) if async_op else out


def _scattered(x, group, async_op=False):
    ranks = torch.distributed.get_world_size(group)
    if x.shape[0] % ranks:
        raise ValueError(f"a reduce-scatter over {ranks} ranks splits the rows, so they must be a multiple of {ranks}, "
                         f"got {x.shape[0]}")
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", 0, group)
    out = x.new_empty((x.shape[0] // ranks, *x.shape[1:]))
    work = _single("reduce_scatter_single", "reduce_scatter_tensor")(out, x.contiguous(), group=group,
                                                                    async_op=async_op)
    return (out, work) if async_op else out


def _summed(x, group, async_op=False):
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", group)
    # (the caller's tensor, maybe: left as it is)
    out = x.clone(memory_format=torch.contiguous_format)
    work = torch.distributed.all_reduce(out, group=group, async_op=async_op)
    return (out, work) if async_op else out


class Pair:
    """A collective's backward (its pair: ``run`` on the group), which the Function that reads the
    collective's output starts as soon as it has that output's grad, before its weight-grad GEMMs
    (``start``: asynchronous, on NCCL's stream), so that it runs behind them, as TE's BasicLinear
    overlaps its dgrad's reduce-scatter with its wgrad; the collective's own backward then takes
    the result (``take``). A grad other than the one started (the output read twice: autograd
    summed the grads) is left to the collective to reduce itself."""

    __slots__ = ("run", "group", "grad", "out", "work")

    def __init__(self, run, group):
        self.run, self.group, self.grad, self.out, self.work = run, group, None, None, None

    def start(self, grad):
        self.grad = grad
        self.out, self.work = self.run(grad, self.group, async_op=True)

    def take(self, grad):
        started, out, work = self.grad, self.out, self.work
        self.grad = self.out = self.work = None
        if work is None or started is not grad:
            return self.run(grad, self.group)
        work.wait()  # (the current stream waits for it; the host does not)
        return out


def _with_pair(ctx, out, run, group):
    """``out``, the collective's output, carrying the Pair its backward runs (pair_of finds it)."""
    ctx.pair = out._fusegen_pair = Pair(run, group)
    return out


def pair_of(x):
    """The Pair of the collective whose output ``x`` is, or None (x is no collective's output;
    under torch.compile, where the collectives carry none)."""
    return None if torch.compiler.is_compiling() else getattr(x, "_fusegen_pair", None)


def start_pair(pair, grad):
    """Start ``pair`` (pair_of's) on ``grad``, the grad of the collective's output; None: nothing.
    """
    if pair is not None and grad is not None:
        pair.start(grad)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _with_pair(ctx, _gathered(x, group), _scattered, group)

    @staticmethod
    def backward(ctx, dy):
        return ctx.pair.take(dy), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _with_pair(ctx, _scattered(x, group), _gathered, group)

    @staticmethod
    def backward(ctx, dy):
        return ctx.pair.take(dy), None


class _AllReduce(torch.autograd.Function):  # (no Pair: its backward communicates nothing)
    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _CompiledCopyToGroup(torch.autograd.Function):  # under torch.compile: no Pair
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _summed(dy, ctx.group), None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _with_pair(ctx, x.view_as(x), _summed, group)

    @staticmethod
    def backward(ctx, dy):
        return ctx.pair.take(dy), None


def all_gather(x, group):
    """The ranks' rows joined in rank order; backward: the grad reduce-scattered (TE's AllGather).
    """
    if torch.compiler.is_compiling():
        return funcol.all_gather_tensor_autograd(x.contiguous(), 0, group)
    return _AllGather.apply(x, group)


def reduce_scatter(x, group):
    """The ranks' tensors summed, each rank keeping its rows; backward: the grad all-gathered."""
    if torch.compiler.is_compiling():
        return funcol.reduce_scatter_tensor_autograd(x.contiguous(), "sum", 0, group)
    return _ReduceScatter.apply(x, group)


def all_reduce(x, group):
    """The ranks' tensors summed; backward: the grad as it is (TE's AllReduce)."""
    return _AllReduce.apply(x, group)


def copy_to_group(x, group):
    """y = x; backward: the grad all-reduced (a column-parallel Linear's input without sequence
    parallelism, as TE's BasicLinear all-reduces its dgrad)."""
    return (_CompiledCopyToGroup if torch.compiler.is_compiling() else _CopyToGroup).apply(x, group)


_SYMMETRIC = {}  # group name -> whether PyTorch's symmetric memory serves the group


def _symmetric(x, group):
    """Whether the fused collective matmuls of symmetric memory run for ``x`` on ``group``: CUDA
    tensors and a torch with them; enabled for the group on first use."""
    if not x.is_cuda:
        return False
    name = group.group_name
    if name not in _SYMMETRIC:
        try:
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group

            enable_symm_mem_for_group(name)
            _SYMMETRIC[name] = hasattr(torch.ops, "symm_mem") and hasattr(
                torch.ops.symm_mem, "fused_all_gather_matmul")
        # (a torch without it: NCCL's collective, then the GEMM)
        except (ImportError, RuntimeError):
            _SYMMETRIC[name] = False
    return _SYMMETRIC[name]


def all_gather_matmul(a, b, group):
    """(a all-gathered along its rows, that @ b): on CUDA micro-pipelined over symmetric memory
    (each rank's rows multiplied as they arrive: torch.ops.symm_mem.fused_all_gather_matmul);
    elsewhere the all-gather, then the GEMM."""
    a = a.contiguous()
    if not torch.compiler.is_compiling() and _symmetric(a, group):
        gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group.group_name)
        return gathered, out
    gathered = _gathered(a, group)
    return gathered, gathered @ b


def matmul_reduce_scatter(a, b, group):
    """a @ b summed over the ranks, each keeping its share of the rows: on CUDA micro-pipelined
    over symmetric memory (torch.ops.symm_mem.fused_matmul_reduce_scatter); elsewhere the GEMM,
    then the reduce-scatter."""
    a = a.contiguous()
    if not torch.compiler.is_compiling() and _symmetric(a, group):
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group.group_name)
    return _scattered(a @ b, group)
