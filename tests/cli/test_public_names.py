"""Public argument names of generated modules: extra inputs and outputs are named by their order,
so inserting an unrelated op earlier in the spec renames nothing a caller passes or receives."""

from fusegen import fusion_rules
from fusegen import emit
from fusegen.stages import stage_kernels
from fusegen.build import plan_specs
from fusegen.frontend import parse_spec
from fusegen.names import NameTable

HEAD = "from fusegen.eager import Sequential, RMSNorm, Linear, GELU, AddExtraInput, MakeExtraOutput\n"


def public_names(body: str) -> tuple[list[str], list[str]]:
    (plan,) = plan_specs(parse_spec(HEAD + body, "spec.py"), NameTable(), fusion_rules.FORWARD_RULES,
                         fusion_rules.BACKWARD_RULES)
    context = emit.pipeline_context(plan, stage_kernels(plan))
    return context["extra_inputs"], context["extra_outputs"]


def test_extra_tensors_are_named_by_order():
    body = "m = Sequential(MakeExtraOutput(), RMSNorm(8), Linear(8, 8), AddExtraInput(), MakeExtraOutput(), AddExtraInput())\n"
    assert public_names(body) == (["extra_input0", "extra_input1"], ["extra_output0", "extra_output1"])


def test_inserting_an_op_renames_nothing_public():
    before = public_names("m = Sequential(MakeExtraOutput(), RMSNorm(8), Linear(8, 8), AddExtraInput())\n")
    after = public_names("m = Sequential(Linear(8, 8), GELU(), MakeExtraOutput(), RMSNorm(8), Linear(8, 8), "
                         "AddExtraInput())\n")
    assert before == after == (["extra_input0"], ["extra_output0"])
