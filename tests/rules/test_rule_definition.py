"""A rule is checked against its stage implementation when it is defined: a pattern the stage
cannot run is a RuleError there, never wrong code or a planner crash at some spec."""

import pytest

from fusegen import fusion_rules
from fusegen.plan import BACKWARD, FORWARD, Rule, RuleError
from fusegen.stages import ATTENTION, COLLECTIVE, COLLECTIVE_GEMM, ELEMENTWISE, GEMM, MODULE, NORM, OPAQUE, RESHAPE


FORMS_TEXT = ("linear; linear + bias; linear + scale; linear + bias + scale; linear + bias + relu; "
              "linear + add_extra_input; linear + scale + add_extra_input")


def test_a_gemm_rule_that_would_drop_an_op_fails_at_definition():
    # torch.addmm's epilogue takes one C operand: a bias and a residual together would drop one.
    with pytest.raises(RuleError) as info:
        Rule("linear_bias_add", FORWARD, GEMM, "GEMM + bias + add", pattern=("linear", "bias", "add_extra_input"))
    assert str(info.value) == (
        "fusion rule 'linear_bias_add' cannot be implemented: it may fuse linear + bias + add_extra_input, but a "
        f"forward GEMM stage runs only these op chains: {FORMS_TEXT}")


def test_te_linear_bias_activation_pattern_fails_at_definition_not_in_the_planner():
    with pytest.raises(RuleError, match="cannot be implemented: it may fuse linear \\+ bias \\+ activation"):
        Rule("forward_linear_bias_activation", FORWARD, GEMM, "TE's fused op", pattern=("linear", "bias", "activation"))


def test_a_gelu_epilogue_is_for_the_no_grad_forward_only():
    # with autograd on, the GELU's backward needs the pre-activation the epilogue does not keep
    with pytest.raises(RuleError, match="it may fuse linear \\+ bias \\+ gelu, but a forward GEMM stage runs only"):
        Rule("gelu_epilogue", FORWARD, GEMM, "x", pattern=("linear", "bias", "gelu"))
    rule = Rule("gelu_epilogue", FORWARD, GEMM, "x", pattern=("linear", "bias", "gelu"), inference_only=True)
    assert rule.fuses([]) == 0
    with pytest.raises(RuleError, match="inference_only is for forward rules"):
        Rule("gelu_epilogue", BACKWARD, GEMM, "x", pattern=("linear",), inference_only=True)
    # and a no-grad rule is still checked: a GEMM takes no SiLU
    with pytest.raises(RuleError, match="it may fuse linear \\+ bias \\+ activation, but a no-grad forward GEMM stage"):
        Rule("silu_epilogue", FORWARD, GEMM, "x", pattern=("linear", "bias", "activation"), inference_only=True)


def test_every_chain_of_an_optional_pattern_is_checked():
    # norm alone is fine; a ReLU after the norm is not (its backward reads the norm's output,
    # which a norm kernel with ops after it never writes); nor is a dropout before a backward norm.
    with pytest.raises(RuleError, match="it may fuse norm \\+ relu, but a forward norm stage runs only "
                                        "\\[ops before\\] \\[AddExtraInput\\] \\[MakeExtraOutput\\] norm \\[ops after\\]"):
        Rule("norm_relu", FORWARD, NORM, "x", pattern=("norm", "relu?"))
    with pytest.raises(RuleError, match="it may fuse dropout \\+ norm, but a backward norm stage runs only"):
        Rule("dropout_norm_backward", BACKWARD, NORM, "x", pattern=("dropout?", "norm"))
    Rule("tee_norm", FORWARD, NORM, "x", pattern=("make_extra_output?", "norm"))  # the extra output is x
    with pytest.raises(RuleError, match="it may fuse glu \\+ glu, but an elementwise stage holds at most one GLU"):
        Rule("two_glus", FORWARD, ELEMENTWISE, "x", pattern=("glu", "glu"))
    with pytest.raises(RuleError, match="an elementwise stage runs only elementwise ops .* not norm"):
        Rule("bias_norm", BACKWARD, ELEMENTWISE, "x", pattern=("bias", "norm"))


@pytest.mark.parametrize("kwargs, message", [
    (dict(pattern="linear"), "pattern must be a tuple of op kinds"),
    (dict(pattern=("lienar",)), "no registered op has kind 'lienar'; did you mean 'linear'?"),
    (dict(), "give either a pattern of op kinds or a match function, not neither"),
    (dict(pattern=("linear",), match=lambda ops: 1), "not both"),
    (dict(match=lambda ops: 1), "a match function needs covers="),
])
def test_malformed_rules_say_what_to_write(kwargs, message):
    with pytest.raises(RuleError, match=message.replace("(", "\\(").replace("?", "\\?")):
        Rule("r", FORWARD, GEMM, "doc", **kwargs)


def test_pass_and_stage_are_checked():
    with pytest.raises(RuleError, match="pass_ must be 'forward' or 'backward', got 'fwd'"):
        Rule("r", "fwd", GEMM, "doc", pattern=("linear",))
    with pytest.raises(RuleError, match="stage must be a stage implementation"):
        Rule("r", FORWARD, "gemm", "doc", pattern=("linear",))


def test_shipped_rules_are_valid_and_each_names_its_stage():
    for rule in fusion_rules.FORWARD_RULES + fusion_rules.BACKWARD_RULES:
        assert rule.stage in (GEMM, NORM, ELEMENTWISE, OPAQUE, RESHAPE, MODULE, ATTENTION, COLLECTIVE, COLLECTIVE_GEMM)
    assert [r.pass_ for r in fusion_rules.FORWARD_RULES] == [FORWARD] * len(fusion_rules.FORWARD_RULES)
    assert [r.pass_ for r in fusion_rules.BACKWARD_RULES] == [BACKWARD] * len(fusion_rules.BACKWARD_RULES)
