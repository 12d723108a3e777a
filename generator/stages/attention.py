"""Attention stages: a self-attention op (ops/attention.py) over packed sequences.

Forward: ``ref.attention_forward`` on the fused projection, the packed sequences' offsets
(``op.cu_seqlens``, int32 [batch + 1] on x's device) and their longest length (``op.max_seqlen``,
a host int): on CUDA bf16/fp16 PyTorch's FlashAttention-2 varlen kernels
(``torch.ops.aten._flash_attention_forward``, GQA native), the split of q, k and v and the rotary
embedding done by torch ops around them (a generated prep kernel, from the QKV GEMM's output to the
attention's inputs, is a later step); on CPU and fp32 the op's reference math, per sequence. It
returns what the backward reads, values this lowering makes: q, k and v after rotary, the
softmax's log-sum-exp and FA2's rng state and fourth output (None off FA2); the forward saves them
because the backward's call reads them. Backward: ``ref.attention_backward``
(``_flash_attention_backward``, then the rotary's transpose), from those and the output.
"""

from __future__ import annotations

from ..calls import TorchCall, literal
from ..values import Role
from .base import Saves, StageImpl

# what attention_forward returns after y, in order: (name suffix, role, dtype)
SAVED = (("q", Role.ACTIVATION, "x"), ("k", Role.ACTIVATION, "x"), ("v", Role.ACTIVATION, "x"),
         ("lse", Role.STATISTIC, "float32"), ("rng_state", Role.METADATA, "int64"),
         ("fa2_unused", Role.METADATA, "int64"))


def _constants(op) -> str:
    """The op's trailing arguments of attention_forward: heads, kv_heads, causal, rotary_base."""
    return ", ".join(literal(repr(c)) for c in op.opdef.reference_arguments(op.args))


class AttentionStage(StageImpl):
    name = "attention"
    # replayed from CUDA graphs on FlashAttention-2 only (the offsets in the graph's buffers, a
    # copied per-call input; max_seqlen bounded by the rows, part of the graph's key): the
    # reference math (fp32) splits the batch on the host (cu_seqlens.tolist()), which a graph
    # cannot capture, so those calls run as usual
    replayable = True
    replay_dtypes = ("float16", "bfloat16")

    def check(self, pass_, chain):
        return None if list(chain) == ["attention"] else "an attention stage runs one attention op"

    def saves(self, pipeline, stage, have):
        return Saves(values=frozenset({stage.output}))  # FA2's backward reads the output

    def saved_shapes(self, em, stage):
        op = stage.ops[0]
        heads, kv_heads = op.opdef.reference_arguments(op.args)[:2]
        head_dim = op.args["hidden"] // heads
        q, k, v, lse, rng_state, unused = (em.table[value].name for value in em.stats[op.index])
        off_fa2 = "None off FA2"
        return {q: (f"[rows, {heads}, {head_dim}]", "x's dtype"), k: (f"[rows, {kv_heads}, {head_dim}]", "x's dtype"),
                v: (f"[rows, {kv_heads}, {head_dim}]", "x's dtype"),
                lse: (f"[{heads}, rows] (FA2; [rows, {heads}] off it)", "float32 (FA2)"),
                rng_state: (f"FA2's rng state; {off_fa2}", "FA2's"),
                unused: (f"FA2's fourth output; {off_fa2}", "FA2's"),
                em.name(op.cu_seqlens): ("[batch + 1]", "int32"),
                em.name(op.max_seqlen): ("a host int, on the autograd ctx", "int")}

    def runs_as(self, pass_, stage, kernels):
        fa2 = "_flash_attention_forward" if pass_ == "forward" else "_flash_attention_backward"
        return (f"PyTorch: FlashAttention-2 varlen (`aten.{fa2}`) on CUDA bf16/fp16, split and rotary by torch "
                f"ops; the reference math (`ref.attention_{pass_}`) on CPU and fp32")

    def forward(self, em, stage, block):
        op = stage.ops[0]
        reads = dict(x=stage.input, cu=op.cu_seqlens, max=op.max_seqlen)
        call = f"ref.attention_forward({{x}}, {{cu}}, {{max}}, {_constants(op)})"
        if not em.saving:  # the no-grad forward keeps nothing for a backward
            block.add(TorchCall(f"{{y}} = {call}[0]", reads, dict(y=stage.output)))
            return em.table[stage.output].name
        saved = [em.table.add(role, dtype, f"{op.hint}_{name}") for name, role, dtype in SAVED]
        em.stats[op.index] = saved
        writes = dict(y=stage.output, **{f"s{k}": value for k, value in enumerate(saved)})
        block.add(TorchCall(", ".join("{" + slot + "}" for slot in writes) + f" = {call}", reads, writes))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        saved = em.stats[op.index]
        reads = dict(dy=dy, y=stage.output, **{f"s{k}": value for k, value in enumerate(saved)},
                     cu=op.cu_seqlens, max=op.max_seqlen)
        causal, rotary = op.opdef.reference_arguments(op.args)[2:]
        slots = ", ".join("{" + f"s{k}" + "}" for k in range(len(saved)))
        block.add(TorchCall(f"{{dx}} = ref.attention_backward({{dy}}, {{y}}, {slots}, {{cu}}, {{max}}, "
                            f"{causal!r}, {literal(repr(rotary))})", reads, dict(dx=d_in)))
        return d_in


ATTENTION = AttentionStage()
