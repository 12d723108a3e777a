"""Kernels of size-generic runs (stages/elementwise/): one kernel per run whatever the pipeline
around it, its sizes in terms of its own N; fixed-size kernels the launcher dispatches to."""

from fusegen import build, fusion_rules
from fusegen.frontend import parse_spec
from fusegen.ir import Sym
from fusegen.names import NameTable

HEAD = "from transformer_engine.pytorch.ops import *\n"


def kernels(text, features=None):
    plans = build.plan_specs(parse_spec(HEAD + text, "spec.py"), NameTable(), fusion_rules.FORWARD_RULES,
                             fusion_rules.BACKWARD_RULES, features)
    unique, _ = build.collect_kernels(plans)  # raises if two different kernels share a name
    return unique


def test_a_run_after_a_glu_shares_the_kernel_of_the_same_run_alone():
    unique = kernels("a = Sequential(SwiGLU(), SwiGLU())\nb = Sequential(SwiGLU())\n")
    assert sorted(unique) == ["swiglu_bwd_any", "swiglu_fwd_any"]
    bwd = unique["swiglu_bwd_any"].ctx
    assert bwd["generic"] and bwd["width"] is None and bwd["in_width"] == Sym(2)  # dx is 2N wide
    assert [p.name for p in unique["swiglu_fwd_any"].params] == ["x", "y", "rows", "n"]


def test_specialised_sizes_are_the_fixed_size_kernels_other_pipelines_have():
    unique = kernels("generic = Sequential(SwiGLU())\nfixed = Sequential(BasicLinear(8, 64), SwiGLU())\n",
                     {"generic": (64, 256)})
    assert {"swiglu_fwd_n32", "swiglu_fwd_n128", "swiglu_bwd_n32", "swiglu_bwd_n128"} <= set(unique)
    fixed = build.fixed_sizes(unique)
    assert {name: [s.name for s in specs] for name, specs in fixed.items()} == {
        "swiglu_fwd_any": ["swiglu_fwd_n32", "swiglu_fwd_n128"],
        "swiglu_bwd_any": ["swiglu_bwd_n32", "swiglu_bwd_n128"],
    }
