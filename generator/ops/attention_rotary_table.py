"""Rotary embedding from TE's per-call table (te.MultiheadAttention / te.TransformerLayer
``forward(rotary_pos_emb=...)``): the reference math and the run-time checks of the table.

TE's RotaryPositionEmbedding (transformer_engine/pytorch/attention/rope.py) returns a float32
tensor ``[max_s, 1, 1, d]`` of angles, ``cat(freqs, freqs)`` with ``freqs = outer(positions,
inv_freq)``; ``apply_rotary_pos_emb`` (rotate-half, TE's default ``interleaved=False``) rotates the
first ``d`` features of each q and k head by the angles of the row's position inside its sequence
(``thd``: restarting at each cu_seqlens offset) and passes the rest (``d < head_dim`` when TE's
``rotary_percent < 1``). ``attention_rotary_angles`` (ops/attention.py) is this with the table
computed from a base, so a table built from the same base gives the same rotation.

fusegen.eager's modules take ``forward(rotary_pos_emb=...)`` through ``self_attention_from_table``
(gradients by autograd). The generated modules of TE's attention modules take it as their
``rotary_table`` argument (``rotary_table_argument``: checked, [0, d] for None), which the attention
stage hands the prep kernels' table variant (stages/attention/kernels.py; their CPU launchers run
``attention_inputs_table`` / ``attention_inputs_table_bwd``). TE's two halves' angles (entries i
and i + d/2) are equal in its own tables; everything here is exact for any table.
Shipped reference math (torch through ``.lazy``, no closure; ops/attention.py lists it).
"""

from .attention_math import attention_core, attention_positions, attention_split
from .common import new_seed
from .lazy import torch


def rotary_table_of(rotary_pos_emb, head_dim, longest, device):
    """The angles [max_s, d] (float32) of TE's ``rotary_pos_emb``, checked against the call: a
    tensor [max_s, 1, 1, d] (or a (q, k) tuple of the one tensor) of float32 on ``device``, d even
    and at most ``head_dim``, max_s at least the ``longest`` sequence. Raises ValueError saying
    what to pass."""
    where = "forward(rotary_pos_emb=...)"
    te_table = "TE's RotaryPositionEmbedding(d)(max_s)"
    if isinstance(rotary_pos_emb, (tuple, list)):
        if len(rotary_pos_emb) != 2 or rotary_pos_emb[0] is not rotary_pos_emb[1]:
            raise ValueError(f"{where}: a (q, k) tuple of two different tables is not "
                             "supported (fusegen rotates q and k by one table); pass one "
                             "tensor, as TE's RotaryPositionEmbedding returns")
        rotary_pos_emb = rotary_pos_emb[0]
    if not isinstance(rotary_pos_emb, torch.Tensor):
        raise ValueError(f"{where}: must be a tensor [max_s, 1, 1, d] of angles ({te_table}), "
                         f"got {type(rotary_pos_emb).__name__}")
    table = rotary_pos_emb
    shape = tuple(table.shape)
    if table.dim() != 4 or shape[1:3] != (1, 1):
        raise ValueError(f"{where}: must have shape [max_s, 1, 1, d] ({te_table}), got "
                         f"{list(shape)}")
    if table.dtype != torch.float32:
        raise ValueError(f"{where}: must be float32 angles (as TE's RotaryPositionEmbedding "
                         f"returns), got {table.dtype}")
    device = torch.device(device)  # "cuda" (no index) matches any CUDA device's table
    if table.device.type != device.type or (device.index is not None
                                            and table.device.index != device.index):
        raise ValueError(f"{where}: is on {table.device}, the input on {device}; move the "
                         "table to the input's device")
    rotated = shape[3]
    if rotated == 0 or rotated % 2 or rotated > head_dim:
        raise ValueError(f"{where}: d = {rotated} must be even and between 2 and head_dim = "
                         f"{head_dim} (rotate-half rotates the first d features of each head: "
                         "TE's rotary_percent * head_dim)")
    if shape[0] < longest:
        raise ValueError(f"{where}: has {shape[0]} positions but the longest sequence has "
                         f"{longest} tokens; build it for at least {longest} "
                         "(RotaryPositionEmbedding(d)(max_seq_len))")
    return table.reshape(shape[0], rotated)


def attention_rotary_table_angles(cu_seqlens, total, table, like):
    """cos and sin [total, 1, d] in ``like``'s dtype of ``table`` [max_s, d] (rotary_table_of's) at
    each row's position inside its sequence."""
    position = attention_positions(cu_seqlens, total, like.device)
    angle = table.to(device=like.device, dtype=like.dtype)[position][:, None, :]
    return torch.cos(angle), torch.sin(angle)


def attention_rotary_partial(t, cos, sin, inverse):
    """Rotate-half rotary embedding of the first d = cos.shape[-1] features of t [total, heads,
    head_dim] (t cos + rotate_half(t) sin, rotate_half([a | b]) = [-b | a], as TE's): with the
    halves' angles t_i and t_{i + d/2}, [a cos t_i - b sin t_i | b cos t_{i+d/2} + a sin t_{i+d/2}];
    the rest pass. ``inverse``: its transpose (the backward), [a cos t_i + b sin t_{i+d/2} |
    b cos t_{i+d/2} - a sin t_i] (the rotation by the negated angle where the halves agree)."""
    rotated = cos.shape[-1]
    head, rest = t[..., :rotated], t[..., rotated:]
    a, b = head.chunk(2, dim=-1)
    (c1, c2), (s1, s2) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    if inverse:
        return torch.cat([a * c1 + b * s2, b * c2 - a * s1, rest], dim=-1)
    return torch.cat([a * c1 - b * s1, b * c2 + a * s2, rest], dim=-1)


def attention_inputs_table(x, cu_seqlens, heads, kv_heads, table):
    """q, k, v [total, heads, d] of the fused projection, q and k rotated by ``table`` [max_s, d]
    (the prep kernels' table variant's CPU math; ops/attention.py attention_inputs with a table)."""
    q, k, v = attention_split(x, heads, kv_heads)
    cos, sin = attention_rotary_table_angles(cu_seqlens, q.shape[0], table, q)
    return attention_rotary_partial(q, cos, sin, False), attention_rotary_partial(k, cos, sin, False), v


def attention_inputs_table_bwd(dq, dk, dv, cu_seqlens, table):
    """The fused projection's grad [total, (heads + 2 kv_heads) d] from q's, k's and v's grads: the
    transpose of ``attention_inputs_table``."""
    cos, sin = attention_rotary_table_angles(cu_seqlens, dq.shape[0], table, dq)
    dq, dk = attention_rotary_partial(dq, cos, sin, True), attention_rotary_partial(dk, cos, sin, True)
    return torch.cat([dq, dk, dv], dim=1).reshape(dq.shape[0], -1)


def rotary_table_argument(module, rotary_pos_emb, head_dims, x):
    """A generated module's ``rotary_table`` from TE's forward(rotary_pos_emb=...), on the line
    before its packed sequences: None gives an empty float32 [0, d] on x's device (its attention
    stage then runs without rotary, as before); a table is checked by ``rotary_table_of`` against
    each attention op's head size ``head_dims`` and returned as [max_s, d], contiguous. Its rows
    against the longest sequence: packed_sequences' ``positions``, with the lengths (on the host
    where they are known there, else on the device in the one check of the lengths). The prep
    kernels rotate whole heads: d must be the head size (TE's rotary_percent < 1 runs in
    fusegen.eager)."""
    if rotary_pos_emb is None:
        return torch.empty(0, head_dims[0], dtype=torch.float32, device=x.device)
    for head_dim in head_dims:
        try:
            table = rotary_table_of(rotary_pos_emb, head_dim, 0, x.device)
        except ValueError as error:  # the module's name first, as its other checks' errors
            raise ValueError(f"{module}: {error}") from None
        if table.shape[1] != head_dim:
            raise ValueError(f"{module}: forward(rotary_pos_emb=...) rotates d = "
                             f"{table.shape[1]} features of each head, but fusegen's generated "
                             f"attention rotates whole heads (head_dim = {head_dim}); TE's "
                             "rotary_percent < 1 runs in fusegen.eager (its modules take any d)")
    return table.contiguous()


def self_attention_from_table(x, cu_seqlens, heads, kv_heads, causal, rotary_base, dropout, table, *, training=False):
    """The op's reference forward (ops/attention.py self_attention) with q and k rotated by
    ``table`` [max_s, d] (rotary_table_of's) instead of angles from ``rotary_base``, which must be
    None (one rotary, not two); in ``training`` with ``dropout`` > 0 under a fresh key, as
    self_attention."""
    if rotary_base is not None:
        raise ValueError(f"forward(rotary_pos_emb=...): the attention op already rotates by rotary_base="
                         f"{rotary_base:g}; pass one rotary, the table or the base")
    q, k, v = attention_split(x, heads, kv_heads)
    cos, sin = attention_rotary_table_angles(cu_seqlens, q.shape[0], table, q)
    q, k = attention_rotary_partial(q, cos, sin, False), attention_rotary_partial(k, cos, sin, False)
    key = new_seed(x) if training and dropout > 0 else None
    return attention_core(q, k, v, cu_seqlens, causal, dropout, key)[0].reshape(x.shape[0], -1)
