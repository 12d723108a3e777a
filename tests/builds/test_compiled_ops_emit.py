"""emit/compiled.py: torch.compile's training ops of a pipeline, as the compiler derives them. A
pipeline that reads packed sequences (attention: its ops replay no graphs yet, so the shipped
packages hold none of its training ops) still gets ops that will be right when it does: the
offsets a per-call tensor of both ops, ``max_seqlen`` a host int (an ``int`` of each schema, kept
on the ctx, one of the keys a replayed graph is found by), the parameters read where they are."""

from pathlib import Path

from fusegen import emit, fusion_rules
from fusegen.build import plan_specs
from fusegen.emit import convention
from fusegen.emit.compiled import training_ops
from fusegen.frontend import parse_spec
from fusegen.names import NameTable
from fusegen.stages import stage_kernels

ROOT = Path(__file__).resolve().parents[2]


def _ops(spec_file: str, name: str) -> tuple[dict, list[convention.Argument], dict]:
    plans = plan_specs(parse_spec((ROOT / spec_file).read_text(), spec_file), NameTable(),
                       fusion_rules.FORWARD_RULES, fusion_rules.BACKWARD_RULES)
    plan = next(p for p in plans if p.pipeline.name == name)
    context = emit.pipeline_context(plan, stage_kernels(plan))
    leads, lead_lines = emit.leading_dims(plan.pipeline)
    args = convention.arguments(plan.pipeline, leads, set(), lead_lines)
    (function,) = context["functions"]
    return training_ops(plan.pipeline.name, args, function), args, function


def test_packed_sequences_pass_as_a_per_call_tensor_and_a_host_int():
    ops, args, f = _ops("specs/attention_block.py", "mha_block")
    names = [arg.name for arg in args]
    assert names[-2:] == ["cu_seqlens", "max_seqlen"]
    assert "Tensor cu_seqlens, int max_seqlen) -> (" in ops["forward_schema"]
    assert [names[i] for i in ops["forward_per_call"]] == ["x", "cu_seqlens"]
    typed = [a.split(" ") for a in ops["backward_schema"][1:ops["backward_schema"].index(") ->")].split(", ")]
    backward_args, types = [name for _, name in typed], {name: kind for kind, name in typed}
    assert types["max_seqlen"] == "int" and types["cu_seqlens"] == "Tensor?"
    per_call = {backward_args[i] for i in ops["backward_per_call"]}
    assert "cu_seqlens" in per_call and "max_seqlen" not in per_call
    parameters = {arg.name for arg in args if arg.role.value == "parameter"}
    assert parameters and all(types[p] == "Tensor" for p in parameters & set(types))
    assert not parameters & per_call
    # the forward op returns what it makes, never an argument: x, the offsets, the parameters and
    # max_seqlen come to the backward from the op's arguments
    assert not set(ops["made"]) & set(names)
    assert f["host"] == (f["saved"].index("max_seqlen"),)


def test_a_changed_pass_gets_new_op_names():
    first, _, _ = _ops("specs/attention_block.py", "mha_block")
    other, _, _ = _ops("specs/attention_block.py", "mqa_block")
    digest = first["forward"].rsplit("_", 1)[1]
    assert first["forward"] == f"mha_block_forward_{digest}" and first["backward"] == f"mha_block_backward_{digest}"
    assert other["forward"].rsplit("_", 1)[1] != digest
