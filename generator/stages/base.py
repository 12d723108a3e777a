"""What every stage implementation shares: the interface a rule's stage implements, and the
emitter state the stages lower into: blocks of calls over values (calls.py), the names values have
where they run (values.py names them).

A ``StageImpl`` is how one family of stages runs (``gemm``, ``norm``, ``elementwise``). A rule
names the implementation it produces (fusion_rules/); the planner, the kernel list, the generated
forward and backward and the plan's "runs as" column all ask the stage's implementation, so no
module outside ``stages/`` (and ``ops/``) branches on what kind of stage or op it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Sequence

from ..kernels import sums_itself_up_to
from ..calls import Alias, Call
from ..kernels import KernelSpec
from ..names import ops_cited
from ..pipeline import Op, Pipeline
from ..planned import Plan, Recompute, Saves, Stage
from ..values import HOST_OBJECT, Role, ValueTable, extra_input_name, extra_output_name, grad_name, param_name

# the plan model's and the names' parts the stage modules take from here too
__all__ = ["NO_TRAFFIC", "Block", "Emitter", "Recompute", "RowTraffic", "Saves", "StageImpl", "extra_input_name",
           "extra_output_name", "fixed", "param_name", "stage_label"]


@dataclass(frozen=True)
class RowTraffic:
    """What a stage's kernel calls and GEMMs read and write per token (per row of x), as the plan
    reports it: values in the activations' dtype, and fp32 values (a norm's statistics).
    Parameters, parameter grads and per-call scratch (fp32 partials) are per call, not per token,
    and left out; so are views and aliases, which move nothing."""

    values: int
    fp32: int = 0

    def bytes(self, itemsize: int = 2) -> int:
        return self.values * itemsize + self.fp32 * 4


NO_TRAFFIC = RowTraffic(0)


def fixed(*sizes) -> bool:
    """Whether every size is a number (a size-generic pipeline's are Syms until it runs)."""
    return all(isinstance(size, int) for size in sizes)


class StageImpl:
    """The interface of a stage implementation; ``stages/*.py`` hold one each."""

    name = ""
    takes_any_op = False  # True: the stage judges each op itself (no op kinds to declare in a rule)
    launches = True  # the stage runs device work (kernels, GEMMs, PyTorch ops); False: views only
    replayable = True  # a CUDA graph can capture it (False: a user's module, which may do anything)
    # the dtypes (kernels.DTYPES names) of x a CUDA graph can capture it in; None: every dtype (a
    # stage whose math reads values on the host in some dtypes: the attention's reference math)
    replay_dtypes: tuple[str, ...] | None = None
    # runs as it is under autograd, between the autograd Functions of the fused stages (a user's
    # module: emit.segments), so autograd records its backward and the stage emits none
    between_functions = False
    # (with between_functions) the Function that reads its output may start its backward's
    # collective before its own weight-grad GEMMs, which it then runs behind (a collective)
    starts_pair_early = False

    def check(self, pass_: str, chain: Sequence[str]) -> str | None:
        """Why this implementation cannot run ``chain`` (op kinds in forward order) in ``pass_``,
        or None when it can. Rules call it when they are defined."""
        raise NotImplementedError

    def kind(self, pass_: str, ops: Sequence[Op]) -> str:
        """The stage's kind as plans report it: the implementation's name, or "passthrough" when
        the stage needs no kernel (its values or grads pass through as they are)."""
        return self.name

    def materialises(self, stage: Stage) -> set[int]:
        """Forward values that exist as tensors after this forward stage."""
        return {stage.input, stage.output}

    def saves(self, pipeline: Pipeline, stage: Stage, have: frozenset[int]) -> Saves:
        """What this backward stage reads from the forward pass (``have``: what it materialised)."""
        return Saves()

    def saved_shapes(self, em: Emitter, stage: Stage) -> dict[str, tuple[str, str]]:
        """{name: (shape, dtype)} of the forward results (beyond running values, extra inputs and
        parameters) this backward stage reads, as the plan shows them."""
        return {}

    def row_traffic(self, plan: Plan, pass_: str, stage: Stage) -> RowTraffic | None:
        """What the stage moves per token in ``pass_`` ("forward", "inference", "backward");
        None where the plan cannot know (PyTorch's own ops, a user's module, a size-generic
        pipeline's widths)."""
        return None

    def rows_factor(self, stage: Stage) -> Fraction | None:
        """Rows of the stage's output per row of its input (a Reshape's changes them); None when
        a size-generic width leaves it unknown."""
        return Fraction(1)

    def kernels(self, plan: Plan, stage: Stage, pass_: str) -> list[KernelSpec]:
        """The generated kernels the stage launches, its main kernel first."""
        return []

    def runs_as(self, pass_: str, stage: Stage, kernels: Sequence[KernelSpec]) -> str:
        """The plan's "runs as" cell."""
        if stage.kind == "passthrough":
            return "no kernel"
        # a backward that sums its parameter grads itself at a few rows launches the column sum only above
        few = sums_itself_up_to(kernels[0]) if kernels else None
        return " + ".join(f"(`{k.name}` above {few} rows)" if few is not None and k.kernel_family.sums_partials
                          else f"`{k.name}`" for k in kernels)

    def forward(self, em: Emitter, stage: Stage, block: Block) -> str:
        """Lower the stage's forward into calls over values (calls.py), added to ``block``;
        returns the name of the tensor that holds its output value."""
        raise NotImplementedError

    def backward(self, em: Emitter, stage: Stage, block: Block, dy: int, d_in: int) -> int:
        """Lower the stage's backward into calls over values, grads among them (``dy``: the grad
        value that holds its output's grad; ``d_in``: its input's, ``em.grad(stage.input)``);
        returns the grad value that holds its input's grad (``d_in``, or ``dy`` handed on)."""
        raise NotImplementedError


# --- text in generated code --------------------------------------------------------------------

def stage_label(stage: Stage) -> str:
    """The stage's ops as a comment cites them: "ops 1a, 1b: BasicLinear(1024, 4096), Bias(4096)"."""
    return f"{ops_cited(stage.ops)}: " + ", ".join(op.describe() for op in stage.ops)


def _no_values(value: int) -> str:
    raise AssertionError(f"a block with no names rendered a call over value {value}")


@dataclass
class Block:
    """One stage's calls in the generated forward or backward."""

    title: str
    calls: list[Call] = field(default_factory=list)
    # backward only: the GEMM weight grads, as (the grad's value, the call's expression), which
    # may run after every stage (a backward replayed from a CUDA graph runs them after its replay)
    weight_grad_calls: list[tuple[int, Call]] = field(default_factory=list)
    name: Callable[[int], str] = _no_values  # the names of values where the block runs (Emitter.name)

    def add(self, call: Call) -> None:
        self.calls.append(call)

    @property
    def lines(self) -> list[str]:
        return [call.render(self.name) for call in self.calls]

    @property
    def weight_grads(self) -> list[tuple[str, str]]:
        """(the grad's name, the call's expression) of each weight grad."""
        return [(self.name(grad), call.render(self.name)) for grad, call in self.weight_grad_calls]

    def reads(self) -> list[int]:
        """The values the block's calls read, in order (its weight grads' last), each once: forward
        values and, in the backward, grads."""
        calls = self.calls + [call for _, call in self.weight_grad_calls]
        return list(dict.fromkeys(value for call in calls for value in call.reads.values()))


@dataclass
class Emitter:
    """The state the stages of one pipeline write into, in order."""

    plan: Plan
    stage_kernels: dict  # (pass, stage start) -> [KernelSpec]
    # value id -> the name of the tensor that holds it, where that is not the value's own name
    # (a stage that changes nothing hands its input on: its output is that tensor)
    names: dict[int, str] = field(default_factory=dict)
    # op index -> the values its forward makes for its backward (a norm's statistics; attention's q, k, v, lse, ...)
    stats: dict[int, list[int]] = field(default_factory=dict)
    # False: the no-grad forward, which keeps nothing for a backward (no ctx)
    saving: bool = True
    # a size-generic pipeline's input width in the backward: backward_stages' argument (emit/function.py)
    width: str = "n"
    aliases: dict[str, str] = field(default_factory=dict)  # a forward name -> the tensor it names
    # a backward grad value -> the grad whose memory it names (itself, a second name, or a view)
    grad_memory: dict[int, int] = field(default_factory=dict)
    # a grad named by grad_alias -> (its block, its line there, the grad it names, why)
    grad_aliases: dict[int, tuple[Block, int, int, str]] = field(default_factory=dict)
    table: ValueTable | None = None  # the pipeline's values, and those the stages add (statistics, grads)
    # the FP8 emission (the pipeline's FP8 Function and no-grad forward): the value of the call's
    # runtime Fp8Call, which its GEMM stages call (None: high precision)
    fp8: int | None = None
    # the FP8 emission: a value an FP8 GEMM casts (forward: its x; backward: its output's grad) ->
    # (the amax value the kernel that writes it keeps its amax in, that kernel) (gemm.fp8_amax)
    fp8_amaxes: dict[int, tuple[int, str]] = field(default_factory=dict)
    # the values a kernel's FP8 variant writes in FP8 alone, and that kernel (gemm.fp8_producer)
    fp8_written: dict[int, str] = field(default_factory=dict)

    def alias(self, block: Block, value: int, of: int) -> None:
        """``value = of`` in the forward: one tensor under a second name (an extra output that is
        the value itself)."""
        block.add(Alias(value, of))
        name, of_name = self.name(value), self.name(of)
        self.aliases[name] = self.aliases.get(of_name, of_name)

    def grad(self, value: int) -> int:
        """The grad of ``value`` (a value id), named after the tensor that holds the value at the
        end of the forward: ``d_`` and ``self.name(value)``."""
        return self.table.grad(value, grad_name(self.name(value)))

    def grad_alias(self, block: Block, grad: int, of: int, why: str = "") -> None:
        """``grad = of`` in the backward (grad values): one grad handed to two inputs (an
        addend's). Where both are returned, emit.own_memory makes the call a copy."""
        self.grad_aliases[grad] = (block, len(block.calls), of, why)
        block.add(Alias(grad, of, why))
        self.shares_memory(grad, of)

    def shares_memory(self, grad: int, of: int) -> None:
        """Records that grad value ``grad`` is ``of`` or a view of it (emit.own_memory gives a
        returned grad that shares memory with another its own)."""
        self.grad_memory[grad] = self.memory_of(of)

    def memory_of(self, grad: int) -> int:
        """The grad value whose memory grad value ``grad`` uses."""
        return self.grad_memory.get(grad, grad)

    def is_grad(self, value: int) -> bool:
        """Whether ``value`` is a backward's grad (not a forward value the backward reads)."""
        return self.table[value].grad_of is not None

    def __post_init__(self):
        if self.table is None:
            self.table = ValueTable(self.plan.pipeline.values)
        if self.fp8 is not None:  # (True asks for it)
            self.fp8 = self.table.add(Role.OBJECT, HOST_OBJECT, "fp8")
        if self.plan.pipeline.input_width is not None:  # the backward's input width
            self.names.setdefault(self.plan.pipeline.input_width, self.width)

    def name(self, value: int) -> str:
        """The name of the tensor that holds ``value`` at this point of the generated code."""
        return self.names.get(value, self.table[value].name)

    @property
    def pipeline(self) -> Pipeline:
        return self.plan.pipeline

    def kernel(self, pass_: str, stage: Stage) -> KernelSpec:
        """The stage's main kernel."""
        return self.stage_kernels[(pass_, stage.start)][0]
