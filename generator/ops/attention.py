"""Self-attention over packed sequences: MultiHeadedSelfAttention, GroupedQueryAttention,
MultiQuerySelfAttention (the design note's te.ops spellings; TE itself has none yet).

Each reads the fused projection ``[total, (heads + 2 * kv_heads) * head_dim]`` (all q heads, then k
heads, then v heads; head_dim = hidden / heads) and writes ``[total, heads * head_dim]``. Tokens of
the batch are packed: sequence ``s`` holds rows ``cu_seqlens[s]:cu_seqlens[s + 1]`` (an int32
tensor of batch + 1 offsets) and attention never crosses a sequence boundary. Softmax scale
1/sqrt(head_dim); ``attn_mask_type`` "causal" or "no_mask"; ``dropout``: in training (the module's
``training``, TE's ``attention_dropout if self.training else 0.0``), each softmax probability is
kept with probability 1 - p and scaled by 1 / (1 - p) (none in eval); ``rotary_base``: rotary embedding of
q and k (rotate-half, as Llama and GPT-NeoX: first half / second half of head_dim, inv_freq =
base^(-2i/d)), positions restarting at each sequence. Query head h reads kv head
h // (heads / kv_heads).

The reference math (here and in ops/attention_math.py) is shipped by source into the output's ``_reference.py`` (ops/shipped.py)
and runs per sequence with an explicit mask, in ``compute``'s precision. The generated stage
(stages/attention/) launches a generated prep kernel (split, rotary; its CPU launcher runs
``attention_inputs``), calls ``flash_attention_forward`` / ``flash_attention_backward``, which run
PyTorch's FlashAttention-2 varlen kernels on CUDA bf16/fp16 tensors and ``attention_core`` /
``attention_core_bwd`` otherwise, and launches the backward prep kernel (``attention_inputs_bwd``
on CPU).
"""

import math

from .attention_math import (attention_blocks, attention_bounds, attention_core, attention_core_bwd,
                             attention_dropout_scale, attention_inputs, attention_inputs_bwd, attention_positions,
                             attention_rotary, attention_rotary_angles, attention_split)
from .attention_rotary_table import (attention_inputs_table, attention_inputs_table_bwd, attention_rotary_partial,
                                     attention_rotary_table_angles, rotary_table_argument, rotary_table_of)
from .common import compute, new_seed
from .lazy import torch
from .opdef import Arg, OpDef, check_probability, float_tag, register

# FlashAttention-2's head sizes (PyTorch's build): multiples of 8 up to 256.
MAX_HEAD_DIM = 256
MASK_TYPES = ("causal", "no_mask")
# The backend argument: TE's DotProductAttention is the one this op family runs (as FA2). A spec's
# te.DotProductAttention (or the name imported from transformer_engine.pytorch) reaches the binder
# as its name (Arg.objects); fusegen.eager takes the name or nothing.
BACKEND = "DotProductAttention"
BACKEND_OBJECTS = (f"transformer_engine.pytorch.{BACKEND}",)


# --- reference math (shipped; the helpers: ops/attention_math.py) -----------------------------

def self_attention(x, cu_seqlens, heads, kv_heads, causal, rotary_base, dropout=0.0, *, training=False):
    """The op's reference forward: [total, (heads + 2 kv_heads) d] -> [total, heads d]; in
    ``training`` with ``dropout`` > 0 under a fresh key from PyTorch's generator (differentiable
    by autograd: the mask is a constant factor)."""
    q, k, v = attention_inputs(x, cu_seqlens, heads, kv_heads, rotary_base)
    key = new_seed(x) if training and dropout > 0 else None
    return attention_core(q, k, v, cu_seqlens, causal, dropout, key)[0].reshape(x.shape[0], -1)


def self_attention_bwd(x, dy, cu_seqlens, heads, kv_heads, causal, rotary_base, dropout=0.0):
    """The op's reference backward: dx of ``self_attention`` in eval (no dropout)."""
    q, k, v = attention_inputs(x, cu_seqlens, heads, kv_heads, rotary_base)
    dq, dk, dv = attention_core_bwd(dy.reshape(q.shape), q, k, v, cu_seqlens, causal)
    return attention_inputs_bwd(dq, dk, dv, cu_seqlens, rotary_base)


# --- what the generated stage calls (shipped): FA2 on CUDA 16-bit, the reference math otherwise -

def attention_on_flash(x):
    """Whether ``x`` runs on PyTorch's FlashAttention-2 kernels (CUDA, bf16 or fp16)."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def flash_attention_forward(q, k, v, cu_seqlens, max_seqlen, causal, dropout=None):
    """out [total, heads d] of q [total, heads, d], k and v [total, kv_heads, d] (any row and head
    stride, a dense last dim: views of the prep kernel's buffer), and what the backward reads: the
    softmax's log-sum-exp, float32 [heads, total] (FA2's layout, on every path, so a torch.compile
    op's fake, which runs the reference math on meta tensors, has the real output's shape), and,
    where ``dropout`` is given (an op with dropout: the generated module passes ``p if training
    else 0.0``), the dropout's rng state: None where it is 0 (eval mode), else int64 [2] on every
    path. On CUDA bf16/fp16 PyTorch's
    FlashAttention-2 varlen kernels, which draw the mask from PyTorch's CUDA generator (philox,
    graph-safe: a CUDA graph's replay draws a fresh one) and return the seed and offset its
    backward reads (uint64 [2], kept as int64 [2]); otherwise ``attention_core`` in ``compute``'s
    precision, out rounded to q's dtype, the key a fresh one from PyTorch's generator (``[key,
    0]``; ``attention_dropout_scale``)."""
    p = dropout or 0.0
    if not attention_on_flash(q):
        rng = torch.cat([new_seed(q), torch.zeros(1, dtype=torch.int64, device=q.device)]) if p > 0 else None
        out, lse = attention_core(compute(q), compute(k), compute(v), cu_seqlens, causal, p, rng)
        out, lse = out.reshape(q.shape[0], -1).to(q.dtype), lse.t().float().contiguous()
    else:
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, p, causal, False, scale=scale)
        out, rng = out.reshape(q.shape[0], -1), rng_state.view(torch.int64) if p > 0 else None
    return (out, lse) if dropout is None else (out, lse, rng)


def flash_attention_backward(dy, y, q, k, v, lse, cu_seqlens, max_seqlen, causal, rng=None, dropout=0.0):
    """dq, dk, dv of ``flash_attention_forward``'s out from what it returned, in q's dtype (as FA2
    returns them; off FA2 ``attention_core_bwd`` in ``compute``'s precision, rounded once). ``rng``:
    the forward's rng state, None where it dropped nothing (then ``dropout`` is not applied)."""
    dropout = dropout if rng is not None else 0.0
    if not attention_on_flash(q):  # the reference path (it recomputes the softmax and the mask)
        dout = compute(dy).reshape(q.shape)
        grads = attention_core_bwd(dout, compute(q), compute(k), compute(v), cu_seqlens, causal, dropout, rng)
        return tuple(g.to(q.dtype) for g in grads)
    scale = 1.0 / math.sqrt(q.shape[-1])
    # without dropout FA2 reads no rng state: placeholders as torch.nn.attention.varlen passes
    rng_state = rng.view(torch.uint64) if rng is not None else torch.zeros((2,), dtype=torch.uint64, device=q.device)
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dy.reshape(q.shape).contiguous(), q, k, v, y.reshape(q.shape), lse, cu_seqlens, cu_seqlens, max_seqlen,
        max_seqlen, dropout, causal, rng_state, unused, scale=scale)
    return dq, dk, dv


def sequences_of(x2d, lead):
    """cu_seqlens (int32, on x's device) where no lengths are given: ``lead`` [batch, seq] is batch
    sequences of seq tokens (a 3-D input, flattened batch-major), any other lead one sequence."""
    total = x2d.shape[0]
    length = lead[-1] if len(lead) == 2 else total
    count = total // length if length else 0
    return torch.arange(0, count + 1, dtype=torch.int32, device=x2d.device) * length


def batch_major(rows, cu_seqlens):
    """``rows`` in [seq, batch] order (TE's "sbhd" under sequence parallelism: the ranks' shares of
    each sequence gathered along seq) as [batch, seq] rows, each sequence's together (what the
    attention reads), a new tensor; the batch is cu_seqlens' sequences."""
    return rows.unflatten(0, (-1, cu_seqlens.shape[0] - 1)).transpose(0, 1).reshape(rows.shape)


def sequence_major(rows, cu_seqlens):
    """``batch_major``'s inverse: [batch, seq] rows back in [seq, batch] order."""
    return rows.unflatten(0, (cu_seqlens.shape[0] - 1, -1)).transpose(0, 1).reshape(rows.shape)


def reads_rotary_table(opdef, args) -> bool:
    """Whether an op rotates q and k by TE's per-call table (forward(rotary_pos_emb=...), ops/
    attention_rotary_table.py): an attention op of TE's modules (its qkv_format set: the module takes
    TE's forward keywords) without a rotary_base of its own."""
    return opdef.reads_sequences and args.get("qkv_format") is not None and args.get("rotary_base") is None


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


def _dropout(v):
    return check_probability(v) or (None if v < 1.0 else "must be below 1 (1 drops every probability)")


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
    return (a["heads"], a["kv_heads"], a["attn_mask_type"] == "causal", a["rotary_base"], a["dropout"])


HIDDEN = Arg("hidden", "int", check=_positive)
HEADS = Arg("heads", "int", check=_positive)
BACKEND_ARG = Arg("backend", "str", BACKEND, check=_backend, in_kernel=False, objects=BACKEND_OBJECTS)
MASK = Arg("attn_mask_type", "str", "causal", keyword_only=True, check=_mask)
ROTARY = Arg("rotary_base", "float", None, keyword_only=True, check=_rotary_base)
DROPOUT = Arg("dropout", "float", 0.0, keyword_only=True, check=_dropout)
# how the module's x is read (TE's qkv_format): None is fusegen's own call forms (a 3-D x batch first, a 2-D x
# one sequence or packed ones with seq_lens); "sbhd" a 3-D x [seq, batch, hidden] only, "bshd" [batch, seq,
# hidden] only, "thd" packed tokens [total, hidden] only. Not in the kernels: the module's forward reads it.
FORMAT = Arg("qkv_format", "str", None, keyword_only=True, in_kernel=False, check=_format)
HELPERS = (attention_dropout_scale, attention_positions, attention_rotary_angles, attention_rotary, attention_split, attention_bounds,
           attention_blocks, attention_core, attention_core_bwd, attention_inputs, attention_inputs_bwd,
           attention_on_flash, flash_attention_forward, flash_attention_backward, sequences_of, batch_major,
           sequence_major,
           # TE's per-call rotary table (ops/attention_rotary_table.py): its check and the prep kernels' CPU math
           rotary_table_of, rotary_table_argument, attention_rotary_table_angles, attention_rotary_partial,
           attention_inputs_table, attention_inputs_table_bwd)


def _split_heads(a, kv_heads, ranks) -> dict | str:
    """The op on a rank of ``ranks`` (after a column-parallel Linear): heads / ranks query heads and
    kv_heads / ranks key/value heads (each rank's own q heads' kv heads: Megatron's and TE's split)."""
    kv = kv_heads(a)
    if a["heads"] % ranks or kv % ranks:
        return (f"its {a['heads']} query heads and {kv} key/value heads must each split over the {ranks} ranks (each "
                "runs its share of them); give heads and kv_heads that are multiples of the group size"
                + (" (GroupedQueryAttention: MultiQuerySelfAttention has one kv head)" if kv == 1 else ""))
    local = {**a, "hidden": a["hidden"] // ranks, "heads": a["heads"] // ranks}
    return {**local, "kv_heads": kv // ranks} if "kv_heads" in a else local


def _qkv_sections(a, kv_heads, features) -> tuple[int, ...]:
    """The fused projection's q, k and v rows, each split over the ranks (``features``: all of them)."""
    heads, kv = a["heads"], kv_heads(a)
    return tuple(features * n // (heads + 2 * kv) for n in (heads, kv, kv))


def _attention(name, args, kv_heads, summary, helpers):
    register(OpDef(
        name, "attention", args=args,
        split_features=lambda a, ranks: _split_heads(a, kv_heads, ranks),
        feature_sections=lambda a, features: _qkv_sections(a, kv_heads, features),
        fixed_in=lambda a: (a["heads"] + 2 * kv_heads(a)) * _head_dim(a),
        out_features=lambda a, n: a["hidden"],
            validate=lambda a: _validate(_full(a, kv_heads)),
        tag=lambda a: _tag(_full(a, kv_heads)),
        reference=(self_attention, self_attention_bwd), reference_helpers=helpers,
        reference_args=lambda a: _sequence_args(_full(a, kv_heads)),
        reads_sequences=True, needs_input_in_backward=True, summary=summary,
        uses_training=lambda a: a["dropout"] > 0,
    ))


def _full(a, kv_heads) -> dict:
    """The arguments with kv_heads filled in (MultiHeadedSelfAttention: heads; MultiQuery: 1)."""
    return {**a, "kv_heads": kv_heads(a)}


def _tag(a) -> str:
    rotary = f"_rope{a['rotary_base']:g}".replace(".", "p").replace("+", "") if a["rotary_base"] is not None else ""
    mask = "" if a["attn_mask_type"] == "causal" else "_nomask"
    dropout = f"_drop{float_tag(a['dropout'])}" if a["dropout"] > 0 else ""
    return f"attn_h{a['heads']}_kv{a['kv_heads']}_d{_head_dim(a)}{mask}{rotary}{dropout}"


_attention("MultiHeadedSelfAttention", (HIDDEN, HEADS, BACKEND_ARG, MASK, ROTARY, DROPOUT, FORMAT), lambda a: a["heads"],
           "softmax(q k^T / sqrt(d)) v per sequence, a k and v head for each q head", HELPERS)
_attention("GroupedQueryAttention", (HIDDEN, HEADS, Arg("kv_heads", "int", check=_positive), BACKEND_ARG, MASK, ROTARY, DROPOUT, FORMAT),
           lambda a: a["kv_heads"], "softmax(q k^T / sqrt(d)) v per sequence, kv_heads k and v heads shared by groups",
           HELPERS)
_attention("MultiQuerySelfAttention", (HIDDEN, HEADS, BACKEND_ARG, MASK, ROTARY, DROPOUT, FORMAT), lambda a: 1,
           "softmax(q k^T / sqrt(d)) v per sequence, one k and v head shared by all", HELPERS)
