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

    saved: int  # the saved forward value the kernel starts from
    replay_from: int  # the op that reads it: ops [replay_from, last) are applied again
    last: int  # the last op whose input is needed
    # the op just before replay_from whose input the saved value (its output) stands for, where
    # nothing before it was materialised (OpDef.backward_from_output: a ReLU in a GEMM's epilogue)
    output_for: int | None = None


@dataclass(frozen=True)
class Saves:
    """What one backward stage needs kept from the forward pass."""

    values: frozenset[int] = frozenset()  # forward values (running values, by id)
    extra_inputs: frozenset[int] = frozenset()  # extra inputs' values
    recompute: Recompute | None = None  # an elementwise run that recomputes forward values


@dataclass(frozen=True)
class Stage:
    rule: Any  # the plan.Rule that made it: its name, and its stage implementation (rule.stage)
    ops: tuple[Op, ...]
    kind: str  # the implementation's name, or passthrough (no kernel: values or grads pass as is)

    @property
    def start(self) -> int:
        """The position of its first op: where the stage comes in its pass, and its key."""
        return self.ops[0].index

    @property
    def end(self) -> int:
        """One past the position of its last op."""
        return self.ops[-1].index + 1

    @property
    def input(self) -> int:
        """The running value it reads."""
        return self.ops[0].input

    @property
    def output(self) -> int:
        """The running value it writes."""
        return self.ops[-1].output

    def first(self, kind: str) -> Op | None:
        return next((op for op in self.ops if op.kind == kind), None)


@dataclass(frozen=True)
class Plan:
    pipeline: Pipeline
    forward: tuple[Stage, ...]
    backward: tuple[Stage, ...]  # in forward order; the generated backward runs it reversed
    recompute: dict[int, Recompute] = field(default_factory=dict)  # backward stage start -> recompute
    saved_values: tuple[int, ...] = ()  # running values saved for backward, in chain order
    saved_extra_inputs: tuple[int, ...] = ()  # extra inputs' values saved for backward
    inference: tuple[Stage, ...] = ()  # the no-grad forward: every forward rule, inference_only ones too
