"""The Mermaid diagrams of a pipeline's plan (`<pipeline>.plan.md`, which GitHub renders): forward
and backward as flowcharts, each fused stage a box around the ops it runs, labelled with what it
runs as (a kernel, a GEMM call, or nothing); extra inputs enter the stage that adds them, extra
outputs leave the stage that hands them out. Each op is labelled and named by its number in the
spec (names.spec_numbers), as the plan's tables and the generated code cite it."""

from __future__ import annotations


def _label(text: str) -> str:
    """A quoted Mermaid label: quotes as entities, backticks dropped (Mermaid reads them as markdown)."""
    return '"' + text.replace('"', "#quot;").replace("`", "") + '"'


def _id(number: str) -> str:
    """An op's number as part of a Mermaid node id ("0.1a" inside a Residual: no dots)."""
    return number.replace(".", "_")


def flowchart(prefix: str, stages, runs_as: dict, pass_: str, extra_inputs: list[str],
              extra_outputs: list[str]) -> str:
    """One pass as a Mermaid flowchart: ``stages`` as (number in the plan's table, stage) in the
    order they run."""
    backward = pass_ == "backward"
    lines = ["flowchart LR", f"  {prefix}_in([{'dy' if backward else 'x'}])"]
    previous = f"{prefix}_in"
    tees: dict[str, str] = {}  # a Residual's path: the step of its tee, which keeps its input
    adds: dict[str, str] = {}  # ... and of its add, which reads it
    for n, stage in stages:
        box = f"{prefix}{n}"
        title = f"stage {n} · {stage.rule.name}: {runs_as[(pass_, stage.start)]}"
        lines.append(f"  subgraph {box} [{_label(title)}]")
        ops = list(reversed(stage.ops)) if backward else list(stage.ops)
        for op in ops:
            lines.append(f"    {box}_{_id(op.number)}[{_label(f'{op.number}: {op.describe()}')}]")
        lines += [f"    {box}_{_id(a.number)} --> {box}_{_id(b.number)}" for a, b in zip(ops, ops[1:])]
        lines.append("  end")
        lines.append(f"  {previous} --> {box}")
        previous = box
        for op in ops:
            # an extra input comes in (its grad goes out); an extra output goes out (its grad comes in)
            if op.extra_input is not None:
                name = ("d_" if backward else "") + extra_inputs[op.extra_input]
                node, step = f"{prefix}_{name}([{name}])", f"{box}_{_id(op.number)}"
                lines.append(f"  {step} --> {node}" if backward else f"  {node} --> {step}")
            if op.extra_output is not None and op.writes_back_to is None:
                name = ("d_" if backward else "") + extra_outputs[op.extra_output]
                node, step = f"{prefix}_{name}([{name}])", f"{box}_{_id(op.number)}"
                lines.append(f"  {node} --> {step}" if backward else f"  {step} --> {node}")
            if op.residual:  # the Residual's value, from its tee to its add (its grad the other way)
                (tees if op.extra_out is not None else adds)[op.residual] = f"{box}_{_id(op.number)}"
    for path, tee in tees.items():
        name = f"residual {path}"
        lines.append(f"  {adds[path]} -.->|{_label('d ' + name)}| {tee}" if backward
                     else f"  {tee} -.->|{_label(name)}| {adds[path]}")
    lines.append(f"  {previous} --> {prefix}_out([{'dx' if backward else 'y'}])")
    return "\n".join(lines)
