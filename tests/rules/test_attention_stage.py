"""The attention rule and stage (fusion_rules/attention.py, stages/attention/): an attention op
planned as its own stage both ways by the shipped rule lists, and lowered into the prep kernels'
launches around the calls of ops/attention.py's shipped FA2 helpers over the packed sequences' values (the METADATA values
``op.cu_seqlens`` and ``op.max_seqlen``, a host int, that pipeline.chain gives an op with
``OpDef.reads_sequences``: the pipeline's one pair, ``Pipeline.sequences``)."""

from __future__ import annotations

import pytest

from fusegen import fusion_rules
from fusegen.build import plan_specs
from fusegen.calls import Launch, TorchCall
from fusegen.frontend import parse_spec
from fusegen.names import NameTable
from fusegen.stages import ATTENTION, Block, Emitter
from fusegen.fusion_rules.attention import BACKWARD_ATTENTION, FORWARD_ATTENTION
from fusegen.values import HOST_INT, Role

SPEC = """\
from transformer_engine.pytorch import ops as te
layer = te.Sequential(te.RMSNorm(64), te.Linear(64, 128, bias=False),
                      te.GroupedQueryAttention(64, 4, 2, rotary_base=10000.0, attn_mask_type="no_mask"),
                      te.Linear(64, 64, bias=False))
"""


def plan_layer():
    (plan,) = plan_specs(parse_spec(SPEC, "layer.py"), NameTable(), fusion_rules.FORWARD_RULES,
                         fusion_rules.BACKWARD_RULES)
    return plan


def test_the_rules_are_in_the_shipped_lists():
    assert FORWARD_ATTENTION in fusion_rules.FORWARD_RULES and BACKWARD_ATTENTION in fusion_rules.BACKWARD_RULES


def test_the_op_reads_the_pipelines_packed_sequences():
    plan = plan_layer()
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    (op,) = stage.ops
    assert (op.cu_seqlens, op.max_seqlen) == plan.pipeline.sequences
    table = {value.id: value for value in plan.pipeline.values}
    assert (table[op.cu_seqlens].role, table[op.cu_seqlens].dtype) == (Role.METADATA, "int32")
    assert (table[op.max_seqlen].role, table[op.max_seqlen].dtype) == (Role.METADATA, HOST_INT)


def test_attention_is_planned_as_its_own_stage_both_ways():
    plan = plan_layer()
    forward = [s for s in plan.forward if s.rule.stage is ATTENTION]
    backward = [s for s in plan.backward if s.rule.stage is ATTENTION]
    assert [s.rule.name for s in forward] == ["attention"]
    assert [s.rule.name for s in backward] == ["attention_backward"]
    assert [op.opdef.name for op in forward[0].ops] == ["GroupedQueryAttention"]
    # the backward reads the forward's output (FA2's backward takes it): the plan saves it
    assert forward[0].output in plan.saved_values


def test_ops_other_than_one_attention_are_refused():
    assert ATTENTION.check("forward", ["attention"]) is None
    assert "one attention op" in ATTENTION.check("forward", ["attention", "gelu"])


def test_lowering_launches_the_prep_kernels_around_fa2_and_saves_what_the_backward_reads():
    plan = plan_layer()
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    (op,) = stage.ops
    em = Emitter(plan, {})
    fwd = Block("forward", name=em.name)
    assert ATTENTION.forward(em, stage, fwd) == em.table[stage.output].name
    prep, split, flash = fwd.calls
    # the prep kernel: the projection and the offsets to one buffer, which q, k and v are views of
    assert isinstance(prep, Launch) and prep.kernel == "qkv_prep_rope10000_fwd_h4_kv2_d16"
    assert list(prep.reads.values()) == [stage.input, op.cu_seqlens]
    (buffer,) = prep.writes.values()
    assert isinstance(split, TorchCall) and list(split.reads.values()) == [buffer]
    saved = em.stats[op.index]
    # saved for the backward: the one buffer (not its three views) and FA2's statistics
    assert saved[0] == buffer
    assert [em.table[v].name for v in saved] == [f"{op.hint}_{s}" for s in ("qkv", "lse")]
    q_k_v = list(split.writes.values())
    assert fwd.lines[1].endswith(f"= {em.name(buffer)}.split([4, 2, 2], dim=1)")
    assert set(flash.reads.values()) == {*q_k_v, op.cu_seqlens, op.max_seqlen}
    assert set(flash.writes.values()) == {stage.output, *saved[1:]}
    assert fwd.lines[2].endswith("cu_seqlens, max_seqlen, False)") and "ref.flash_attention_forward(" in fwd.lines[2]

    dy, d_in = em.grad(stage.output), em.grad(stage.input)
    bwd = Block("backward", name=em.name)
    assert ATTENTION.backward(em, stage, bwd, dy, d_in) == d_in
    resplit, back, prep_back = bwd.calls
    # the backward makes q, k, v views of the saved buffer again
    assert list(resplit.reads.values()) == [buffer] and bwd.lines[0].endswith(".split([4, 2, 2], dim=1)")
    views = list(resplit.writes.values())
    assert set(back.reads.values()) == {dy, stage.output, *views, *saved[1:], op.cu_seqlens, op.max_seqlen}
    grads = [em.grad(v) for v in views]  # dq, dk, dv
    assert list(back.writes.values()) == grads
    assert "ref.flash_attention_backward(" in bwd.lines[1] and bwd.lines[1].endswith("cu_seqlens, max_seqlen, False)")
    assert isinstance(prep_back, Launch) and prep_back.kernel == "qkv_prep_rope10000_bwd_h4_kv2_d16"
    assert list(prep_back.reads.values()) == [*grads, op.cu_seqlens] and list(prep_back.writes.values()) == [d_in]


def test_without_rotary_q_k_v_are_views_of_the_projection_and_the_backward_still_launches_one_kernel():
    (plan,) = plan_specs(parse_spec(SPEC.replace("rotary_base=10000.0, ", ""), "layer.py"), NameTable(),
                         fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    (back_stage,) = [s for s in plan.backward if s.rule.stage is ATTENTION]
    assert ATTENTION.kernels(plan, stage, "forward") == []
    assert [k.name for k in ATTENTION.kernels(plan, back_stage, "backward")] == ["qkv_prep_bwd_h4_kv2_d16"]
    em = Emitter(plan, {})
    fwd = Block("forward", name=em.name)
    ATTENTION.forward(em, stage, fwd)
    split, flash = fwd.calls
    assert list(split.reads.values()) == [stage.input]
    assert fwd.lines[0].endswith(f"= {em.name(stage.input)}.unflatten(1, (8, 16)).split([4, 2, 2], dim=1)")
    # the backward reads the projection itself (q, k, v its views again): the plan saves it
    assert em.stats[stage.ops[0].index][0] == stage.input and stage.input in plan.saved_values


def test_the_prep_kernels_are_the_stages_kernels():
    plan = plan_layer()
    (fwd,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    (bwd,) = [s for s in plan.backward if s.rule.stage is ATTENTION]
    (spec,) = ATTENTION.kernels(plan, fwd, "forward")
    (back,) = ATTENTION.kernels(plan, bwd, "backward")
    assert spec.family == back.family == "attention_prep"
    assert (spec.ctx["heads"], spec.ctx["kv_heads"], spec.ctx["head_dim"], spec.ctx["inverse"]) == (4, 2, 16, False)
    assert back.ctx["inverse"] and back.ctx["rotary"]


def test_the_rotary_frequencies_are_fp32_of_the_float64_powers():
    """The kernel's table: base^(-2i/d) in float64, each rounded once to fp32, written exactly."""
    import struct

    from fusegen.stages.attention.kernels import rotary_inv_freq
    plan = plan_layer()
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    (spec,) = ATTENTION.kernels(plan, stage, "forward")
    want = [struct.unpack("f", struct.pack("f", 10000.0 ** (-(2 * i) / 16)))[0] for i in range(8)]
    assert rotary_inv_freq(10000.0, 16) == want and want[0] == 1.0 and want[1] != 10000.0 ** (-2 / 16)
    assert [float.fromhex(text[:-1]) for text in spec.ctx["inv_freq"]] == want


def test_no_grad_lowering_keeps_nothing():
    plan = plan_layer()
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    em = Emitter(plan, {}, saving=False)
    block = Block("no grad", name=em.name)
    ATTENTION.forward(em, stage, block)
    prep, split, flash = block.calls
    assert set(flash.writes.values()) == {stage.output} and block.lines[2].endswith("False)[0]")
    assert stage.ops[0].index not in em.stats


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_runs_as_names_the_prep_kernel_fa2_and_the_reference_path(pass_):
    plan = plan_layer()
    (stage,) = [s for s in (plan.forward if pass_ == "forward" else plan.backward) if s.rule.stage is ATTENTION]
    kernels = ATTENTION.kernels(plan, stage, pass_)
    text = ATTENTION.runs_as(pass_, stage, kernels)
    assert f"_flash_attention_{pass_}" in text and f"ref.flash_attention_{pass_}" in text
    assert f"`qkv_prep_rope10000_{'fwd' if pass_ == 'forward' else 'bwd'}_h4_kv2_d16`" in text
