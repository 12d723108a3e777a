"""Self-attention over packed sequences: MultiHeadedSelfAttention, GroupedQueryAttention,
MultiQuerySelfAttention (the design note's te.ops spellings; TE itself has none yet).

Each reads the fused projection ``[total, (heads + 2 * kv_heads) * head_dim]`` (all q heads, then k
heads, then v heads; head_dim = hidden / heads) and writes ``[total, heads * head_dim]``. Tokens of
the batch are packed: sequence ``s`` holds rows ``cu_seqlens[s]:cu_seqlens[s + 1]`` (an int32
tensor of batch + 1 offsets) and attention never crosses a sequence boundary. Softmax scale
1/sqrt(head_dim); ``attn_mask_type`` "causal" or "no_mask"; ``rotary_base``: rotary embedding of
q and k (rotate-half, as Llama and GPT-NeoX: first half / second half of head_dim, inv_freq =
base^(-2i/d)), positions restarting at each sequence. Query head h reads kv head
h // (heads / kv_heads).

The reference math below is shipped by source into the output's ``_reference.py`` (ops/shipped.py)
and runs per sequence with an explicit mask, in ``compute``'s precision. The generated stage
(stages/attention/) launches a generated prep kernel (split, rotary; its CPU launcher runs
``attention_inputs``), calls ``flash_attention_forward`` / ``flash_attention_backward``, which run
PyTorch's FlashAttention-2 varlen kernels on CUDA bf16/fp16 tensors and ``attention_core`` /
``attention_core_bwd`` otherwise, and launches the backward prep kernel (``attention_inputs_bwd``
on CPU).
"""

import math

from .common import compute
from .lazy import torch
from .opdef import Arg, OpDef, register

# FlashAttention-2's head sizes (PyTorch's build): multiples of 8 up to 256.
MAX_HEAD_DIM = 256
MASK_TYPES = ("causal", "no_mask")
# The backend argument: TE's DotProductAttention is the one this op family runs (as FA2). A spec's
# te.DotProductAttention (or the name imported from transformer_engine.pytorch) reaches the binder
# as its name (Arg.objects); fusegen.eager takes the name or nothing.
BACKEND = "DotProductAttention"
BACKEND_OBJECTS = (f"transformer_engine.pytorch.{BACKEND}",)


# --- reference math (shipped) -------------------------------------------------------------------

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


def attention_core(q, k, v, cu_seqlens, causal):
    """Softmax(q k^T / sqrt(d) + mask) v per sequence: out [total, heads, d] and the softmax's
    log-sum-exp [total, heads]."""
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
        out[start:end] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1)
    return out, lse


def attention_core_bwd(dout, q, k, v, cu_seqlens, causal):
    """dq, dk, dv of ``attention_core``'s out (a kv head's grads summed over the q heads that
    read it)."""
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
        ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
        dq[start:end] = (ds @ ks * scale).transpose(0, 1)
        dks = (ds.transpose(1, 2) @ qs * scale).reshape(kv_heads, group, end - start, -1).sum(dim=1)
        dvs = (p.transpose(1, 2) @ do).reshape(kv_heads, group, end - start, -1).sum(dim=1)
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


def self_attention(x, cu_seqlens, heads, kv_heads, causal, rotary_base):
    """The op's reference forward: [total, (heads + 2 kv_heads) d] -> [total, heads d]."""
    q, k, v = attention_inputs(x, cu_seqlens, heads, kv_heads, rotary_base)
    return attention_core(q, k, v, cu_seqlens, causal)[0].reshape(x.shape[0], -1)


def self_attention_bwd(x, dy, cu_seqlens, heads, kv_heads, causal, rotary_base):
    """The op's reference backward: dx of ``self_attention``."""
    q, k, v = attention_inputs(x, cu_seqlens, heads, kv_heads, rotary_base)
    dq, dk, dv = attention_core_bwd(dy.reshape(q.shape), q, k, v, cu_seqlens, causal)
    return attention_inputs_bwd(dq, dk, dv, cu_seqlens, rotary_base)


# --- what the generated stage calls (shipped): FA2 on CUDA 16-bit, the reference math otherwise -

def attention_on_flash(x):
    """Whether ``x`` runs on PyTorch's FlashAttention-2 kernels (CUDA, bf16 or fp16)."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def flash_attention_forward(q, k, v, cu_seqlens, max_seqlen, causal):
    """out [total, heads d] of q [total, heads, d], k and v [total, kv_heads, d] (any row and head
    stride, a dense last dim: views of the prep kernel's buffer), and what the backward reads: the
    softmax's log-sum-exp, float32 [heads, total] (FA2's layout, on every path, so a torch.compile
    op's fake, which runs the reference math on meta tensors, has the real output's shape). On
    CUDA bf16/fp16 PyTorch's FlashAttention-2 varlen kernels; otherwise ``attention_core`` in
    ``compute``'s precision, out rounded to q's dtype. Dropout is 0, so FA2's rng state is not
    kept (torch.nn.attention.varlen does the same)."""
    if not attention_on_flash(q):
        out, lse = attention_core(compute(q), compute(k), compute(v), cu_seqlens, causal)
        return out.reshape(q.shape[0], -1).to(q.dtype), lse.t().float().contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, causal, False, scale=scale)
    return out.reshape(q.shape[0], -1), lse


def flash_attention_backward(dy, y, q, k, v, lse, cu_seqlens, max_seqlen, causal):
    """dq, dk, dv of ``flash_attention_forward``'s out from what it returned, in q's dtype (as FA2
    returns them; off FA2 ``attention_core_bwd`` in ``compute``'s precision, rounded once)."""
    if not attention_on_flash(q):  # the reference path (it recomputes the softmax)
        dout = compute(dy).reshape(q.shape)
        grads = attention_core_bwd(dout, compute(q), compute(k), compute(v), cu_seqlens, causal)
        return tuple(g.to(q.dtype) for g in grads)
    scale = 1.0 / math.sqrt(q.shape[-1])
    # dropout 0: FA2 reads no rng state; placeholders as torch.nn.attention.varlen passes
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dy.reshape(q.shape).contiguous(), q, k, v, y.reshape(q.shape), lse, cu_seqlens, cu_seqlens, max_seqlen,
        max_seqlen, 0.0, causal, rng_state, unused, scale=scale)
    return dq, dk, dv


def sequences_of(x2d, lead):
    """cu_seqlens (int32, on x's device) where no lengths are given: ``lead`` [batch, seq] is batch
    sequences of seq tokens (a 3-D input, flattened batch-major), any other lead one sequence."""
    total = x2d.shape[0]
    length = lead[-1] if len(lead) == 2 else total
    count = total // length if length else 0
    return torch.arange(0, count + 1, dtype=torch.int32, device=x2d.device) * length


# --- the ops ------------------------------------------------------------------------------------

def _backend(v):
    return None if v == BACKEND else (f"must be te.{BACKEND} (the one attention backend fusegen runs: "
                                         f"FlashAttention-2 on CUDA), got {v!r}; leave it out or pass te.{BACKEND}")


def _mask(v):
    return None if v in MASK_TYPES else (f"must be one of {', '.join(map(repr, MASK_TYPES))}, got {v!r}; other "
                                         "masks (padding, sliding window) are not supported")


def _format(v):
    return None if v in (None, *SEQUENCE_FORMATS) else (
        f"must be one of {', '.join(map(repr, SEQUENCE_FORMATS))} (TE's qkv_format), got {v!r}")


SEQUENCE_FORMATS = ("sbhd", "bshd", "thd")


def _positive(v):
    return None if v > 0 else "must be positive"


def _rotary_base(v):
    if v is None:
        return None
    return None if math.isfinite(v) and v > 1.0 else f"must be a finite number above 1 (Llama's 10000.0), got {v!r}"


def _head_dim(a) -> int:
    return a["hidden"] // a["heads"]


def _validate(a) -> str | None:
    """The checks across arguments: head counts that divide, a head size the kernels take."""
    hidden, heads, kv_heads = a["hidden"], a["heads"], a["kv_heads"]
    if hidden % heads:
        return f"heads={heads} must divide hidden={hidden} (each head takes hidden / heads features)"
    if heads % kv_heads:
        return (f"kv_heads={kv_heads} must divide heads={heads} (each kv head serves heads / kv_heads query "
                "heads)")
    head_dim = hidden // heads
    if a["rotary_base"] is not None and head_dim % 2:
        return f"rotary embedding rotates halves of each head, so head_dim = hidden / heads = {head_dim} must be even"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return (f"head_dim = hidden / heads = {head_dim}: the attention kernels (FlashAttention-2) take head sizes "
                f"that are multiples of 8 up to {MAX_HEAD_DIM}; choose heads so that hidden / heads is one")
    return None


def _sequence_args(a) -> tuple:
    return (a["heads"], a["kv_heads"], a["attn_mask_type"] == "causal", a["rotary_base"])


HIDDEN = Arg("hidden", "int", check=_positive)
HEADS = Arg("heads", "int", check=_positive)
BACKEND_ARG = Arg("backend", "str", BACKEND, check=_backend, in_kernel=False, objects=BACKEND_OBJECTS)
MASK = Arg("attn_mask_type", "str", "causal", keyword_only=True, check=_mask)
ROTARY = Arg("rotary_base", "float", None, keyword_only=True, check=_rotary_base)
# how the module's x is read (TE's qkv_format): None is fusegen's own call forms (a 3-D x batch first, a 2-D x
# one sequence or packed ones with seq_lens); "sbhd" a 3-D x [seq, batch, hidden] only, "bshd" [batch, seq,
# hidden] only, "thd" packed tokens [total, hidden] only. Not in the kernels: the module's forward reads it.
FORMAT = Arg("qkv_format", "str", None, keyword_only=True, in_kernel=False, check=_format)
HELPERS = (attention_positions, attention_rotary_angles, attention_rotary, attention_split, attention_bounds,
           attention_blocks, attention_core, attention_core_bwd, attention_inputs, attention_inputs_bwd,
           attention_on_flash, flash_attention_forward, flash_attention_backward, sequences_of)


def _attention(name, args, kv_heads, summary, helpers):
    register(OpDef(
        name, "attention", args=args,
        fixed_in=lambda a: (a["heads"] + 2 * kv_heads(a)) * _head_dim(a),
        out_features=lambda a, n: a["hidden"],
            validate=lambda a: _validate(_full(a, kv_heads)),
        tag=lambda a: _tag(_full(a, kv_heads)),
        reference=(self_attention, self_attention_bwd), reference_helpers=helpers,
        reference_args=lambda a: _sequence_args(_full(a, kv_heads)),
        reads_sequences=True, needs_input_in_backward=True, summary=summary,
    ))


def _full(a, kv_heads) -> dict:
    """The arguments with kv_heads filled in (MultiHeadedSelfAttention: heads; MultiQuery: 1)."""
    return {**a, "kv_heads": kv_heads(a)}


def _tag(a) -> str:
    rotary = f"_rope{a['rotary_base']:g}".replace(".", "p").replace("+", "") if a["rotary_base"] is not None else ""
    mask = "" if a["attn_mask_type"] == "causal" else "_nomask"
    return f"attn_h{a['heads']}_kv{a['kv_heads']}_d{_head_dim(a)}{mask}{rotary}"


_attention("MultiHeadedSelfAttention", (HIDDEN, HEADS, BACKEND_ARG, MASK, ROTARY, FORMAT), lambda a: a["heads"],
           "softmax(q k^T / sqrt(d)) v per sequence, a k and v head for each q head", HELPERS)
_attention("GroupedQueryAttention", (HIDDEN, HEADS, Arg("kv_heads", "int", check=_positive), BACKEND_ARG, MASK, ROTARY, FORMAT),
           lambda a: a["kv_heads"], "softmax(q k^T / sqrt(d)) v per sequence, kv_heads k and v heads shared by groups",
           HELPERS)
_attention("MultiQuerySelfAttention", (HIDDEN, HEADS, BACKEND_ARG, MASK, ROTARY, FORMAT), lambda a: 1,
           "softmax(q k^T / sqrt(d)) v per sequence, one k and v head shared by all", HELPERS)
