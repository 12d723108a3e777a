"""Attention stages: a self-attention op (ops/attention.py) over packed sequences.

Forward: the prep kernel (kernels.py; none without rotary) from the fused projection and the
packed sequences' offsets (``op.cu_seqlens``, int32 [batch + 1] on x's device) to one buffer
[rows, heads + 2 kv_heads, d] holding rotary(q), rotary(k) and v; q, k and v are views of it (of
the projection itself without rotary), which FlashAttention-2 varlen takes as they are (any row
and head stride, a dense last dim). Then ``ref.flash_attention_forward`` on them with the longest
length (``op.max_seqlen``, a host int): PyTorch's FA2 varlen kernels on CUDA bf16/fp16
(``torch.ops.aten._flash_attention_forward``, GQA native), the op's reference math per sequence
otherwise. The forward saves what the backward reads: the one buffer (the backward splits it into
q, k, v again), the output and the softmax's log-sum-exp (float32 [heads, rows], FA2's layout on
every path). With dropout (the op's ``dropout`` > 0) the forward passes ``p if training else
0.0`` (the module's training flag, per call) and also saves the rng state it returns (None in
eval), which the backward passes back with p. Backward: ``ref.flash_attention_backward`` to dq,
dk, dv, then the backward prep kernel to the projection's grad (the rotary's transpose of dq and
dk, dv copied). On CPU every launcher runs its reference math.

An op that reads TE's per-call table (``Op.rotary_table``: te.MultiheadAttention's forward(
rotary_pos_emb=...), float32 [max_s, d], [0, d] for None) branches on it at run time, one line each
pass: with rows, the prep kernels' table variant (forward and backward); without, exactly the
no-rotary path (views of the projection, the backward's copy). A replayed CUDA graph keys on the
table's shape, so each graph holds one branch.
"""

from __future__ import annotations

from ...calls import Launch, TorchCall, literal
from ...tensor_parallel import sequence_major
from ...values import Role
from ..base import Saves, StageImpl
from .kernels import attention_shape, prep_backward, prep_forward, prep_table

# what flash_attention_forward returns after y, in order: (name suffix, role, dtype); the rng
# state (FA2's philox seed and offset, or the reference path's key; None in eval mode) only where
# the op has dropout
FLASH_SAVED = (("lse", Role.STATISTIC, "float32"),)
DROPOUT_SAVED = (("rng", Role.METADATA, "int64"),)


def _flash_saved(op) -> tuple:
    return FLASH_SAVED + (DROPOUT_SAVED if op.args["dropout"] > 0 else ())


class AttentionStage(StageImpl):
    name = "attention"
    # replayed from CUDA graphs on FlashAttention-2 only (the offsets in the graph's buffers, a
    # copied per-call input; max_seqlen bounded by the rows, part of the graph's key; the prep
    # kernels read the offsets on the device): the reference math (fp32) splits the batch on the
    # host (cu_seqlens.tolist()), which a graph cannot capture, so those calls run as usual
    replayable = True
    replay_dtypes = ("float16", "bfloat16")

    def check(self, pass_, chain):
        return None if list(chain) == ["attention"] else "an attention stage runs one attention op"

    def saves(self, pipeline, stage, have):
        # FA2's backward reads the output, and q, k, v: views of the prep kernel's buffer (a value
        # the forward makes, saved by the calls that read it), or without rotary of the input;
        # rows in x's [seq, batch] order (sequence_major): the batch-major ones it made, all made values
        if sequence_major(pipeline):
            return Saves(values=frozenset())
        without_prep = prep_forward(stage.ops[0]) is None and stage.ops[0].rotary_table is None
        return Saves(values=frozenset({stage.output, *([stage.input] if without_prep else [])}))

    def kernels(self, plan, stage, pass_):
        op = stage.ops[0]
        specs = [prep_forward(op)] if pass_ == "forward" else [prep_backward(op)]
        return [spec for spec in (*specs, prep_table(op, pass_ != "forward")) if spec is not None]

    def saved_shapes(self, em, stage):
        op = stage.ops[0]
        heads, kv_heads, head_dim, rotary = attention_shape(op)
        qkv, lse, *rng = (em.table[value].name for value in em.stats[op.index])
        out = {}
        if sequence_major(em.pipeline):  # (the last: the output and the input in batch-major rows)
            *rng, y, _ = rng
            out = {y: (f"[rows, {heads * head_dim}], the output in batch-major rows (x's are [seq, batch])", "x's dtype")}
        what = ("the prep kernel's buffer: rotary(q), rotary(k), v" if rotary is not None else
                "the prep kernel's buffer where TE's table has rows, else a view of the projection"
                if op.rotary_table is not None else "the projection")
        return {qkv: (f"[rows, {heads} + 2 x {kv_heads}, {head_dim}], {what}; q, k, v its views", "x's dtype"),
                lse: (f"[{heads}, rows], FA2's layout on every path", "float32"),
                **{name: ("[2], the dropout's rng state (FA2's philox seed and offset; the reference's key), None in "
                          "eval mode", "int64") for name in rng},
                em.name(op.cu_seqlens): ("[batch + 1]", "int32"),
                **({em.name(op.rotary_table): ("[max_s, d], TE's rotary table ([0, d]: none)", "float32")}
                   if op.rotary_table is not None else {}),
                em.name(op.max_seqlen): ("a host int, on the autograd ctx", "int"), **out}

    def runs_as(self, pass_, stage, kernels):
        names = [f"`{k.name}`" for k in kernels]
        table = stage.ops[0].rotary_table is not None  # a run-time branch on TE's table (its variant listed last)
        if pass_ == "forward":
            first = (f"{names[-1]} (split, rotary by TE's table) where the table has rows, else q, k, v views of x -> "
                     if table else f"{' + '.join(names)} (split, rotary) -> " if names else "q, k, v views of x -> ")
            return (f"{first}FlashAttention-2 varlen (`aten._flash_attention_forward`) on CUDA bf16/fp16, else the "
                    "reference math (`ref.flash_attention_forward`)")
        last = (f"{names[-1]} (the table rotary's transpose, dqkv) where TE's table has rows, else {names[0]} (a copy)"
                if table else f"{' + '.join(names)} (rotary's transpose, dqkv)")
        return (f"FlashAttention-2 varlen backward (`aten._flash_attention_backward`) on CUDA bf16/fp16, else the "
                f"reference math (`ref.flash_attention_backward`) -> {last}")

    def forward(self, em, stage, block):
        op = stage.ops[0]
        qkv = [em.table.add(Role.ACTIVATION, "x", f"{op.hint}_{name}") for name in ("q", "k", "v")]
        spec, table = prep_forward(op), prep_table(op, inverse=False)
        x, y = stage.input, stage.output
        if sequence_major(em.pipeline):  # rows in x's [seq, batch] order: each sequence's rows together here
            x = em.table.add(Role.ACTIVATION, "x", f"{op.hint}_in_by_sequence")
            y = em.table.add(Role.ACTIVATION, "x", f"{op.hint}_out_by_sequence")
            block.add(TorchCall("{b} = ref.batch_major({x}, {cu})", dict(x=stage.input, cu=op.cu_seqlens), dict(b=x)))
        if spec is not None:  # one buffer [rows, heads + 2 kv_heads, d]: q, k, v are views of it
            heads_in = em.table.add(Role.ACTIVATION, "x", f"{op.hint}_qkv")
            block.add(Launch(spec.name, [x, op.cu_seqlens], [heads_in]))
        elif table is not None:  # TE's table: its prep kernel's buffer where it has rows, else views of x
            heads_in = em.table.add(Role.ACTIVATION, "x", f"{op.hint}_qkv")
            heads, kv_heads, head_dim, _ = attention_shape(op)
            block.add(TorchCall(f"{{b}} = kernels.{table.name}({{x}}, {{cu}}, {{t}}) if {{t}}.shape[0] else "
                                f"{{x}}.unflatten(1, ({heads + 2 * kv_heads}, {head_dim}))",
                                dict(x=x, cu=op.cu_seqlens, t=op.rotary_table), dict(b=heads_in)))
        else:  # no rotary: views of the projection itself
            heads_in = x
        block.add(_split(op, heads_in, qkv))
        causal = literal(repr(op.opdef.reference_arguments(op.args)[2]))
        reads = dict(q=qkv[0], k=qkv[1], v=qkv[2], cu=op.cu_seqlens, max=op.max_seqlen)
        dropout = op.args["dropout"]
        if dropout > 0:  # TE's `attention_dropout if self.training else 0.0`, per call
            reads["training"] = em.pipeline.training
            call = (f"ref.flash_attention_forward({{q}}, {{k}}, {{v}}, {{cu}}, {{max}}, {causal}, "
                    f"{dropout!r} if {{training}} else 0.0)")
        else:
            call = f"ref.flash_attention_forward({{q}}, {{k}}, {{v}}, {{cu}}, {{max}}, {causal})"
        if not em.saving:  # the no-grad forward keeps nothing for a backward
            block.add(TorchCall(f"{{y}} = {call}[0]", reads, dict(y=y)))
        else:
            flash = [em.table.add(role, dtype, f"{op.hint}_{name}") for name, role, dtype in _flash_saved(op)]
            # the backward reads the one tensor q, k and v are views of (its own views again): one
            # saved tensor, not three views (a custom op under torch.compile returns tensors of its
            # own, so three views would be three copies there); with rows in [seq, batch] order, the
            # output in batch-major rows too
            em.stats[op.index] = [heads_in, *flash, *([y, x] if y != stage.output else [])]  # (x: its grad's name)
            writes = dict(y=y, **{f"s{k}": value for k, value in enumerate(flash)})
            block.add(TorchCall(", ".join("{" + slot + "}" for slot in writes) + f" = {call}", reads, writes))
        if y != stage.output:  # back in x's [seq, batch] order
            block.add(TorchCall("{o} = ref.sequence_major({y}, {cu})", dict(y=y, cu=op.cu_seqlens), dict(o=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        heads_in, *flash = em.stats[op.index]
        y, d_out = stage.output, d_in
        if sequence_major(em.pipeline):  # rows in x's [seq, batch] order: the grads batch-major here, then back
            *flash, y, x = flash
            batch_dy = em.grad(y)
            block.add(TorchCall("{b} = ref.batch_major({dy}, {cu})", dict(dy=dy, cu=op.cu_seqlens), dict(b=batch_dy)))
            dy, d_in = batch_dy, em.grad(x)
        qkv = [em.table.add(Role.ACTIVATION, "x", f"{op.hint}_{name}") for name in ("q", "k", "v")]
        block.add(_split(op, heads_in, qkv))
        grads = [em.grad(value) for value in qkv]  # dq, dk, dv
        saved = [*qkv, *flash]
        reads = dict(dy=dy, y=y, **{f"s{k}": value for k, value in enumerate(saved)},
                     cu=op.cu_seqlens, max=op.max_seqlen)
        causal = op.opdef.reference_arguments(op.args)[2]
        slots = ", ".join("{" + f"s{k}" + "}" for k in range(4))  # q, k, v, lse
        dropout = f", {{s4}}, {op.args['dropout']!r}" if len(saved) > 4 else ""  # the rng state, p
        block.add(TorchCall(f"{{dq}}, {{dk}}, {{dv}} = ref.flash_attention_backward({{dy}}, {{y}}, {slots}, {{cu}}, "
                            f"{{max}}, {causal!r}{dropout})", reads, dict(dq=grads[0], dk=grads[1], dv=grads[2])))
        table = prep_table(op, inverse=True)
        if table is None:
            block.add(Launch(prep_backward(op).name, [*grads, op.cu_seqlens], [d_in]))
        else:
            reads = dict(dq=grads[0], dk=grads[1], dv=grads[2], cu=op.cu_seqlens, t=op.rotary_table)
            block.add(TorchCall(f"{{d}} = kernels.{table.name}({{dq}}, {{dk}}, {{dv}}, {{cu}}, {{t}}) if {{t}}.shape[0] "
                                f"else kernels.{prep_backward(op).name}({{dq}}, {{dk}}, {{dv}}, {{cu}})", reads,
                                dict(d=d_in)))
        if d_in != d_out:  # back in x's [seq, batch] order
            block.add(TorchCall("{d} = ref.sequence_major({b}, {cu})", dict(b=d_in, cu=op.cu_seqlens), dict(d=d_out)))
        return d_out


def _split(op, heads_in, qkv) -> TorchCall:
    """q, k, v: views of ``heads_in`` (the prep kernel's buffer [rows, heads + 2 kv_heads, d], or
    without rotary the projection [rows, (heads + 2 kv_heads) d])."""
    heads, kv_heads, head_dim, rotary = attention_shape(op)
    view = "" if rotary is not None or op.rotary_table is not None else f".unflatten(1, ({heads + 2 * kv_heads}, {head_dim}))"
    split = literal(f"{view}.split([{heads}, {kv_heads}, {kv_heads}], dim=1)")
    return TorchCall("{q}, {k}, {v} = {b}" + split, dict(b=heads_in), dict(q=qkv[0], k=qkv[1], v=qkv[2]))


ATTENTION = AttentionStage()
