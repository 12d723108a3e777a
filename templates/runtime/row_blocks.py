"""A parameter held as named row blocks (TE's ``parameters_split``, te.MultiheadAttention's
``query_weight``/``key_weight``/``value_weight`` with fuse_qkv_params=False) joined into the one
tensor a GEMM reads, and a fixed row order (TE's qkv_weight_interleaved rows handed to the GEMM in
the order its consumer reads) (part of a fusegen output's runtime: templates/runtime/, copied
verbatim; do not edit).
"""

import torch


def _adjacent(blocks) -> bool:
    """Whether ``blocks`` follow one another, rows after rows, in one storage (as TE allocates them
    and a module built here does, until ``.to()`` or ``param.data = ...`` re-creates them)."""
    first = blocks[0]
    if not all(b.is_contiguous() and b.dim() == first.dim() and b.shape[1:] == first.shape[1:]
               and b.dtype == first.dtype and b.device == first.device for b in blocks):
        return False
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for block in blocks:
        if block.untyped_storage().data_ptr() != storage or block.storage_offset() != offset:
            return False
        offset += block.numel()
    return True


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
    return _JoinAdjacent.apply(*blocks)


def rows_in_order(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``tensor``'s rows in ``order`` (a fixed permutation computed at generate time): one gather a
    forward, its grad scattered back into the parameter's own layout by autograd."""
    return tensor.index_select(0, order.to(tensor.device))
