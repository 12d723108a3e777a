"""A Residual in the IR and the chain: its ops between a tee and an add joined by ONE internal value
(no extra input or output of the pipeline), numbered and keyed by the eager module's nesting."""

from fusegen.frontend import parse_spec
from fusegen.ops import RESIDUAL
from fusegen.pipeline import build_pipeline
from fusegen.values import Role

SPEC = """\
from fusegen.eager import Sequential, Residual, RMSNorm, LayerNorm, Linear, GELU
m = Sequential(
    Linear(8, 8, bias=False),
    Residual(
        LayerNorm(8),
        Residual(RMSNorm(8), Linear(8, 8)),
        GELU(),
    ),
)
"""


def pipeline():
    return build_pipeline(parse_spec(SPEC, "spec.py")[0])


def test_a_residual_is_a_tee_and_an_add_joined_by_one_internal_value():
    p = pipeline()
    assert [(op.number, op.opdef.name, op.residual) for op in p.ops] == [
        ("0", "BasicLinear", ""),
        ("1a", "MakeExtraOutput", "1"), ("1.0", "LayerNorm", ""),
        ("1.1a", "MakeExtraOutput", "1.1"), ("1.1.0", "RMSNorm", ""), ("1.1.1a", "BasicLinear", ""),
        ("1.1.1b", "Bias", ""), ("1.1b", "AddExtraInput", "1.1"),
        ("1.2", "GELU", ""), ("1b", "AddExtraInput", "1"),
    ]
    tees = [op for op in p.ops if op.residual and op.extra_out is not None]
    adds = [op for op in p.ops if op.residual and op.extra_in is not None]
    # each Residual's add reads the very value its tee keeps: its input
    assert [t.extra_out for t in tees] == [adds[1].extra_in, adds[0].extra_in] == list(p.residual_values)
    assert [p.value(v).name for v in p.residual_values] == ["residual1", "residual1_1"]
    assert all(p.value(v).role == Role.ACTIVATION and p.value(v).features == 8 for v in p.residual_values)
    assert [p.graph.values[v].producer for v in p.residual_values] == [1, 3]  # written by the tee's node
    # not the pipeline's: no extra input or output
    assert (p.num_extra_inputs, p.num_extra_outputs) == (0, 0)
    assert all(op.extra_input is None and op.extra_output is None for op in p.ops)
    assert p.graph.inputs == (0,) and p.graph.outputs == (p.output,)
    assert not set(p.residual_values) & {op.output for op in p.ops}
    # the tee hands its input on to the Residual's ops; the add's output is the Residual's
    assert [p.value(t.output).name for t in tees] == ["residual1_in", "residual1_1_in"]
    assert [p.value(a.output).name for a in adds] == ["residual1_1_out", "residual1_out"]


def test_parameters_and_numbers_follow_the_eager_nesting():
    p = pipeline()
    assert [key for _, _, key, _, _ in p.params] == [
        "0.weight", "1.0.weight", "1.0.bias", "1.1.0.weight", "1.1.1.weight", "1.1.1.bias"]
    assert [p.value(v).name for op in p.ops for _, v in op.param_ids][:3] == [
        "linear0_weight", "layernorm1_0_weight", "layernorm1_0_bias"]
    nodes = p.graph.nodes
    assert [n.module_index for n in nodes if n.module_name == RESIDUAL] == ["1", "1.1", "1.1", "1"]
    assert nodes[1].module_call == "Residual()"


def test_a_grad_of_the_residual_value_is_one_grad_value():
    """The add's backward and the tee's backward meet on one grad value (ValueTable.grad)."""
    from fusegen.values import ValueTable

    p = pipeline()
    table = ValueTable(p.values)
    (outer, inner) = p.residual_values
    assert table.grad(outer) == table.grad(outer) != table.grad(inner)
    assert table[table.grad(outer)].name == "d_residual1"
