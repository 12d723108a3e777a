"""A parameter held as named row blocks (TE's ``parameters_split``, te.MultiheadAttention's
``query_weight``/``key_weight``/``value_weight`` with fuse_qkv_params=False) joined into the one
tensor a GEMM reads, and kept one buffer when a module is moved or cast; a QKV parameter whose
rows go per GQA group (TE's qkv_weight_interleaved) handed to the GEMM as [q | k | v] (part of a
fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).

Two ways to join the blocks under autograd: a module whose one autograd.Function takes the blocks
themselves (after the arguments of its stages) hands its stages ``rows_view`` (no autograd node:
the Function splits the parameter's grad per block, ``split_rows``); a module running user modules
between Functions joins them with ``join_rows``, an autograd node of its own.
"""

import torch


def _adjacent(blocks) -> bool:
    """Whether ``blocks`` follow one another, rows after rows, in one storage (as TE allocates them
    and a module built here does, until ``param.data = ...`` re-creates one). One pass of cheap
    reads a call (a forward's host time counts at a few rows): the blocks' addresses follow one
    another and the first's storage holds them all (memory of one allocation is one storage's)."""
    first = blocks[0]
    address, dtype, tail = first.data_ptr(), first.dtype, first.shape[1:]
    for block in blocks:  # (one device: the addresses of one storage)
        if (block.data_ptr() != address or block.dtype is not dtype or block.shape[1:] != tail
                or not block.is_contiguous()):
            return False
        address += block.nbytes
    storage = first.untyped_storage()
    return address <= storage.data_ptr() + storage.nbytes()


class _JoinAdjacent(torch.autograd.Function):
    """The adjacent blocks as one view of their storage (no copy); the grad split back per block."""

    @staticmethod
    def forward(ctx, *blocks):
        ctx.rows = [b.shape[0] for b in blocks]
        first = blocks[0]
        shape = (sum(ctx.rows), *first.shape[1:])
        return first.as_strided(shape, first.stride(), first.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.split(ctx.rows, dim=0))


def join_rows(*blocks: torch.Tensor) -> torch.Tensor:
    """TE's noop_cat (module/_common.py) along dim 0: the blocks' rows as one tensor, a view of their
    storage where they are adjacent, else ``torch.cat``; each block gets its slice of the grad.
    Under torch.compile it is ``torch.cat`` (storage addresses cannot be traced; the compiler may
    fold the copy into its consumer)."""
    if len(blocks) == 1:
        return blocks[0]
    if torch.compiler.is_compiling() or not _adjacent(blocks):
        return torch.cat(blocks, dim=0)
    if not torch.is_grad_enabled():  # no grad to split: the view itself
        first = blocks[0]
        return first.as_strided((sum(b.shape[0] for b in blocks), *first.shape[1:]), first.stride())
    return _JoinAdjacent.apply(*blocks)


def rows_view(*blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' rows as the one tensor a generated Function's stages read, where that Function
    takes the blocks themselves as inputs and hands each its grad (split_rows): a view of their
    storage where they are adjacent, else ``torch.cat``, without autograd history either way (no
    autograd node per call, a host cost at a few rows). Under torch.compile it is ``torch.cat``,
    which the compiled graph differentiates (storage addresses cannot be traced). Called after
    the module's check_parameters, which leaves only their places to check here (_adjacent's
    pass less the shapes and dtypes, a host cost at a few rows)."""
    if torch.compiler.is_compiling():
        return torch.cat(blocks, dim=0)
    first = blocks[0]
    address, rows = first.data_ptr(), 0
    for block in blocks:  # (after check_parameters: their shapes, one dtype, one device)
        if block.data_ptr() != address or not block.is_contiguous():
            break
        address += block.nbytes
        rows += block.shape[0]
    else:
        storage = first.untyped_storage()
        if address <= storage.data_ptr() + storage.nbytes():
            return first.detach().as_strided((rows, *first.shape[1:]), first.stride())
    with torch.no_grad():
        return torch.cat(blocks, dim=0)


def split_rows(grad, rows):
    """The grads of the row blocks ``rows`` long that a parameter's ``grad`` holds (None: none)."""
    return (None,) * len(rows) if grad is None else torch.split_with_sizes(grad, rows)


def adjacent_rows(holder: torch.nn.Module, names) -> None:
    """Makes the row blocks ``names`` of ``holder`` one buffer again where ``.to()``, ``.cuda()``
    or ``.half()`` (``Module._apply``) re-created each on its own: each parameter keeps its
    object (an optimizer's reference stays good), its data becomes its slice of one new buffer, so
    join_rows reads them without a copy again."""
    blocks = [holder._parameters[name] for name in names]
    first = blocks[0].data
    if _adjacent([b.data for b in blocks]) or not all(
            b.dtype == first.dtype and b.device == first.device and b.shape[1:] == first.shape[1:] for b in blocks):
        return
    buffer = torch.cat([b.data for b in blocks], dim=0)
    start = 0
    for block in blocks:
        rows = block.shape[0]
        block.data = buffer[start:start + rows]
        start += rows


def rows_after_load(module: torch.nn.Module, incompatible_keys) -> None:
    """A generated module's load_state_dict post hook: load_state_dict(assign=True) makes each
    loaded tensor a parameter of its own, so TE's row blocks are one buffer again after it (the
    module's ``_adjacent_row_blocks``: adjacent_rows, as after ``.to()``)."""
    module._adjacent_row_blocks()


def grouped_rows(tensor: torch.Tensor, groups: int, per_group: int) -> torch.Tensor:
    """TE's qkv_weight_interleaved rows, [group: its ``per_group`` q heads, its k head, its v head]
    (TE's view [groups, per_group + 2, head_dim]), as the [all q heads | all k heads | all v heads]
    rows fusegen's attention reads: one copy a forward (a weight or a bias), its grad handed back in
    TE's order by autograd."""
    by_group = tensor.unflatten(0, (groups, per_group + 2, -1))  # [groups, heads a group + 2, head_dim, ...]
    q, k, v = by_group.split([per_group, 1, 1], dim=1)
    return torch.cat([q.flatten(0, 2), k.flatten(0, 2), v.flatten(0, 2)], dim=0)
