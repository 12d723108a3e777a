"""The fusion plan chosen for each shipped spec: which rule made each stage, what is saved."""

from pathlib import Path

import pytest

from fusegen import fusion_rules
from fusegen.frontend import parse_spec_file
from fusegen.stages import stage_kernels
from fusegen.pipeline import build_pipeline
from fusegen.plan import plan_pipeline

SPECS = Path(__file__).resolve().parents[2] / "specs"


def plan_of(file, name):
    spec = next(s for s in parse_spec_file(SPECS / file, f"specs/{file}") if s.name == name)
    return plan_pipeline(build_pipeline(spec), fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)


def summary(stages):
    return [(s.rule.name, s.kind, tuple(op.opdef.name for op in s.ops)) for s in stages]


def kernel_names(plan):
    return {key: [k.name for k in specs] for key, specs in stage_kernels(plan).items()}


def test_te_mlp():
    plan = plan_of("te_mlp.py", "te_mlp")
    assert summary(plan.forward) == [
        ("norm", "norm", ("LayerNorm",)),
        ("linear_bias", "gemm", ("BasicLinear", "Bias")),
        ("elementwise", "elementwise", ("SwiGLU",)),
        ("linear_bias", "gemm", ("BasicLinear", "Bias")),
    ]
    assert summary(plan.backward) == [
        ("norm_backward", "norm", ("LayerNorm",)),
        ("linear_backward", "gemm", ("BasicLinear",)),
        ("elementwise_backward", "elementwise", ("Bias", "SwiGLU")),
        ("linear_backward", "gemm", ("BasicLinear",)),
        ("elementwise_backward", "elementwise", ("Bias",)),
    ]
    assert kernel_names(plan) == {
        ("forward", 0): ["layernorm_fwd_h4096"],
        ("forward", 3): ["swiglu_fwd_n14336"],
        ("backward", 0): ["layernorm_bwd_h4096", "column_sum_n8192"],
        ("backward", 2): ["bias_swiglu_bwd_n14336", "column_sum_n28672"],
        ("backward", 5): ["bias_bwd_n4096", "column_sum_n4096"],
        # without grad: the same stages, so the same kernels
        ("inference", 0): ["layernorm_fwd_h4096"],
        ("inference", 3): ["swiglu_fwd_n14336"],
    }
    assert plan.inference == plan.forward
    # the SwiGLU backward recomputes from its input (the GEMM + bias output), nothing else
    assert plan.recompute[2].saved == 3
    assert plan.saved_values == (0, 1, 3, 4)


def test_residual_split():
    fc1 = plan_of("residual_split.py", "fc1")
    assert [s.rule.name for s in fc1.forward] == ["norm", "elementwise", "linear_bias", "elementwise"]
    assert fc1.forward[1].kind == "passthrough"  # MakeExtraOutput hands out the norm output as is
    assert summary(fc1.backward) == [
        ("norm_backward", "norm", ("LayerNorm",)),
        ("extra_output_linear_backward", "gemm", ("MakeExtraOutput", "BasicLinear")),
        ("elementwise_backward", "elementwise", ("Bias", "SwiGLU")),
    ]
    fc2 = plan_of("residual_split.py", "fc2")
    assert summary(fc2.forward) == [
        ("linear_bias", "gemm", ("BasicLinear", "Bias")),
        ("elementwise", "elementwise", ("AddExtraInput",)),
    ]
    assert summary(fc2.backward) == [
        ("linear_backward", "gemm", ("BasicLinear",)),
        ("elementwise_backward", "elementwise", ("Bias", "AddExtraInput")),
    ]
    assert kernel_names(fc2)[("backward", 1)] == ["bias_add_bwd_n4096", "column_sum_n4096"]


def test_prenorm_block():
    plan = plan_of("prenorm_block.py", "prenorm_block")
    assert summary(plan.forward) == [
        ("elementwise", "passthrough", ("MakeExtraOutput",)),
        ("norm", "norm", ("RMSNorm",)),
        ("linear_bias", "gemm", ("BasicLinear", "Bias")),
        ("elementwise", "elementwise", ("AddExtraInput",)),
    ]
    assert summary(plan.backward) == [
        ("norm_residual_grad", "norm", ("MakeExtraOutput", "RMSNorm")),
        ("linear_backward", "gemm", ("BasicLinear",)),
        ("elementwise_backward", "elementwise", ("Bias", "AddExtraInput")),
    ]
    assert kernel_names(plan)[("backward", 0)] == ["rmsnorm_bwd_h4096_add_dresidual", "column_sum_n4096"]


def test_gpt2_mlp():
    plan = plan_of("gpt2_mlp.py", "gpt2_mlp")
    assert [s.rule.name for s in plan.forward] == ["norm", "linear_bias", "elementwise", "linear_bias"]
    # without grad the GELU runs in the GEMM's epilogue: nothing needs its input afterwards
    assert [s.rule.name for s in plan.inference] == ["norm", "linear_bias_gelu", "linear_bias"]
    assert [s.rule.name for s in plan.backward] == [
        "norm_backward", "linear_backward", "elementwise_backward", "linear_backward", "elementwise_backward"]
    assert kernel_names(plan)[("backward", 2)] == ["bias_gelu_bwd_n4096", "column_sum_n4096"]


@pytest.mark.parametrize("source,forward,backward", [
    # AddExtraInput right before a norm fuses into it; the sum is the extra output
    ("AddExtraInput(), MakeExtraOutput(), RMSNorm(64)", ["add_norm"], ["norm_residual_grad"]),
    ("AddExtraInput(), LayerNorm(64)", ["add_norm"], ["norm_residual_grad"]),
    # a run of elementwise ops is one stage in each pass, Bias included when no GEMM takes it
    ("Bias(64), GELU(), ConstantScale(0.5), AddExtraInput()", ["elementwise"], ["elementwise_backward"]),
    # a second GLU starts a new run
    ("Bias(64), SwiGLU(), SwiGLU()", ["elementwise", "elementwise"], ["elementwise_backward", "elementwise_backward"]),
    ("BasicLinear(64, 32), Bias(32)", ["linear_bias"], ["linear_backward", "elementwise_backward"]),
    # what the GEMM epilogue takes (fusion_rules/linear_epilogue.py)
    ("BasicLinear(64, 32), AddExtraInput()", ["linear_scale_add"], ["linear_backward", "elementwise_backward"]),
    ("BasicLinear(64, 32), ConstantScale(0.5), AddExtraInput()", ["linear_scale_add"],
     ["linear_scale_backward", "elementwise_backward"]),
    ("BasicLinear(64, 32), ConstantScale(0.5)", ["linear_bias_scale"], ["linear_scale_backward"]),
    ("BasicLinear(64, 32), Bias(32), ConstantScale(0.5)", ["linear_bias_scale"],
     ["linear_backward", "elementwise_backward"]),
    # cuBLASLt's bias + ReLU epilogue; the ReLU's backward reads the GEMM's output
    ("BasicLinear(64, 32), Bias(32), ReLU()", ["linear_bias_relu"], ["linear_backward", "elementwise_backward"]),
    # ... and serves the ops after it in the same backward run (recomputed from it)
    ("BasicLinear(64, 32), Bias(32), ReLU(), SwiGLU()", ["linear_bias_relu", "elementwise"],
     ["linear_backward", "elementwise_backward"]),
    # a bias and a residual would need two C operands: the add stays elementwise
    ("BasicLinear(64, 32), Bias(32), AddExtraInput()", ["linear_bias", "elementwise"],
     ["linear_backward", "elementwise_backward"]),
    # dropout beside a norm runs in the norm kernel (fusion_rules/dropout_norm.py); the GEMM then
    # leaves its bias to the norm kernel too, and the backward is the norm's, then the run's
    ("BasicLinear(64, 64), Bias(64), Dropout(0.1), AddExtraInput(), MakeExtraOutput(), LayerNorm(64)",
     ["linear", "dropout_add_norm"], ["linear_backward", "elementwise_backward", "norm_residual_grad"]),
    ("Dropout(0.1), RMSNorm(64)", ["dropout_add_norm"], ["elementwise_backward", "norm_backward"]),
    ("Bias(64), Dropout(0.1), RMSNorm(64), Dropout(0.2)", ["dropout_add_norm"],
     ["elementwise_backward", "norm_backward", "elementwise_backward"]),
    ("AddExtraInput(), LayerNorm(64), Dropout(0.1)", ["norm_dropout"],
     ["norm_residual_grad", "elementwise_backward"]),
    # L2Normalization at a fixed width runs in the norm kernels; at any width, as PyTorch
    ("BasicLinear(64, 64), L2Normalization()", ["linear", "l2_normalization"],
     ["linear_backward", "l2_normalization_backward"]),
    ("L2Normalization()", ["opaque"], ["opaque_backward"]),
    # a GELU before a norm is not dropout: an elementwise run, then the norm
    ("GELU(), RMSNorm(64)", ["elementwise", "norm"], ["elementwise_backward", "norm_backward"]),
])
def test_rules_on_small_pipelines(source, forward, backward):
    from fusegen.frontend import parse_spec

    text = f"from fusegen.eager import *\np = Sequential({source})\n"
    text = text.replace("import *", "import Sequential, AddExtraInput, MakeExtraOutput, RMSNorm, LayerNorm, "
                        "Bias, GELU, ConstantScale, SwiGLU, BasicLinear, ReLU, Dropout, L2Normalization")
    plan = plan_pipeline(build_pipeline(parse_spec(text, "t.py")[0]), fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    assert [s.rule.name for s in plan.forward] == forward
    assert [s.rule.name for s in plan.backward] == backward


def test_recompute_from_an_earlier_value_when_the_gemm_does_not_take_the_bias():
    from fusegen.frontend import parse_spec

    text = ("from fusegen.eager import Sequential, LayerNorm, Bias, GELU\n"
            "p = Sequential(LayerNorm(64), Bias(64), GELU())\n")
    plan = plan_pipeline(build_pipeline(parse_spec(text, "t.py")[0]), fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    # the GELU input (after the bias) is never materialised: backward recomputes from the norm output
    assert plan.recompute[1].saved == 1
    assert kernel_names(plan)[("backward", 1)] == ["bias_gelu_bwd_n64_from_bias", "column_sum_n64"]


def test_an_op_no_rule_covers_is_a_spec_error_at_the_op():
    from fusegen.errors import SpecError
    from fusegen.frontend import parse_spec
    from spec_errors import assert_points_at

    source = ("from fusegen.eager import Sequential, Linear, GELU\n"
              "p = Sequential(\n    Linear(8, 8),\n    GELU(),\n)\n")
    pipeline = build_pipeline(parse_spec(source, "spec.py")[0])
    without_elementwise = [r for r in fusion_rules.BACKWARD_RULES if r.stage.name != "elementwise"]
    with pytest.raises(SpecError) as info:
        plan_pipeline(pipeline, fusion_rules.FORWARD_RULES, without_elementwise)
    assert info.value.message == (
        "no backward fusion rule covers op 0b, Bias(8) (op kind 'bias'); the backward rules of fusion_rules/__init__.py need "
        "a rule for this op kind: add one, or leave the op out of the pipeline")
    assert_points_at(info.value, source, 3, 5, "Linear(8, 8)")  # Bias is half of this Linear
    with pytest.raises(SpecError) as info:
        plan_pipeline(pipeline, (), fusion_rules.BACKWARD_RULES)  # no rules at all
    assert info.value.message.startswith("no forward fusion rule covers op 0a, BasicLinear(8, 8) (op kind 'linear')")


def test_plan_tables_claim_nothing_a_stage_does_not_do():
    """In every shipped plan: a stage that runs no kernel says it computes nothing (not its rule's
    "one kernel ..."), and a norm's row names the statistics for what they are (an RMSNorm keeps
    no mean)."""
    plans = sorted((SPECS.parent / "generated").glob("*.plan.md"))
    assert plans
    for plan in plans:
        for row in plan.read_text().splitlines():
            cells = [c.strip() for c in row.strip("|").split("|")]
            if len(cells) == 4 and cells[3] == "no kernel":
                assert "nothing to compute" in cells[2] and "one kernel" not in cells[2], (plan.name, row)
            if "`norm`:" in row:
                assert "mean/rstd" not in row and "RMSNorm: rstd" in row, (plan.name, row)
        # every saved tensor with its shape and dtype; statistics are fp32 per row, an RMSNorm keeps no mean
        saved = plan.read_text().split("## Saved for backward", 1)[1]
        for row in saved.splitlines():
            cells = [c.strip() for c in row.strip("|").split("|")]
            if row.startswith("| `"):
                assert len(cells) == 3 and cells[1] and cells[2], (plan.name, row)
                if cells[0].endswith(("_mean`", "_rstd`")):
                    assert cells[1:] == ["[rows]", "float32"], (plan.name, row)
                assert not (cells[0].startswith("`rmsnorm") and cells[0].endswith("_mean`")), (plan.name, row)


def test_plans_draw_forward_and_backward_with_each_op_in_its_stage():
    """Every shipped plan holds two Mermaid flowcharts: each stage of its table a subgraph (by
    the table's number, labelled with what it runs as), each op inside the stage that runs it, the
    subgraphs balanced, and the stages linked in the order they run."""
    import re

    for plan_file in sorted((SPECS.parent / "generated").glob("*.plan.md")):
        text = plan_file.read_text()
        charts = re.findall(r"```mermaid\n(.*?)```", text, re.S)
        assert len(charts) == 2, plan_file.name
        for chart, section in zip(charts, ("## Forward", "## Backward")):
            table = text.split(section, 1)[1].split("```mermaid", 1)[0]
            rows = [[c.strip() for c in r.strip("|").split("|")]
                    for r in table.splitlines() if r[:3].strip("| ").isdigit()]
            assert chart.startswith("flowchart LR\n") and chart.count("subgraph ") == chart.count("\n  end") == len(rows)
            order = re.findall(r"subgraph [fb](\d+) \[\"stage (\d+) · ([a-z0-9_]+): (.*?)\"\]", chart)
            assert len(order) == len(rows)
            for number, shown, rule, runs_as in order:
                row = rows[int(number)]
                assert number == shown and row[2].startswith(f"`{rule}`") and runs_as == row[3].replace("`", "")
                body = re.search(rf"subgraph [fb]{number} \[.*?\n(.*?)\n  end", chart, re.S).group(1)
                # the nodes inside the stage's subgraph, by the ops' numbers in the spec ("1a": a Linear's
                # BasicLinear; "0.1a" inside a Residual, drawn as 0_1a), in the order they run
                ops = [op.replace("_", ".") for op in re.findall(r"^    [fb]\d+_(\d+(?:_\d+)*[a-z]?)\[", body, re.M)]
                ops = ops[::-1] if section == "## Backward" else ops
                assert ops == row[1].split(", "), (plan_file.name, number)
            numbers = [int(n) for n, *_ in order]
            assert numbers == (sorted(numbers) if section == "## Forward" else sorted(numbers, reverse=True))


def test_residual_blocks_fuse_across_the_residuals():
    """A Residual is data flow: the add that closes the first fuses into the second's LayerNorm
    (forward), its grad into that norm's backward, the first tee's grad into the RMSNorm's dx, and
    the second Residual's GEMM adds into the residual with beta = 1."""
    plan = plan_of("residual_blocks.py", "residual_blocks")
    numbers = lambda stages: [(s.rule.name, tuple(op.number for op in s.ops)) for s in stages]  # noqa: E731
    assert numbers(plan.forward) == [
        ("elementwise", ("0a",)),
        ("norm", ("0.0",)),
        ("linear_bias", ("0.1a", "0.1b")),
        ("elementwise", ("0.2",)),
        ("linear_bias", ("0.3a", "0.3b")),
        ("add_norm", ("0b", "1a", "1.0")),
        ("linear_scale_add", ("1.1", "1b")),
    ]
    assert plan.forward[0].kind == "passthrough"
    assert numbers(plan.backward) == [
        ("norm_residual_grad", ("0a", "0.0")),
        ("linear_backward", ("0.1a",)),
        ("elementwise_backward", ("0.1b", "0.2")),
        ("linear_backward", ("0.3a",)),
        ("elementwise_backward", ("0.3b",)),
        ("norm_residual_grad", ("0b", "1a", "1.0")),
        ("linear_backward", ("1.1",)),
        ("elementwise_backward", ("1b",)),
    ]
    kernels = kernel_names(plan)  # by (pass, the stage's first op's index)
    assert kernels[("forward", plan.forward[5].start)] == ["add_layernorm_fwd_h1024"]
    assert kernels[("backward", plan.backward[0].start)][0] == "rmsnorm_bwd_h1024_add_dresidual"
    assert kernels[("backward", plan.backward[5].start)][0] == "layernorm_bwd_h1024_add_dresidual"
    assert ("forward", plan.forward[6].start) not in kernels  # the residual add is the GEMM's beta = 1
    p = plan.pipeline
    # the second Residual's value: written by the add_norm kernel (the sum), read by the GEMM
    second = p.residual_values[1]
    assert plan.forward[5].ops[1].extra_out == second == plan.forward[6].ops[1].extra_in
    assert (p.num_extra_inputs, p.num_extra_outputs) == (0, 0)


def test_nested_residual_adds_into_elementwise_and_norm_kernels():
    plan = plan_of("residual_blocks.py", "nested_residual")
    numbers = lambda stages: [(s.rule.name, tuple(op.number for op in s.ops)) for s in stages]  # noqa: E731
    assert ("elementwise", ("1.1b", "1.2")) in numbers(plan.forward)  # the inner add, then the GELU: one kernel
    assert numbers(plan.forward)[-1] == ("add_norm", ("1b", "2"))  # the outer add into the last RMSNorm
    assert ("norm_residual_grad", ("1.1a", "1.1.0")) in numbers(plan.backward)
    assert ("elementwise_backward", ("1.1.1b", "1.1b", "1.2")) in numbers(plan.backward)
    add_gelu = next(s for s in plan.forward if s.ops[0].number == "1.1b")
    assert kernel_names(plan)[("forward", add_gelu.start)] == ["add_gelu_fwd_n1024"]


def test_a_residual_of_elementwise_ops_splits_its_run_at_the_add():
    """A Residual's tee and its add never share an elementwise kernel (one kernel would read the
    value it writes): the add starts the next run, reading the residual from memory."""
    from fusegen.frontend import parse_spec

    spec = parse_spec("from fusegen.eager import Sequential, Residual, GELU\n"
                      "m = Sequential(GELU(), Residual(GELU(), Residual(GELU())), GELU())\n", "spec.py")[0]
    plan = plan_pipeline(build_pipeline(spec), fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    runs = [tuple(op.number for op in s.ops) for s in plan.forward]
    assert runs == [("0", "1a", "1.0", "1.1a", "1.1.0"), ("1.1b", "1b", "2")]
    assert [tuple(op.number for op in s.ops) for s in plan.backward] == runs
