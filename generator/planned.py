"""The plan model: what the planner produces and the stage implementations read (``Stage``,
``Plan``) and what a backward stage declares it needs kept (``Saves``, ``Recompute``).

A module of its own so that ``stages/`` can import it without importing the planner (plan.py),
which imports ``stages/``: the module graph of generator/ stays acyclic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .pipeline import Op, Pipeline


@dataclass(frozen=True)
class Recompute:
    """How an elementwise backward stage gets the forward values it needs."""

    saved_position: int  # the saved forward value the kernel starts from
    last: int  # the last op whose input is needed: ops [saved_position, last) are applied again
    # the op just before saved_position whose input the saved value (its output) stands for, where
    # nothing before it was materialised (OpDef.backward_from_output: a ReLU in a GEMM's epilogue)
    output_for: int | None = None


@dataclass(frozen=True)
class Saves:
    """What one backward stage needs kept from the forward pass."""

    values: frozenset[int] = frozenset()  # forward value positions
    extra_inputs: frozenset[int] = frozenset()  # extra-input indices
    recompute: Recompute | None = None  # an elementwise run that recomputes forward values


@dataclass(frozen=True)
class Stage:
    rule: Any  # the plan.Rule that made it: its name, and its stage implementation (rule.stage)
    ops: tuple[Op, ...]
    kind: str  # the implementation's name, or passthrough (no kernel: values or grads pass as is)

    @property
    def start(self) -> int:
        return self.ops[0].index

    @property
    def end(self) -> int:
        return self.ops[-1].index + 1

    def first(self, kind: str) -> Op | None:
        return next((op for op in self.ops if op.kind == kind), None)


@dataclass(frozen=True)
class Plan:
    pipeline: Pipeline
    forward: tuple[Stage, ...]
    backward: tuple[Stage, ...]  # in forward order; the generated backward runs it reversed
    recompute: dict[int, Recompute] = field(default_factory=dict)  # backward stage start -> recompute
    saved_values: tuple[int, ...] = ()  # positions saved for backward
    saved_extra_inputs: tuple[int, ...] = ()  # extra-input indices saved for backward
    inference: tuple[Stage, ...] = ()  # the no-grad forward: every forward rule, inference_only ones too
