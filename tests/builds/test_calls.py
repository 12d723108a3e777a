"""Typed calls (generator/calls.py): stages lower to calls over value ids, emit renders them, and
what a backward saves follows from its calls' reads (emit.saved_for_backward)."""

import dataclasses

import pytest

from fusegen import emit, fusion_rules
from fusegen.calls import Alias, Expr, Launch, ModuleCall, TorchCall, literal
from fusegen.frontend import parse_spec
from fusegen.pipeline import build_pipeline
from fusegen.plan import plan_pipeline
from fusegen.stages import Emitter, stage_kernels

NAMES = {0: "x", 1: "linear0_out", 2: "linear0_weight", 3: "layernorm1_rstd"}.__getitem__


def test_a_launch_reads_and_writes_values_and_renders_grads_and_constants_as_text():
    call = Launch("norm_bwd", ["d_y", 1, 3, Expr("{p}.view(-1)", p=2), "keep_sum=True"], ["d_x", 0])
    assert call.render(NAMES) == ("d_x, x = kernels.norm_bwd(d_y, linear0_out, layernorm1_rstd, "
                                  "linear0_weight.view(-1), keep_sum=True)")
    assert list(call.reads.values()) == [1, 3, 2] and list(call.writes.values()) == [0]


def test_literal_text_keeps_its_braces():
    call = TorchCall("{y} = f(" + literal("{'a': 1}") + ", {x})", dict(x=0), dict(y=1))
    assert call.render(NAMES) == "linear0_out = f({'a': 1}, x)"
    assert Alias(1, 0, why="{why}").render(NAMES) == "linear0_out = x  # {why}"
    assert Alias("d_a", "d_b", clone=True).render(NAMES) == "d_a = d_b.clone()"
    module = ModuleCall('"M", "Mixer({1: 2})"', module=2, x=0, lead=3, out=1)
    assert module.render(NAMES) == 'linear0_out = ref.run_module("M", "Mixer({1: 2})", linear0_weight, x, layernorm1_rstd)'
    assert set(module.reads.values()) == {0, 2, 3}


def plan_and_emitter(body):
    spec = parse_spec("from transformer_engine.pytorch.ops import *\n" + body, "spec.py")[0]
    plan = plan_pipeline(build_pipeline(spec), fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    return plan, Emitter(plan, stage_kernels(plan))


def test_what_the_backward_saves_follows_from_what_its_calls_read():
    plan, em = plan_and_emitter("m = Sequential(LayerNorm(64), Linear(64, 128), Dropout(0.1), Linear(128, 64))\n")
    emit.forward_blocks(em)
    bwd, _ = emit.backward_blocks(em)
    saved = [em.name(v) for v in emit.saved_for_backward(plan, em, bwd)]
    # running values (the norm's input, each GEMM's input), the norm's statistics and the dropout's
    # key in the order the backward stages read them, then the parameters the backward reads: a
    # bias's grad is a column sum of dy, so no bias is kept
    assert saved == ["x", "layernorm0_out", "dropout2_out",
                     "layernorm0_mean", "layernorm0_rstd", "dropout2_seed",
                     "layernorm0_weight", "linear1_weight", "linear3_weight"]
    assert "layernorm0_bias" not in saved and "linear1_bias" not in saved


def test_a_plan_that_saves_other_values_than_the_backward_reads_is_an_internal_error():
    plan, em = plan_and_emitter("m = Sequential(Linear(64, 64), GELU())\n")
    emit.forward_blocks(em)
    bwd, _ = emit.backward_blocks(em)
    wrong = dataclasses.replace(plan, saved_values=(0,))  # the GELU's input is read, not saved
    with pytest.raises(AssertionError, match="the backward reads"):
        emit.saved_for_backward(wrong, em, bwd)
