"""Typed calls (generator/calls.py): stages lower to calls over value ids, a backward's grads
among them (values of the table: ValueTable.grad), emit renders them, and what a backward saves
follows from its calls' reads (emit.saved_for_backward)."""

import dataclasses
import re
from pathlib import Path

import pytest

from fusegen import emit, fusion_rules
from fusegen.calls import Alias, Expr, Launch, ModuleCall, TorchCall, literal
from fusegen.frontend import parse_spec, parse_spec_file
from fusegen.pipeline import build_pipeline
from fusegen.plan import plan_pipeline
from fusegen.stages import Emitter, stage_kernels
from spec_packages import imported_package
from fusegen.values import Role

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


RESIDUAL_MLP = ("m = Sequential(MakeExtraOutput(), LayerNorm(64), Linear(64, 64), GELU(), Linear(64, 64), "
                "AddExtraInput())\n")


def grad_of(em, grad):
    """The value a grad value is the grad of, by its name, checking it is a grad."""
    value = em.table[grad]
    assert value.grad_of is not None, f"{value.name} is not a grad"
    return em.table[value.grad_of].name


def test_a_backwards_calls_read_and_write_grad_values():
    plan, em = plan_and_emitter(RESIDUAL_MLP)
    emit.forward_blocks(em)
    bwd, grads = emit.backward_blocks(em)
    p = plan.pipeline
    # the last GEMM's backward: dgrad reads the output's grad (handed on by the Bias + add stage,
    # which writes no dx) and writes its input's; its wgrad writes the weight's grad
    (dgrad,) = bwd[1].calls
    assert {slot: grad_of(em, g) for slot, g in dgrad.writes.items()} == {"dx": "gelu3_out"}
    assert grad_of(em, dgrad.reads["dy"]) == "addextrainput5_out" and dgrad.reads["dy"] == grads[p.output]
    assert em.table[dgrad.reads["w"]].grad_of is None  # the weight: a forward value
    ((weight_grad, wgrad),) = bwd[1].weight_grad_calls
    weight = em.table[em.table[weight_grad].grad_of]
    assert weight.name == "linear4_weight" and em.table[weight_grad].role is Role.PARAMETER
    assert em.table[weight_grad].dtype == "param"
    assert wgrad.reads["dy"] == dgrad.reads["dy"] and em.table[wgrad.reads["x"]].name == "gelu3_out"
    # an activation's grad is an activation, in x's dtype, as wide as its value
    dx = em.table[dgrad.writes["dx"]]
    assert dx.role is Role.ACTIVATION and dx.dtype == "x" and dx.features == 64
    # the norm's backward: reads its output's grad and the extra output's, writes x's and its parameters'
    (norm,) = bwd[-1].calls
    assert [grad_of(em, g) for g in norm.reads.values() if em.is_grad(g)] == ["layernorm1_out", "extra_output0"]
    assert [grad_of(em, g) for g in norm.writes.values()] == ["x", "layernorm1_weight", "layernorm1_bias"]
    assert grads[0] == norm.writes["w0"]
    # the add's grad handed to the extra input: an alias between two grad values
    alias = bwd[0].calls[1]
    assert isinstance(alias, Alias) and grad_of(em, alias.writes["w0"]) == "extra_input0"
    assert alias.reads["r0"] == grads[p.output]
    # a value's grad is made once: asking again gives the same id
    assert em.grad(0) == grads[0] and em.grad(p.output) == grads[p.output]


def test_the_grads_keep_their_generated_names():
    plan, em = plan_and_emitter(RESIDUAL_MLP)
    emit.forward_blocks(em)
    bwd, _ = emit.backward_blocks(em)
    assert [line for block in bwd for line in block.lines] == [
        "d_linear4_bias = kernels.bias_add_bwd_n64(d_addextrainput5_out)",
        "d_extra_input0 = d_addextrainput5_out",
        "d_gelu3_out = d_addextrainput5_out.mm(linear4_weight)",
        "d_linear2_pre_bias, d_linear2_bias = kernels.bias_gelu_bwd_n64(d_gelu3_out, linear2_out)",
        "d_layernorm1_out = d_linear2_pre_bias.mm(linear2_weight)",
        "d_x, d_layernorm1_weight, d_layernorm1_bias = kernels.layernorm_bwd_h64_add_dresidual(d_layernorm1_out, "
        "x, layernorm1_mean, layernorm1_rstd, layernorm1_weight, d_extra_output0)"]
    assert [weight_grad for block in bwd for weight_grad in block.weight_grads] == [
        ("d_linear4_weight", "ref.weight_grad(ctx, linear4_weight, d_addextrainput5_out, gelu3_out)"),
        ("d_linear2_weight", "ref.weight_grad(ctx, linear2_weight, d_linear2_pre_bias, layernorm1_out)")]


def test_returned_grads_that_share_memory_get_copies_by_grad_value():
    # AddExtraInput alone hands dy to both its inputs: x's grad and the extra input's are one tensor
    plan, em = plan_and_emitter("m = Sequential(AddExtraInput(), Linear(64, 64))\n")
    emit.forward_blocks(em)
    bwd, grads = emit.backward_blocks(em)
    extra = em.grad(plan.pipeline.extra_input_values[0])
    assert grads[0] == grads[plan.pipeline.ops[0].output] and em.memory_of(extra) == grads[0]
    assert em.table[extra].grad_of == plan.pipeline.extra_input_values[0]
    assert emit.own_memory(em, [grads[0], extra]) is None  # the extra input's alias line itself became the copy
    (alias,) = [call for block in bwd for call in block.calls if isinstance(call, Alias)]
    assert alias.writes == {"w0": extra} and alias.reads == {"r0": grads[0]}
    assert alias.render(em.name) == "d_extra_input0 = d_addextrainput0_out.clone()  # in memory of its own " \
                                    "(.grad accumulates in place)"


SPECS = sorted((Path(__file__).resolve().parents[2] / "specs").glob("*.py"))


@pytest.mark.parametrize("path", SPECS, ids=lambda path: path.stem)
def test_no_backward_call_of_a_shipped_spec_holds_a_grad_as_text(path):
    """What a backward's call does not hold as a value is a constant, ``ctx`` or a keyword: every
    grad is a value it reads or writes, so no ``d_`` name stands in its text (comments aside)."""
    for spec in parse_spec_file(path):
        plan = plan_pipeline(build_pipeline(spec), fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
        em = Emitter(plan, stage_kernels(plan))
        emit.forward_blocks(em)
        bwd, _ = emit.backward_blocks(em)
        calls = [call for block in bwd for call in block.calls + [c for _, c in block.weight_grad_calls]]
        for call in calls:
            code = call.text.split("  # ")[0]
            assert not re.search(r"\bd_\w", re.sub(r"\{\w+\}", "", code)), f"{spec.name}: {call!r}"
        grads = [value for call in calls for value in {**call.reads, **call.writes}.values() if em.is_grad(value)]
        assert grads or not calls, spec.name  # an Identity alone has no backward calls
        for grad in grads:  # named after the value it is the grad of, of its role
            value = em.table[em.table[grad].grad_of]
            assert em.table[grad].role is value.role and em.table[grad].name == f"d_{em.name(value.id)}"


TEE_OF_A_PASSED_ON_VALUE = """\
from transformer_engine.pytorch.ops import BasicLinear, Linear, MakeExtraOutput, ReLU, Sequential, SReGLU

tee_after_relu = Sequential(Linear(16, 32, bias=True), ReLU(), MakeExtraOutput(), BasicLinear(32, 32), SReGLU())
"""


def test_two_values_one_tensor_holds_are_saved_once(tmp_path):
    """MakeExtraOutput hands its input on (no kernel): its output and the ReLU's are one tensor,
    which the backward reads as both. It is saved once (a second time was a duplicate argument of
    backward_stages, a SyntaxError on import), and the module still computes the spec's math."""
    import torch
    import torch.nn.functional as F

    with imported_package(tmp_path, "spec.py", TEE_OF_A_PASSED_ON_VALUE, "saved_once_pkg") as pkg:
        module = pkg.TeeAfterRelu(dtype=torch.float64)
        torch.manual_seed(0)
        for p in module.parameters():
            torch.nn.init.normal_(p)
        x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
        y, tee = module(x)
        (y.sum() * 3 + (tee * tee).sum()).backward()
        w0, b0, w3 = (p.detach().clone().requires_grad_() for p in (module._modules["0"].weight,
                                                                     module._modules["0"].bias,
                                                                     module._modules["3"].weight))
        x64 = x.detach().clone().requires_grad_()
        h = F.relu(F.linear(x64, w0, b0))
        a, b = F.linear(h, w3).chunk(2, dim=-1)
        want_y = F.relu(a) ** 2 * b  # SReGLU: squared ReLU gate
        (want_y.sum() * 3 + (h * h).sum()).backward()
        torch.testing.assert_close(y, want_y)
        torch.testing.assert_close(tee, h)
        torch.testing.assert_close(x.grad, x64.grad)
        torch.testing.assert_close(module._modules["3"].weight.grad, w3.grad)
        torch.testing.assert_close(module._modules["0"].bias.grad, b0.grad)
