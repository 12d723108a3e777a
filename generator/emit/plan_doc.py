"""What plan.md shows beyond the plan itself: each stage's "runs as" and bytes per token, the
spec's ops, what the backward keeps, the Mermaid diagrams."""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

from .. import source_text
from ..diagram import flowchart
from ..errors import Location
from ..ir import Size
from ..pipeline import Op
from ..plan import Plan
from ..stages import Emitter
from ..stages.base import extra_input_name


def runs_as(plan: Plan, stage_kernels: dict) -> dict[tuple[str, int], str]:
    """The plan's "runs as" cell per stage, keyed by (pass, stage start)."""
    return {(pass_, stage.start): stage.rule.stage.runs_as("backward" if pass_ == "backward" else "forward", stage,
                                                           stage_kernels.get((pass_, stage.start), []))
            for pass_, stages in (("forward", plan.forward), ("backward", plan.backward), ("inference", plan.inference))
            for stage in stages}


class SpecRow(NamedTuple):
    """One op of the spec as the plan's Ops table and the module's docstring list it."""

    number: str  # names.spec_numbers
    call: str  # the basic op as a spec would write it
    note: str  # what the plan adds: a view's, or a write-back's
    in_features: Size
    out_features: Size
    location: Location
    op: Op | None  # None for a view


def spec_rows(pipeline, extra_inputs: list[str]) -> list[SpecRow]:
    """The spec's ops in order: each basic op of the planner's chain and each view (Identity),
    which the chain leaves out but the spec's numbering counts."""
    rows = []
    macros = {op.module_index for op in pipeline.ops if op.part}  # TE's modules: which part each op is
    for op in pipeline.ops:
        note = ""
        if op.module_index in macros:  # the module's call on its first row, then each op's part
            first = op.index == 0 or pipeline.ops[op.index - 1].module_index != op.module_index
            call = source_text.md_code(pipeline.graph.nodes[op.node].module_call)
            note = f"{call + ', ' if first else ''}its {op.part.rstrip('.') or 'linear'}"
            if op.held_rows is not None:  # TE's QKV layouts: what the module holds, joined for the GEMM
                held = ", ".join(f"`{name}`" for attr, *_ in op.params for name, _ in op.held_rows.held(attr, ()))
                note += f" ({held}: {op.held_rows.describe()})"
        elif op.writes_back_to is not None:  # the hidden tee after an in-place add, numbered after it
            added = pipeline.ops[op.index - 1]
            note = (f"the sum of op {added.number}, written into the caller's "
                    f"{extra_inputs[op.writes_back_to]} (`in_place=True`)")
        elif op.residual and op.extra_out is not None:
            note = f"opens it, x kept as `{pipeline.value(op.extra_out).name}`"
        elif op.residual:
            note = f"closes it, x read from `{pipeline.value(op.extra_in).name}`"
        rows.append((op.node, SpecRow(op.number, op.describe(), note, op.in_features, op.out_features,
                                              op.location, op)))
    graph = pipeline.graph
    rows += [(node.index, SpecRow(str(node.module_index), node.opdef.describe(node.args), "a view, nothing runs",
                                         graph.features(node.inputs[0]), graph.features(node.outputs[0]),
                                         node.location, None))
             for node in graph.nodes if node.opdef.view]
    # in the order the spec's ops run (graph nodes); stable: a spec op's parts stay in order
    return [row for _, row in sorted(rows, key=lambda pair: pair[0])]


def saved_table(plan: Plan, em: Emitter, saved: list[str], params: list) -> list[tuple[str, str, str]]:
    """(name, shape, dtype) of each tensor the backward reads, for the plan: values and extra
    inputs are [rows, features] in x's dtype; the stages say what their own results are."""
    p = plan.pipeline
    shapes: dict[str, tuple[str, str]] = {}
    for value in plan.saved_values:
        shapes[em.name(value)] = (f"[rows, {p.features(value)}]", "x's dtype")
    for op in p.ops:
        if op.extra_input is not None:
            shapes[extra_input_name(op)] = (f"[rows, {op.in_features}]", "x's dtype")
    for stage in plan.backward:
        shapes.update(stage.rule.stage.saved_shapes(em, stage))
    for *_, shape, init, name in params:
        shapes[name] = (str(list(shape)), "the parameter's dtype (its values, not a copy)")
    return [(name, *shapes.get(name, ("", ""))) for name in saved]


def traffic_cells(plan: Plan) -> dict[tuple[str, int], str]:
    """The plan's "bytes/token" cell per stage, keyed like ``runs_as``: what the stage's kernel
    calls and GEMMs read and write per token of the module's input (StageImpl.row_traffic) at 2
    bytes a value (bf16, fp16; fp32 activations double it), fp32 statistics 4; "—" where the plan
    cannot know. A Reshape before a stage changes its rows per token (``rows_factor``)."""
    factors, factor = {}, Fraction(1)  # rows per token at each value position (None: unknown)
    for stage in plan.forward:
        factors.update(dict.fromkeys(range(stage.start, stage.end), factor))
        change = stage.rule.stage.rows_factor(stage)
        factor = None if factor is None or change is None else factor * change
    cells = {}
    for pass_, stages in (("forward", plan.forward), ("backward", plan.backward), ("inference", plan.inference)):
        for stage in stages:
            traffic = stage.rule.stage.row_traffic(plan, pass_, stage)
            if traffic is None or factors[stage.start] is None:
                cells[(pass_, stage.start)] = "—"
                continue
            per_token = traffic.bytes() * factors[stage.start]
            cells[(pass_, stage.start)] = f"{int(per_token):,}" if per_token.denominator == 1 else f"{float(per_token):,.1f}"
    return cells


def diagrams(plan: Plan, cells: dict, extra_inputs: list[str], extra_outputs: list[str]) -> dict[str, str]:
    """The plan's Mermaid flowcharts: forward in the order it runs, backward likewise (last stage first)."""
    return {"forward": flowchart("f", list(enumerate(plan.forward)), cells, "forward", extra_inputs, extra_outputs),
            "backward": flowchart("b", list(reversed(list(enumerate(plan.backward)))), cells, "backward",
                                  extra_inputs, extra_outputs)}
