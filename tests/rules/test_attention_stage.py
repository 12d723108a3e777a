"""The attention rule and stage (fusion_rules/attention.py, stages/attention.py): an attention op
planned as its own stage both ways by the shipped rule lists, and lowered into the calls of
ops/attention.py's shipped helpers over the packed sequences' values (the METADATA values
``op.cu_seqlens`` and ``op.max_seqlen``, a host int, that pipeline.chain gives an op with
``OpDef.reads_sequences``: the pipeline's one pair, ``Pipeline.sequences``)."""

from __future__ import annotations

import pytest

from fusegen import fusion_rules
from fusegen.build import plan_specs
from fusegen.calls import TorchCall
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


def test_lowering_reads_the_sequences_and_saves_what_the_backward_reads():
    plan = plan_layer()
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    (op,) = stage.ops
    em = Emitter(plan, {})
    fwd = Block("forward", name=em.name)
    assert ATTENTION.forward(em, stage, fwd) == em.table[stage.output].name
    (call,) = fwd.calls
    assert isinstance(call, TorchCall)
    saved = em.stats[op.index]
    assert [em.table[v].name for v in saved] == [f"{op.hint}_{s}" for s in ("q", "k", "v", "lse", "rng_state",
                                                                             "fa2_unused")]
    assert set(call.reads.values()) == {stage.input, op.cu_seqlens, op.max_seqlen}
    assert set(call.writes.values()) == {stage.output, *saved}
    line = fwd.lines[0]
    assert line.endswith(f"= ref.attention_forward({em.name(stage.input)}, cu_seqlens, max_seqlen, 4, 2, False, "
                         "10000.0)")

    dy, d_in = em.grad(stage.output), em.grad(stage.input)
    bwd = Block("backward", name=em.name)
    assert ATTENTION.backward(em, stage, bwd, dy, d_in) == d_in
    (back,) = bwd.calls
    assert set(back.reads.values()) == {dy, stage.output, *saved, op.cu_seqlens, op.max_seqlen}
    assert set(back.writes.values()) == {d_in}
    assert "ref.attention_backward(" in bwd.lines[0] and bwd.lines[0].endswith("cu_seqlens, max_seqlen, False, 10000.0)")


def test_no_grad_lowering_keeps_nothing():
    plan = plan_layer()
    (stage,) = [s for s in plan.forward if s.rule.stage is ATTENTION]
    em = Emitter(plan, {}, saving=False)
    block = Block("no grad", name=em.name)
    ATTENTION.forward(em, stage, block)
    (call,) = block.calls
    assert set(call.writes.values()) == {stage.output} and block.lines[0].endswith("10000.0)[0]")
    assert stage.ops[0].index not in em.stats


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_runs_as_names_fa2_and_the_reference_path(pass_):
    plan = plan_layer()
    (stage,) = [s for s in (plan.forward if pass_ == "forward" else plan.backward) if s.rule.stage is ATTENTION]
    text = ATTENTION.runs_as(pass_, stage, [])
    assert f"_flash_attention_{pass_}" in text and f"ref.attention_{pass_}" in text
