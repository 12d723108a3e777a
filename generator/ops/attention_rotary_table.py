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
(gradients by autograd). The generated forward takes the keyword and refuses a table (runtime
te_sequences): the stage and the prep kernel's table variant are the next step (README "TE's
modules" says so).
Written as shipped reference math (torch through ``.lazy``, no closure), ready for ops/shipped.py.
"""

from .lazy import torch


def rotary_table_of(rotary_pos_emb, head_dim, longest, device):
    """The angles [max_s, d] (float32) of TE's ``rotary_pos_emb``, checked against the call: a
    tensor [max_s, 1, 1, d] (or a (q, k) tuple of the one tensor) of float32 on ``device``, d even
    and at most ``head_dim``, max_s at least the ``longest`` sequence. Raises ValueError saying
    what to pass."""
    where = "forward(rotary_pos_emb=...)"
    if isinstance(rotary_pos_emb, (tuple, list)):
        if len(rotary_pos_emb) != 2 or rotary_pos_emb[0] is not rotary_pos_emb[1]:
            raise ValueError(f"{where}: a (q, k) tuple of two different tables is not supported (fusegen rotates "
                             "q and k by one table); pass one tensor, as TE's RotaryPositionEmbedding returns")
        rotary_pos_emb = rotary_pos_emb[0]
    if not isinstance(rotary_pos_emb, torch.Tensor):
        raise ValueError(f"{where}: must be a tensor [max_s, 1, 1, d] of angles (TE's RotaryPositionEmbedding"
                         f"(d)(max_s)), got {type(rotary_pos_emb).__name__}")
    table = rotary_pos_emb
    shape = tuple(table.shape)
    if table.dim() != 4 or shape[1:3] != (1, 1):
        raise ValueError(f"{where}: must have shape [max_s, 1, 1, d] (TE's RotaryPositionEmbedding(d)(max_s)), got "
                         f"{list(shape)}")
    if table.dtype != torch.float32:
        raise ValueError(f"{where}: must be float32 angles (as TE's RotaryPositionEmbedding returns), got "
                         f"{table.dtype}")
    device = torch.device(device)  # "cuda" (no index) matches any CUDA device's table
    if table.device.type != device.type or (device.index is not None and table.device.index != device.index):
        raise ValueError(f"{where}: is on {table.device}, the input on {device}; move the table to the input's device")
    rotated = shape[3]
    if rotated == 0 or rotated % 2 or rotated > head_dim:
        raise ValueError(f"{where}: d = {rotated} must be even and between 2 and head_dim = {head_dim} (rotate-half "
                         "rotates the first d features of each head: TE's rotary_percent * head_dim)")
    if shape[0] < longest:
        raise ValueError(f"{where}: has {shape[0]} positions but the longest sequence has {longest} tokens; build "
                         f"it for at least {longest} (RotaryPositionEmbedding(d)(max_seq_len))")
    return table.reshape(shape[0], rotated)


def attention_rotary_table_angles(cu_seqlens, total, table, like):
    """cos and sin [total, 1, d] in ``like``'s dtype of ``table`` [max_s, d] (rotary_table_of's) at
    each row's position inside its sequence."""
    cu = cu_seqlens.to(device=like.device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    position = torch.arange(total, device=like.device, dtype=torch.int64) - starts
    angle = table.to(device=like.device, dtype=like.dtype)[position][:, None, :]
    return torch.cos(angle), torch.sin(angle)


def attention_rotary_partial(t, cos, sin, inverse):
    """Rotate-half rotary embedding of the first d = cos.shape[-1] features of t [total, heads,
    head_dim] (t cos + rotate_half(t) sin, rotate_half([a | b]) = [-b | a]); the rest pass.
    ``inverse``: its transpose (the backward: the rotation by the negated angle)."""
    if inverse:
        sin = -sin
    rotated = cos.shape[-1]
    head, rest = t[..., :rotated], t[..., rotated:]
    a, b = head.chunk(2, dim=-1)
    return torch.cat([head * cos + torch.cat([-b, a], dim=-1) * sin, rest], dim=-1)


def self_attention_from_table(x, cu_seqlens, heads, kv_heads, causal, rotary_base, dropout, table, *, training=False):
    """The op's reference forward (ops/attention.py self_attention) with q and k rotated by
    ``table`` [max_s, d] (rotary_table_of's) instead of angles from ``rotary_base``, which must be
    None (one rotary, not two); in ``training`` with ``dropout`` > 0 under a fresh key, as
    self_attention."""
    from .attention import attention_core, attention_split  # the op's own math, imported when run
    from .common import new_seed

    if rotary_base is not None:
        raise ValueError(f"forward(rotary_pos_emb=...): the attention op already rotates by rotary_base="
                         f"{rotary_base:g}; pass one rotary, the table or the base")
    q, k, v = attention_split(x, heads, kv_heads)
    cos, sin = attention_rotary_table_angles(cu_seqlens, q.shape[0], table, q)
    q, k = attention_rotary_partial(q, cos, sin, False), attention_rotary_partial(k, cos, sin, False)
    key = new_seed(x) if training and dropout > 0 else None
    return attention_core(q, k, v, cu_seqlens, causal, dropout, key)[0].reshape(x.shape[0], -1)
