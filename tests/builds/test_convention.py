"""The generated calling convention derived from the roles of a pipeline's free values
(generator/emit/convention.py)."""

import pytest

from fusegen.emit import convention
from fusegen.frontend import parse_spec
from fusegen.pipeline import build_pipeline
from fusegen.values import Role


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
    assert convention.grad_inputs(args, "d_x") == ["d_x", "d_extra_input0", "d_extra_input1", "d_linear0_weight",
                                                  "d_linear0_bias", "None"]
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
    assert convention.grad_inputs(args, "d_x")[-2:] == ["None", "None"]
    with pytest.raises(AssertionError, match="no type in a custom op's schema"):
        convention.schema(args, 1)
