"""The self-attention ops' reference math (ops/attention.py: what the ops compute; shipped by
source into the output's ``_reference.py`` with them): positions and rotary embedding per
sequence, the split of the fused projection, and softmax attention with its dropout, per
sequence with an explicit mask, in the precision of the tensors given."""

import math

from .common import uniform
from .lazy import torch


def attention_positions(cu_seqlens, total, device):
    """Each row's position inside its sequence (0 at each sequence's first row), int64."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=device, dtype=torch.int64) - starts


def attention_rotary_angles(cu_seqlens, total, head_dim, base, like):
    """cos and sin [total, 1, head_dim] of the rotary angles pos * base^(-2i/d), each half
    repeated."""
    position = attention_positions(cu_seqlens, total, like.device).to(like.dtype)
    exponent = torch.arange(0, head_dim, 2, device=like.device, dtype=like.dtype) / head_dim
    angle = position[:, None] * torch.pow(torch.full_like(exponent, base), -exponent)[None, :]
    angle = torch.cat([angle, angle], dim=-1)[:, None, :]
    return torch.cos(angle), torch.sin(angle)


def attention_rotary(t, cos, sin, inverse):
    """Rotate-half rotary embedding of t [total, heads, head_dim]: t cos + rotate_half(t) sin, with
    rotate_half([a | b]) = [-b | a] (``cos``, ``sin``: attention_rotary_angles', shared by q and
    k). ``inverse``: its transpose (the backward: the same rotation by the negated angle)."""
    if inverse:
        sin = -sin
    a, b = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-b, a], dim=-1) * sin


def attention_split(x, heads, kv_heads):
    """q [total, heads, d], k and v [total, kv_heads, d] of the fused projection."""
    head_dim = x.shape[-1] // (heads + 2 * kv_heads)
    heads_in_x = x.reshape(x.shape[0], heads + 2 * kv_heads, head_dim)
    q, k, v = heads_in_x.split([heads, kv_heads, kv_heads], dim=1)
    return q, k, v


def attention_bounds(cu_seqlens, q):
    """The sequences' offsets as host ints, which the per-sequence math loops over: none on meta
    tensors (the shapes alone). Reading them is a copy to the host, which a CUDA graph cannot
    capture: an fp32 layer on CUDA runs this math, a bf16 or fp16 one FlashAttention-2, which can."""
    if q.is_meta:
        return []
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("attention in float32 on CUDA runs its reference math sequence by "
                           "sequence, reading the offsets on the host, which a CUDA graph cannot "
                           "capture; capture the module in bfloat16 or float16 (FlashAttention-2), "
                           "or run it uncaptured")
    return cu_seqlens.tolist()


def attention_blocks(cu_seqlens, q, causal):
    """The row ranges the reference math attends within, each with its mask (True: attends; None:
    all): one range a sequence, read on the host (attention_bounds). Under torch.compile, where a
    host read is a graph break, one range of every row with the sequences' block-diagonal mask
    (made on the device from the offsets): the same math in memory quadratic in the rows, so
    fp32 and CPU layers compile with fullgraph (meant for tests and small inputs; bf16/fp16 on
    CUDA runs FlashAttention-2)."""
    total = q.shape[0]
    if torch.compiler.is_compiling():
        cu = cu_seqlens.to(device=q.device, dtype=torch.int64)
        count = cu.shape[0] - 1
        sequence = torch.repeat_interleave(torch.arange(count, device=q.device), cu[1:] - cu[:-1], output_size=total)
        keep = sequence[:, None] == sequence[None, :]  # a row attends within its own sequence
        if causal:
            keep = keep & torch.ones(total, total, dtype=torch.bool, device=q.device).tril()
        return [(0, total, keep)]
    bounds = attention_bounds(cu_seqlens, q)
    blocks = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            causal_mask = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).tril()
            blocks.append((start, end, causal_mask if causal else None))
    return blocks


def attention_dropout_scale(key, dropout, heads, total, start, end, like):
    """The reference path's dropout of the probabilities of rows start:end (keys start:end):
    keep / (1 - p) [heads, end - start, end - start] in ``like``'s dtype, or None without dropout
    (``key`` None). Probability (h, i, j) of the whole [heads, total, total] matrix (i, j: rows of
    the packed batch) is kept where ``uniform(key, (h * total + i) * total + j)`` (ops/common.py,
    24-bit draws) is at least p rounded up to a multiple of 2**-24, so every split of the rows (per
    sequence, or all at once under torch.compile) draws the same mask, and the backward
    regenerates it from the saved key."""
    if key is None:
        return None
    device = like.device
    h = torch.arange(heads, dtype=torch.int64, device=device)[:, None, None]
    i = torch.arange(start, end, dtype=torch.int64, device=device)[None, :, None]
    j = torch.arange(start, end, dtype=torch.int64, device=device)[None, None, :]
    threshold = math.ceil(dropout * 2**24) / 2**24
    keep = uniform(key.reshape(-1)[:1], (h * total + i) * total + j) >= threshold
    return keep.to(like.dtype) / (1.0 - dropout)


def attention_core(q, k, v, cu_seqlens, causal, dropout=0.0, key=None):
    """Softmax(q k^T / sqrt(d) + mask) v per sequence: out [total, heads, d] and the softmax's
    log-sum-exp [total, heads] (of the probabilities before dropout). ``key`` (int64, its first
    element the key; None: no dropout): the probabilities dropped with probability ``dropout``
    (``attention_dropout_scale``)."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[:2], dtype=q.dtype, device=q.device)
    for start, end, keep in attention_blocks(cu_seqlens, q, causal):
        qs = q[start:end].transpose(0, 1)  # [heads, L, d]
        ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        lse[start:end] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        p = torch.softmax(scores, dim=-1)
        scale = attention_dropout_scale(key, dropout, heads, q.shape[0], start, end, p)
        if scale is not None:
            p = p * scale
        out[start:end] = (p @ vs).transpose(0, 1)
    return out, lse


def attention_core_bwd(dout, q, k, v, cu_seqlens, causal, dropout=0.0, key=None):
    """dq, dk, dv of ``attention_core``'s out (a kv head's grads summed over the q heads that
    read it), with the forward's dropout mask regenerated from ``key``."""
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for start, end, keep in attention_blocks(cu_seqlens, q, causal):
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        do = dout[start:end].transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        dp = do @ vs.transpose(1, 2)
        kept = attention_dropout_scale(key, dropout, q.shape[1], q.shape[0], start, end, p)
        dropped = p if kept is None else p * kept  # what multiplied v in the forward
        if kept is not None:  # the grad of p through the mask
            dp = dp * kept
        ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
        dq[start:end] = (ds @ ks * scale).transpose(0, 1)
        dks = (ds.transpose(1, 2) @ qs * scale).reshape(kv_heads, group, end - start, -1).sum(dim=1)
        dvs = (dropped.transpose(1, 2) @ do).reshape(kv_heads, group, end - start, -1).sum(dim=1)
        dk[start:end] = dks.transpose(0, 1)
        dv[start:end] = dvs.transpose(0, 1)
    return dq, dk, dv


def attention_inputs(x, cu_seqlens, heads, kv_heads, rotary_base):
    """q, k, v [total, heads, d] of the fused projection, rotary applied to q and k."""
    q, k, v = attention_split(x, heads, kv_heads)
    if rotary_base is not None:  # one table of angles for q and k
        cos, sin = attention_rotary_angles(cu_seqlens, q.shape[0], q.shape[-1], rotary_base, q)
        q, k = attention_rotary(q, cos, sin, False), attention_rotary(k, cos, sin, False)
    return q, k, v


def attention_inputs_bwd(dq, dk, dv, cu_seqlens, rotary_base):
    """The fused projection's grad [total, (heads + 2 kv_heads) d] from q's, k's and v's."""
    if rotary_base is not None:  # one table of angles for q's and k's grads
        cos, sin = attention_rotary_angles(cu_seqlens, dq.shape[0], dq.shape[-1], rotary_base, dq)
        dq, dk = attention_rotary(dq, cos, sin, True), attention_rotary(dk, cos, sin, True)
    return torch.cat([dq, dk, dv], dim=1).reshape(dq.shape[0], -1)
