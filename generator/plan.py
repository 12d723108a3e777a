"""The fusion planner: a pipeline's ops → forward stages, backward stages, tensors saved between.

Forward and backward are planned separately (as in TE): each pass applies its ordered rule list
from ``fusion_rules`` once, every rule sliding greedily left to right over the ops no earlier rule
took. Every stage records the rule that made it. Then the saved tensors are resolved: each backward
stage names the forward values it needs; an elementwise backward stage that needs a value the
forward pass never materialised recomputes it from the nearest earlier one inside its own run.

A third list of stages is the no-grad forward: what the module runs when autograd is off
(``torch.no_grad``, ``torch.inference_mode``). It is planned with every forward rule, including
the ``inference_only`` ones, which may drop what a backward would need (a GELU in the GEMM's
epilogue loses the pre-activation its backward reads).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import SpecError
from .ops import OPS
from .pipeline import Op, Pipeline
from .planned import Plan, Recompute, Stage
from .stages import StageImpl

__all__ = ["BACKWARD", "FORWARD", "INFERENCE", "Plan", "Rule", "RuleError", "Stage", "apply_rules", "plan_pipeline"]

FORWARD, BACKWARD = "forward", "backward"
INFERENCE = "inference"  # what an inference_only rule's stage is checked for: a forward with no backward


class RuleError(ValueError):
    """A rule that cannot work as defined; raised when the rule is made, never at a spec."""


@dataclass(frozen=True)
class Rule:
    """A fusion rule: which ops fuse in one pass, and the stage implementation that runs them.

    Give ``pattern``, a chain of op kinds in forward order (a kind ending in '?' is optional), or
    a ``match`` function (``match(ops)`` returns how many leading ops it fuses, 0 for none) with
    ``covers``, the op kinds it may take. Either way the stage implementation is asked, here,
    whether it can run every chain the rule can produce, so a rule that could turn into wrong
    code fails when it is defined (``RuleError``) instead of at some spec."""

    name: str
    pass_: str
    stage: StageImpl
    doc: str
    pattern: tuple[str, ...] = ()
    match: Callable[[Sequence[Op]], int] | None = None
    covers: frozenset[str] = frozenset()
    min_ops: int = 1  # fewer matched ops is no match (a bare norm left to the plain norm rule)
    # a forward rule for the no-grad forward only: its stage need not keep what a backward reads
    inference_only: bool = False

    def __post_init__(self):
        where = f"fusion rule '{self.name}'"
        if self.pass_ not in (FORWARD, BACKWARD):
            raise RuleError(f"{where}: pass_ must be '{FORWARD}' or '{BACKWARD}', got {self.pass_!r}")
        if self.inference_only and self.pass_ != FORWARD:
            raise RuleError(f"{where}: inference_only is for forward rules (the no-grad forward has no backward)")
        if not isinstance(self.stage, StageImpl):
            raise RuleError(f"{where}: stage must be a stage implementation (fusegen.stages: GEMM, NORM, RESHAPE, MODULE, "
                            f"ELEMENTWISE, OPAQUE), got {self.stage!r}")
        if isinstance(self.pattern, str) or not all(isinstance(k, str) for k in self.pattern):
            raise RuleError(f"{where}: pattern must be a tuple of op kinds, e.g. (\"linear\",) or "
                            f"(\"scale\", \"add_extra_input\"); got {self.pattern!r}")
        if bool(self.pattern) == (self.match is not None):
            raise RuleError(f"{where}: give either a pattern of op kinds or a match function, not "
                            f"{'both' if self.pattern else 'neither'}")
        if self.match is not None and not self.covers and not self.stage.takes_any_op:
            raise RuleError(f"{where}: a match function needs covers=, the op kinds it may fuse, so the stage "
                            "can check it runs them")
        known = {op.kind for op in OPS.values()}
        for kind in [k.rstrip("?") for k in self.pattern] + sorted(self.covers):
            if kind not in known:
                hint = difflib.get_close_matches(kind, known, 1)
                raise RuleError(f"{where}: no registered op has kind {kind!r}"
                                + (f"; did you mean {hint[0]!r}?" if hint else f"; the kinds are {', '.join(sorted(known))}"))
        chains = _chains(self.pattern) if self.pattern else [(kind,) for kind in sorted(self.covers)]
        for chain in chains:
            if len(chain) < self.min_ops and self.pattern:
                continue
            why = self.stage.check(INFERENCE if self.inference_only else self.pass_, chain)
            if why is not None:
                raise RuleError(f"{where} cannot be implemented: it may fuse {' + '.join(chain)}, but {why}")

    def fuses(self, ops: Sequence[Op]) -> int:
        """How many leading ops of ``ops`` this rule fuses (0: none)."""
        n = self.match(ops) if self.match is not None else _match_pattern(self.pattern, ops)
        return n if n >= self.min_ops else 0


def _chains(pattern: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every concrete chain of op kinds a pattern with optional ('?') kinds matches."""
    chains: list[tuple[str, ...]] = [()]
    for kind in pattern:
        with_it = [chain + (kind.rstrip("?"),) for chain in chains]
        chains = with_it + chains if kind.endswith("?") else with_it
    return [chain for chain in chains if chain]


def _match_pattern(kinds: tuple[str, ...], ops: Sequence[Op]) -> int:
    n = 0
    for kind in kinds:
        optional = kind.endswith("?")
        if n < len(ops) and ops[n].kind == kind.rstrip("?"):
            n += 1
        elif not optional:
            return 0
    return n


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
            n = rule.fuses(run) if run else 0
            if n:
                covered = tuple(run[:n])
                items[i:i + n] = [Stage(rule, covered, rule.stage.kind(pass_, covered))]
            i += 1
    left = [item for item in items if isinstance(item, Op)]
    if left:
        # The spec is fine; the rule set is missing a rule. Still a SpecError at the op, so the
        # user sees which op of their file it is and a fusegen developer sees what to add.
        op = left[0]
        raise SpecError(f"no {pass_} fusion rule covers op {op.number}, {op.describe()} (op kind '{op.kind}'); the {pass_} rules "
                        "of fusion_rules/__init__.py need a rule for this op kind: add one, or leave the op out "
                        "of the pipeline", op.location)
    return tuple(items)  # type: ignore[arg-type]


def materialized_values(forward: Sequence[Stage]) -> frozenset[int]:
    """Forward values that exist as tensors after the forward pass."""
    values: set[int] = set()
    for stage in forward:
        values.update(stage.rule.stage.materialises(stage))
    return frozenset(values)


def plan_pipeline(pipeline: Pipeline, forward_rules: Sequence[Rule], backward_rules: Sequence[Rule]) -> Plan:
    forward = apply_rules(pipeline.ops, [rule for rule in forward_rules if not rule.inference_only], FORWARD)
    inference = apply_rules(pipeline.ops, forward_rules, FORWARD)
    backward = apply_rules(pipeline.ops, backward_rules, BACKWARD)
    have = materialized_values(forward)
    saved_values: set[int] = set()
    saved_extra: set[int] = set()
    recompute: dict[int, Recompute] = {}
    for stage in backward:
        saves = stage.rule.stage.saves(pipeline, stage, have)
        saved_values |= saves.values
        # a Residual's value is the pipeline's own (its tee wrote it): saved as a running value
        saved_values |= saves.extra_inputs & set(pipeline.residual_values)
        saved_extra |= saves.extra_inputs - set(pipeline.residual_values)
        if saves.recompute is not None:
            recompute[stage.start] = saves.recompute
    return Plan(pipeline, forward, backward, recompute, tuple(sorted(saved_values, key=pipeline.chain_order)),
                tuple(sorted(saved_extra)), inference)
