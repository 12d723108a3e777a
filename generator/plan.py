"""The fusion planner: a pipeline's ops → forward stages, backward stages, tensors saved between.

Forward and backward are planned separately (as in TE): each pass applies its ordered rule list
from ``fusion_rules`` once, every rule sliding greedily left to right over the ops no earlier rule
took. Every stage records the rule that made it. Then the saved tensors are resolved: each backward
stage names the forward values it needs; an elementwise backward stage that needs a value the
forward pass never materialised recomputes it from the nearest earlier one inside its own run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .errors import SpecError
from .pipeline import Op, Pipeline

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class Rule:
    """A fusion rule: ``match(ops)`` returns how many leading ops of ``ops`` it fuses (0: none)."""

    name: str
    pass_: str
    stage: str  # gemm | norm | elementwise
    doc: str
    match: Callable[[Sequence[Op]], int]


def pattern(*kinds: str) -> Callable[[Sequence[Op]], int]:
    """Matcher for a fixed chain of op kinds; a kind ending in '?' is optional."""

    def match(ops: Sequence[Op]) -> int:
        n = 0
        for kind in kinds:
            optional = kind.endswith("?")
            if n < len(ops) and ops[n].kind == kind.rstrip("?"):
                n += 1
            elif not optional:
                return 0
        return n

    return match


@dataclass(frozen=True)
class Stage:
    rule: Rule
    ops: tuple[Op, ...]
    kind: str  # gemm | norm | elementwise | passthrough (no kernel: values or grads pass as is)

    @property
    def start(self) -> int:
        return self.ops[0].index

    @property
    def end(self) -> int:
        return self.ops[-1].index + 1

    def first(self, kind: str) -> Op | None:
        return next((op for op in self.ops if op.kind == kind), None)


@dataclass(frozen=True)
class Recompute:
    """How an elementwise backward stage gets the forward values it needs."""

    saved_position: int  # the saved forward value the kernel starts from
    last: int  # the last op whose input is needed: ops [saved_position, last) are applied again


@dataclass(frozen=True)
class Plan:
    pipeline: Pipeline
    forward: tuple[Stage, ...]
    backward: tuple[Stage, ...]  # in forward order; the generated backward runs it reversed
    recompute: dict[int, Recompute] = field(default_factory=dict)  # backward stage start -> recompute
    saved_values: tuple[int, ...] = ()  # positions saved for backward
    saved_extra_inputs: tuple[int, ...] = ()  # extra-input indices saved for backward


def apply_rules(ops: Sequence[Op], rules: Sequence[Rule], pass_: str) -> tuple[Stage, ...]:
    items: list[Op | Stage] = list(ops)
    for rule in rules:
        i = 0
        while i < len(items):
            run = []
            for item in items[i:]:
                if not isinstance(item, Op):
                    break
                run.append(item)
            n = rule.match(run) if run else 0
            if n:
                covered = tuple(run[:n])
                items[i:i + n] = [Stage(rule, covered, _stage_kind(rule, covered))]
            i += 1
    left = [item for item in items if isinstance(item, Op)]
    if left:
        # The spec is fine; the rule set is missing a rule. Still a SpecError at the op, so the
        # user sees which op of their file it is and a fusegen developer sees what to add.
        op = left[0]
        raise SpecError(f"no {pass_} fusion rule covers {op.describe()} (op kind '{op.kind}'); the {pass_} rules "
                        "of fusion_rules/__init__.py need a rule for this op kind: add one, or leave the op out "
                        "of the pipeline", op.location)
    return tuple(items)  # type: ignore[arg-type]


def _stage_kind(rule: Rule, ops: tuple[Op, ...]) -> str:
    if rule.stage != "elementwise":
        return rule.stage
    if rule.pass_ == FORWARD:
        active = any(op.opdef.changes_value for op in ops)
    else:
        active = any(op.opdef.changes_grad or op.kind == "bias" for op in ops)
    return "elementwise" if active else "passthrough"


def materialized_values(forward: Sequence[Stage]) -> frozenset[int]:
    """Positions of forward values that exist as tensors after the forward pass."""
    values = set()
    for stage in forward:
        values.update((stage.start, stage.end))
        norm = stage.first("norm")
        if norm is not None:
            values.add(norm.index)  # the norm's (residual-summed) input is written and saved
    return frozenset(values)


def plan_pipeline(pipeline: Pipeline, forward_rules: Sequence[Rule], backward_rules: Sequence[Rule]) -> Plan:
    forward = apply_rules(pipeline.ops, forward_rules, FORWARD)
    backward = apply_rules(pipeline.ops, backward_rules, BACKWARD)
    have = materialized_values(forward)
    saved_values: set[int] = set()
    saved_extra: set[int] = set()
    recompute: dict[int, Recompute] = {}
    for stage in backward:
        if stage.kind == "gemm":
            saved_values.add(stage.first("linear").index)
        elif stage.kind == "norm":
            saved_values.add(stage.first("norm").index)
        elif stage.kind == "elementwise":
            needing = [op.index for op in stage.ops if op.opdef.needs_input_in_backward]
            if not needing:
                continue
            start = max(p for p in have if stage.start <= p <= needing[0])
            recompute[stage.start] = Recompute(start, needing[-1])
            saved_values.add(start)
            for op in pipeline.ops[start:needing[-1]]:
                if op.extra_input is not None:
                    saved_extra.add(op.extra_input)
    return Plan(pipeline, forward, backward, recompute, tuple(sorted(saved_values)), tuple(sorted(saved_extra)))

