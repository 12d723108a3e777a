"""The generated calling convention derived from the roles of a pipeline's free values
(generator/emit/convention.py)."""

from fractions import Fraction
from types import SimpleNamespace

import pytest

from fusegen.emit import convention
from fusegen.emit.pipeline import leading_dims
from fusegen.frontend import parse_spec
from fusegen.ir import Sym
from fusegen.pipeline import build_pipeline
from fusegen.values import Role, Value


def pipeline(body):
    return build_pipeline(parse_spec("import torch\nfrom transformer_engine.pytorch.ops import *\n" + body, "spec.py")[0])


def test_free_values_in_order_with_their_rendering_grads_and_schema():
    p = pipeline("m = Sequential(Linear(8, 16), AddExtraInput(), Dropout(0.1), ScaledSwiGLU())\n")
    args = convention.arguments(p, leads={}, copied=set())
    assert [(a.name, a.role) for a in args] == [
        ("x", Role.ACTIVATION), ("extra_input0", Role.ACTIVATION), ("extra_input1", Role.ROWWISE),
        ("linear0_weight", Role.PARAMETER), ("linear0_bias", Role.PARAMETER), ("training", Role.FLAG)]
    assert convention.passed_lines(args) == [
        "as_rows(x, 8),", "as_rows(extra_input0, 16),", "extra_input1.reshape(-1).contiguous(),",
        "linear0_weight, linear0_bias,", "self.training,  # Dropout draws its masks in training only"]
    assert convention.grad_inputs(args, "d_x", lambda value: "d_" + p.value(value).name) == [
        "d_x", "d_extra_input0", "d_extra_input1", "d_linear0_weight", "d_linear0_bias", None]
    assert convention.caller_tensors(args) == ["x", "extra_input0", "extra_input1"]
    assert convention.schema(args, 1) == ("(Tensor x, Tensor extra_input0, Tensor extra_input1, Tensor linear0_weight, "
                                          "Tensor linear0_bias, bool training) -> Tensor")
    copied = convention.arguments(p, leads={}, copied={p.extra_input_values[0]})[1]
    assert copied.passed == "extra_input0.reshape(-1, 16).clone(memory_format=torch.contiguous_format)"


def test_a_user_module_is_passed_with_its_leading_dims_and_has_no_grad_or_schema_type():
    p = pipeline("m = Sequential(Linear(8, 8), torch.nn.Softmax(dim=-1))\n")
    module = next(op for op in p.ops if op.opdef.user_module)
    args = convention.arguments(p, leads={module.index: "lead"}, copied=set())
    assert [a.name for a in args][-2:] == ["module1_module", "module1_lead"]
    assert convention.passed_lines(args)[-1] == 'self._modules["1"], lead,  # torch.nn.Softmax(dim=-1): run as it is'
    assert convention.grad_inputs(args, "d_x", lambda value: "d_" + p.value(value).name)[-2:] == [None, None]
    with pytest.raises(AssertionError, match="no type in a custom op's schema"):
        convention.schema(args, 1)


def checks_of(body):
    p = pipeline(body)
    leads, lead_lines = leading_dims(p)
    args = convention.arguments(p, leads, copied=set(), lead_lines=lead_lines)
    return convention.check_lines(args, lead_lines), convention.check_helpers(args)


def test_the_checks_come_from_the_arguments_parameters_first_and_lead_last_without_a_reshape():
    lines, helpers = checks_of("m = Sequential(Linear(8, 16), AddExtraInput(), Dropout(0.1), ScaledSwiGLU())\n")
    assert lines == [
        'check_parameters("M", ("0.weight", "0.bias"), ((16, 8), (16,)), (linear0_weight, linear0_bias))',
        'check_input("M", "x", x, 8, linear0_weight)',
        'check_input("M", "extra_input0", extra_input0, 16, linear0_weight, x.shape[:-1])',
        'check_row_input("M", "extra_input1", extra_input1, linear0_weight, x.shape[:-1])',
        "lead = x.shape[:-1]"]  # the flag has no check
    assert helpers == ["check_input", "check_packed_form", "check_parameters", "check_row_input"]


def test_the_leading_dims_a_reshape_makes_come_after_x_check_and_before_the_extra_inputs():
    lines, helpers = checks_of("m = Sequential(Linear(8, 16), Reshape((-1, 4)), AddExtraInput())\n")
    assert lines[1:] == [
        'check_input("M", "x", x, 8, linear0_weight)',
        "# the leading dims of the running tensor, which each Reshape changes",
        "lead = x.shape[:-1]",
        'lead1 = ref.reshaped_lead("M", "Reshape((-1, 4)) (op 1 at spec.py:3:31)", (-1, 4), lead.numel() * 16)',
        'check_input("M", "extra_input0", extra_input0, 4, linear0_weight, lead1)']
    assert helpers == ["check_input", "check_packed_form", "check_parameters"]


def test_without_parameters_the_inputs_are_checked_like_x_of_any_shape():
    lines, helpers = checks_of("m = Sequential(GELU(), AddExtraInput())\n")
    assert lines == [
        "# TE's elementwise ops take any shape: a 0-D x is one row of one value",
        'check_input("M", "x", x, None, x, like_is="x is", any_shape=True)',
        "n = x.shape[-1] if x.dim() else 1",
        'check_input("M", "extra_input0", extra_input0, None, x, like_is="x is", shape=x.shape)',
        "lead = x.shape[:-1]"]
    assert helpers == ["check_input", "check_packed_form"]


# Every role, rendered without a spec: (the value, its op, what the forward passes, whether the Function
# returns a grad for it, its schema type (None: it has none), its check lines (None: none)). A new kind of
# input is a row here and its rendering in convention.py.
OP = SimpleNamespace(index=1, module_index=2, hint="module2", args={"call": "torch.nn.Softmax(dim=-1)"},
                     lead=12)
ROLES = [
    (Value(0, Role.ACTIVATION, "x", "x", Sym(1)), None, "as_rows(x, n)", True, "Tensor",
     ('check_input("M", "x", x, None, w, multiple_of=8)', "n = x.shape[-1]")),
    (Value(3, Role.ACTIVATION, "x", "extra_input0", Sym(Fraction(1, 2))), OP, "as_rows(extra_input0, n // 2)", True,
     "Tensor",
     ('check_input("M", "extra_input0", extra_input0, n // 2, w, lead1)',)),
    (Value(4, Role.ROWWISE, "x", "extra_input1", 1), OP, "extra_input1.reshape(-1).contiguous()", True, "Tensor",
     ('check_row_input("M", "extra_input1", extra_input1, w, lead1)',)),
    (Value(5, Role.PARAMETER, "param", "w"), OP, "w", True, "Tensor", ("check_parameters(...)",)),
    (Value(6, Role.FLAG, "bool", "training"), None, "self.training", False, "bool", None),
    (Value(11, Role.OBJECT, "object", "module2_module"), OP, 'self._modules["2"]', False, None, None),
    (Value(12, Role.METADATA, "object", "module2_lead"), OP, "lead1", False, None, None),
    (Value(13, Role.GROUP, "object", "tensor_parallel_group"), None, "self.tensor_parallel_group", False, None, None),
]


def test_every_role_renders_its_passing_grad_schema_and_check_without_a_spec():
    forward = convention.ModuleForward("M", leads={1: "lead1"}, reshapes=True, generic=True, divisor=8, like="w",
                                 parameters_check="check_parameters(...)")
    for value, op, passed, grad, schema, check in ROLES:
        arg = convention.argument(forward, value, op)
        assert (arg.passed, arg.check) == (passed, check), value.role
        assert convention.grad_inputs([arg], "d_x", lambda v: f"d_{value.name}") == [
            "d_x" if value.id == 0 else f"d_{value.name}" if grad else None]
        if schema is None:
            with pytest.raises(AssertionError, match="no type in a custom op's schema"):
                arg.schema
        else:
            assert arg.schema == schema
    # the roles no free value has (kept inside a pipeline) are no argument
    untaken = set(Role) - {value.role for value, *_ in ROLES}
    assert untaken == {Role.STATISTIC, Role.STATE}
    for role in untaken:
        with pytest.raises(AssertionError, match="no argument"):
            convention.argument(forward, Value(7, role, "float32", "stat"), OP)
