"""The graph IR (generator/ir.py): values with feature sizes (symbolic where no op fixes one),
extra inputs and outputs as graph values, views as nodes; and the planner's chain view of it."""

import pytest

from fusegen.frontend import parse_spec
from fusegen.ir import Sym, build_graph
from fusegen.pipeline import chain

HEAD = "from transformer_engine.pytorch.ops import *\n"


def graph(body):
    return build_graph(parse_spec(HEAD + body, "spec.py")[0])


def test_extra_inputs_and_outputs_are_graph_values_in_order():
    g = graph("m = Sequential(AddExtraInput(), MakeExtraOutput(), RMSNorm(16), Linear(16, 32), AddExtraInput())\n")
    assert [n.opdef.name for n in g.nodes] == ["AddExtraInput", "MakeExtraOutput", "RMSNorm", "BasicLinear",
                                               "Bias", "AddExtraInput"]
    add0, tee, norm, linear, bias, add1 = g.nodes
    x, r0, r1 = g.inputs
    assert add0.inputs == (x, r0) and add1.inputs == (bias.outputs[0], r1)
    assert g.outputs == (add1.outputs[0], tee.inputs[0])  # the extra output is the value MakeExtraOutput reads
    assert tee.inputs[0] == add0.outputs[0]
    assert [g.features(v) for v in g.inputs] == [16, 16, 32]
    assert [g.features(v) for v in g.outputs] == [32, 16]
    assert all(g.values[v].producer is None for v in g.inputs)
    assert g.values[norm.outputs[0]].producer == norm.index and not g.symbolic


def test_sizes_flow_backwards_through_a_glu():
    g = graph("m = Sequential(GELU(), SwiGLU(), Linear(64, 8))\n")
    assert [g.features(n.inputs[0]) for n in g.nodes] == [128, 128, 64, 8]


def test_sizes_no_op_fixes_are_symbolic_and_the_chain_is_size_generic():
    g = graph("m = Sequential(GELU(), SwiGLU(), ConstantScale(2.0), SwiGLU())\n")
    assert g.symbolic
    assert [str(g.features(n.inputs[0])) for n in g.nodes] == ["n", "n", "n / 2", "n / 2"]
    assert g.features(g.outputs[0]) == Sym() // 4
    p = chain(g, specialise=(64,))
    assert p.generic and p.divisor == 4 and p.specialise == (64,)
    assert [p.width(i) for i in range(5)] == [Sym(), Sym(), Sym() // 2, Sym() // 2, Sym() // 4]
    assert [p.width(i, 64) for i in range(5)] == [64, 64, 32, 32, 16]


def test_symbolic_sizes_as_expressions():
    assert [(Sym() * k).expr("n", "//") for k in (1, 2)] == ["n", "2 * n"]
    assert (Sym() // 2).expr("N", "/") == "N / 2" and (Sym() * 3 // 4).expr("n", "//") == "3 * n // 4"
    assert Sym() + Sym() // 2 == Sym() * 3 // 2 and 0 + Sym() == Sym()
    with pytest.raises(ValueError, match="not a whole number of features at n = 3"):
        (Sym() // 2).at(3)


def test_identity_is_a_view_node_that_the_chain_leaves_out():
    g = graph("m = Sequential(Identity(), Bias(8), Identity())\n")
    first, bias, last = g.nodes
    assert first.opdef.view and first.outputs == first.inputs
    assert g.outputs == (bias.outputs[0],) == last.outputs
    p = chain(g)
    assert [op.opdef.name for op in p.ops] == ["Bias"] and p.graph is g
    assert (p.in_features, p.out_features, p.num_extra_inputs, p.num_extra_outputs) == (8, 8, 0, 0)


def test_the_chain_numbers_extra_inputs_and_outputs_by_graph_order():
    p = chain(graph("m = Sequential(MakeExtraOutput(), Bias(8), AddExtraInput(), MakeExtraOutput(), "
                    "AddExtraInput())\n"))
    assert [(op.extra_input, op.extra_output) for op in p.ops] == [(None, 0), (None, None), (0, None), (None, 1),
                                                                    (1, None)]
