"""A pipeline's value table (generator/values.py, pipeline._values): each value typed and named by
id, the graph's ids for the values it numbers, each op reading and writing value ids; a backward's
grads values of the table too."""

import pytest

from fusegen.frontend import parse_spec
from fusegen.ir import build_graph
from fusegen.pipeline import chain
from fusegen.values import Role, ValueTable

HEAD = "from transformer_engine.pytorch.ops import *\n"


def pipeline(body):
    return chain(build_graph(parse_spec(HEAD + body, "spec.py")[0]))


def test_ops_read_and_write_the_graphs_values_and_a_residual_is_one_value():
    p = pipeline("m = Sequential(MakeExtraOutput(), RMSNorm(16), Linear(16, 32), AddExtraInput(), Dropout(0.1))\n")
    g = p.graph
    tee, norm, linear, bias, add, dropout = p.ops
    assert [op.input for op in p.ops] == [0] + [op.output for op in p.ops[:-1]]  # each reads what the one before wrote
    assert [op.output for op in p.ops] == [node.outputs[0] for node in g.nodes]  # the graph's ids
    assert add.extra_in == g.inputs[1] and p.extra_input_values == (g.inputs[1],)
    assert p.output == g.outputs[0]
    # the residual: the value MakeExtraOutput reads and RMSNorm reads is x; the extra output a value of its own
    assert tee.input == 0 and norm.input == tee.output
    assert p.value(tee.extra_out).name == "extra_output0" and p.value(tee.extra_out).role is Role.ACTIVATION
    names = {v.name: v for v in p.values}
    assert [v.id for v in p.values] == list(range(len(p.values)))
    assert names["x"].id == 0 and names["x"].dtype == "x"
    assert p.value(linear.output).name == "linear2_pre_bias" and p.value(bias.output).name == "linear2_out"
    assert p.value(add.extra_in).name == "extra_input0"
    assert p.value(linear.param("weight")).name == "linear2_weight"
    assert p.value(linear.param("weight")).role is Role.PARAMETER
    assert p.value(dropout.seed).role is Role.METADATA and p.value(dropout.seed).dtype == "int64"
    assert p.value(p.training).role is Role.FLAG and p.value(p.training).name == "training"
    assert p.features(linear.input) == 16 and p.features(linear.output) == 32


def test_a_hidden_tee_writes_a_value_the_graph_has_no_id_for():
    p = pipeline("m = Sequential(AddExtraInput(in_place=True), Linear(16, 16))\n")
    add, tee, linear, _ = p.ops
    assert tee.writes_back_to == 0 and tee.input == add.output
    assert tee.output >= len(p.graph.values) and linear.input == tee.output  # after the graph's ids
    assert p.value(tee.extra_out).name == "new_extra_input0"
    assert p.training is None  # no random op: the forward takes no training flag
    assert p.chain_order(tee.output) == 2 and p.chain_order(linear.input) == 2


def test_a_row_scaled_input_is_rowwise_and_a_user_module_an_object():
    p = pipeline("import torch\nm = Sequential(Linear(8, 8), torch.nn.Softmax(dim=-1), ScaledSwiGLU())\n")
    module = next(op for op in p.ops if op.opdef.user_module)
    scaled = p.ops[-1]
    assert p.value(module.module_object).role is Role.OBJECT and p.value(module.lead).role is Role.METADATA
    assert (p.value(module.module_object).name, p.value(module.lead).name) == ("module1_module", "module1_lead")
    assert p.value(scaled.extra_in).role is Role.ROWWISE and p.value(scaled.extra_in).features == 1
    assert p.features(scaled.output) == 4


def test_a_grad_is_a_value_of_the_table_made_once_of_its_values_role():
    p = pipeline("m = Sequential(LayerNorm(16), Linear(16, 32))\n")
    table = ValueTable(p.values)
    norm, linear, _bias = p.ops
    weight = linear.param("weight")
    d_out, d_weight = table.grad(p.output), table.grad(weight)
    assert table.grad(p.output) == d_out and table.grad(weight) == d_weight  # made the first time only
    assert d_out not in {value.id for value in p.values}  # a new id; the pipeline's own table is as it was
    out = table[d_out]
    assert (out.role, out.dtype, out.features, out.grad_of, out.name) == \
        (Role.ACTIVATION, "x", 32, p.output, "d_linear1_out")
    w = table[d_weight]
    assert (w.role, w.dtype, w.grad_of, w.name) == (Role.PARAMETER, "param", weight, "d_linear1_weight")
    assert table[table.grad(norm.input, "d_input")].name == "d_input"  # the emitter names it after its tensor
    assert all(value.grad_of is None for value in p.values)
    with pytest.raises(AssertionError, match="a grad of a grad"):
        table.grad(d_out)
