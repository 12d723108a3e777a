"""Tensor parallelism (issue 41): a generated module's group, and its parameters' shards against a
full, unsharded state_dict. The communication itself: collectives.py.
"""

import torch


def group_of(module, group, size):
    """The process group a module's collectives run on: ``group``, or the world's where None (TE's
    default), checked to have the ``size`` ranks the module is built for."""
    group, ranks = _given(module, group, (size,))
    if ranks != size:
        raise ValueError(f"{module}: the tensor-parallel group has {ranks} ranks, but the module is built for {size} "
                         f"([tool.fusegen.pipelines.<name>] tensor_parallel_size = {size}); give it a group of {size} "
                         f"ranks, or build the pipeline for {ranks}")
    return group


def built_size(module, group, sizes):
    """Which of the tensor-parallel ``sizes`` a module built for several (``tensor_parallel_size =
    [...]``) runs at: ``group``'s size (the world's where None, as TE's; 1 where torch.distributed
    is not initialised and None is given), or a clear error."""
    dist = torch.distributed
    if group is None and 1 in sizes and not (dist.is_available() and dist.is_initialized()):
        return 1
    _, size = _given(module, group, sizes)
    if size not in sizes:
        raise ValueError(f"{module} is built for tensor-parallel groups of {' and '.join(map(str, sizes))} ranks, but "
                         f"the group has {size}; build it for {size} too ([tool.fusegen.pipelines.<name>] "
                         f"tensor_parallel_size = {sorted({*sizes, size})}), or give it a group of one of those sizes")
    return size


def _given(module, group, sizes):
    """(the group, its size): ``group``, or the world's where None; torch.distributed initialised
    and a ProcessGroup given, or a clear error naming the ``sizes`` the module is built for."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        built = f"a tensor-parallel group of {sizes[0]}" if len(sizes) == 1 else (
            f"tensor-parallel groups of {' and '.join(map(str, sizes))}")
        raise RuntimeError(f"{module} is built for {built} ranks, but torch.distributed is not initialised in this "
                           f"process: launch one process a rank (torchrun --nproc-per-node {max(sizes)} ...), call "
                           "torch.distributed.init_process_group first, then construct it with "
                           "tensor_parallel_group= (the world's group where None)")
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{module}: tensor_parallel_group must be a torch.distributed.ProcessGroup (or None for the "
                        f"world's), got {type(group).__name__}")
    return group, dist.get_world_size(group)


def full_state_dict(module):
    """The module's state_dict as the unsharded pipeline's (every rank gets it whole): each sharded
    parameter gathered (the module's ``tensor_parallel_shards``: a row-parallel weight's columns;
    a column-parallel one's rows, in sections that each split over the ranks: a GLU's gates and
    linears, attention's q, k and v), a row-parallel Linear's bias (each rank's added before the
    reduction, as TE's te.ops.Linear) summed over the ranks."""
    group, shards = module.tensor_parallel_group, module.tensor_parallel_shards
    state = {}
    for key, value in module.state_dict().items():
        split = shards.get(key)
        if split is None or not isinstance(value, torch.Tensor):
            state[key] = value
        elif split == "sum":
            state[key] = value.clone()
            torch.distributed.all_reduce(state[key], group=group)
        else:
            parts = [torch.empty_like(value) for _ in range(torch.distributed.get_world_size(group))]
            torch.distributed.all_gather(parts, value.contiguous(), group=group)
            if split == 1:
                state[key] = torch.cat(parts, dim=1)
            else:  # each rank's rows: its share of each section; the sections one after another
                ranks = len(parts)
                shares = [part.split([rows // ranks for rows in split]) for part in parts]
                state[key] = torch.cat([share[s] for s in range(len(split)) for share in shares])
    return state


def load_full_state_dict(module, state_dict, strict=True):
    """Load an unsharded state_dict (the pipeline's at tensor_parallel_size 1, or full_state_dict's)
    into this rank's shards: each sharded parameter's share (see full_state_dict); a row-parallel
    Linear's bias on rank 0, zeros on the others (their sum, which the module adds, is the bias)."""
    group, shards = module.tensor_parallel_group, module.tensor_parallel_shards
    rank, ranks = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
    local = {}
    for key, value in state_dict.items():
        split = shards.get(key)
        if split is None or not isinstance(value, torch.Tensor):
            local[key] = value
        elif split == "sum":
            local[key] = value if rank == 0 else torch.zeros_like(value)
        else:
            dim, whole = (1, None) if split == 1 else (0, sum(split))
            if value.dim() <= dim or value.shape[dim] != (whole or value.shape[dim]) or value.shape[dim] % ranks:
                raise ValueError(f"{type(module).__name__}: {key} has shape {list(value.shape)}, which is not the "
                                 f"unsharded parameter's " + (f"({whole} rows)" if whole else "(columns over the "
                                 f"group's {ranks} ranks)") + "; is it the unsharded pipeline's state_dict?")
            if split == 1:
                local[key] = value.chunk(ranks, dim=1)[rank]
            else:  # this rank's share of each section
                local[key] = torch.cat([section.chunk(ranks)[rank] for section in value.split(list(split))])
    return module.load_state_dict(local, strict=strict)
