"""The blocks of a pipeline's generated forward, backward and no-grad forward: each stage's
implementation lowers it into calls (stages/), rendered with the names values have where they run
(``Emitter.name``); what the forward saves, from what the backward's calls read; each returned grad
in memory of its own."""

from __future__ import annotations

from ..calls import Alias
from ..plan import Plan
from ..stages import Block, Emitter
from ..stages.base import stage_label


def forward_blocks(em: Emitter, stages=None, label: str = "forward") -> list[Block]:
    """Blocks of the forward (``stages``: the plan's forward, or its no-grad forward)."""
    blocks = []
    for n, stage in enumerate(em.plan.forward if stages is None else stages):
        block = Block(f"{label} stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""), name=em.name)
        em.names[stage.output] = stage.rule.stage.forward(em, stage, block)
        blocks.append(block)
    return blocks


def backward_blocks(em: Emitter) -> tuple[list[Block], dict[int, int]]:
    """Blocks of the backward (last stage first) and, for each value a stage reads (0: the
    pipeline input), the grad value that holds its grad (its own, or one handed on to it)."""
    p = em.pipeline
    grads: dict[int, int] = {p.output: em.grad(p.output)}
    blocks = []
    for n, stage in reversed(list(enumerate(em.plan.backward))):
        block = Block(f"backward stage {n} · rule {stage.rule.name} · {stage_label(stage)}"
                      + (" · no kernel" if stage.kind == "passthrough" else ""), name=em.name)
        d_in = em.grad(stage.input)
        grads[stage.input] = stage.rule.stage.backward(em, stage, block, grads[stage.output], d_in)
        blocks.append(block)
    return blocks, grads


def own_memory(em: Emitter, returned: list[int]) -> Block | None:
    """Gives each returned grad that shares memory with one returned before it (an addend's grad
    is the sum's: one tensor for two inputs, or a view of it) a copy: its alias line becomes a
    clone, or a last backward block (returned, else None) copies it. Autograd may keep a returned
    grad as a leaf's ``.grad`` and accumulate the next one into it in place: two leaves with one
    memory would each get the other's grads too. ``returned``: grad values."""
    block = Block("each returned grad its own memory (a leaf's .grad accumulates in place)", name=em.name)
    owners: dict[int, int] = {}
    for grad in dict.fromkeys(returned):
        memory = em.memory_of(grad)
        if memory not in owners:
            owners[memory] = grad
        elif grad in em.grad_aliases:
            alias_block, index, of, why = em.grad_aliases[grad]
            reason = f"{why}, in memory of its own" if why else "in memory of its own (.grad accumulates in place)"
            alias_block.calls[index] = Alias(grad, of, reason, clone=True)
        else:
            block.add(Alias(grad, grad, f"a copy, not {em.name(owners[memory])}'s memory", clone=True))
    return block if block.calls else None


def no_grad_blocks(plan: Plan, stage_kernels: dict) -> list[Block]:
    """Blocks of the no-grad forward: its stages, writing nothing for a backward."""
    kernels = {("forward", start): specs for (pass_, start), specs in stage_kernels.items() if pass_ == "inference"}
    return forward_blocks(Emitter(plan, kernels, saving=False), plan.inference, "no-grad")


def reads_of(blocks: list[Block]) -> list[int]:
    """The values ``blocks``' calls read, in order, each once."""
    return list(dict.fromkeys(value for block in blocks for value in block.reads()))


def writes_of(blocks: list[Block]) -> list[int]:
    """The values ``blocks``' calls write, in order, each once."""
    return list(dict.fromkeys(value for block in blocks for call in block.calls for value in call.writes.values()))


def made_before_read(blocks: list[Block]) -> set[int]:
    """The values ``blocks``' calls write before any of them reads it (made where they run)."""
    made, read = set(), set()
    for block in blocks:
        for call in block.calls + [call for _, call in block.weight_grad_calls]:
            read.update(v for v in call.reads.values() if v not in made)
            made.update(v for v in call.writes.values() if v not in read)
    return made


def saved_for_backward(plan: Plan, em: Emitter, bwd: list[Block]) -> list[int]:
    """What the forward keeps for the backward: the forward values the backward's calls read, in
    ctx.save_for_backward's order: running values in chain order, the stages' own results (a
    norm's statistics, a random op's key) as the backward stages read them in forward order,
    extra inputs, parameters (their values, not copies)."""
    p = plan.pipeline
    # backward_blocks runs the last stage first; the grads the calls read are the backward's own,
    # and so are the values a backward stage makes before it reads them (views it takes again)
    made = made_before_read(list(reversed(bwd)))
    reads = [value for value in reads_of(list(reversed(bwd))) if not em.is_grad(value) and value not in made]
    running = {0, *(op.output for op in p.ops), *p.residual_values}
    free = set(p.extra_input_values) | {value for op in p.ops for _, value in op.param_ids}
    values = sorted((v for v in reads if v in running), key=p.chain_order)
    extra = [v for v in p.extra_input_values if v in reads]
    # the planner decided what the forward materialises for these (Saves): the calls must agree
    # (the FP8 emission may read fewer: its weight grads read the FP8 operands its forward made)
    agree = set.issubset if em.fp8 is not None else set.__eq__
    assert agree(set(values), set(plan.saved_values)) and agree(set(extra), set(plan.saved_extra_inputs)), \
        (f"{p.name}: the backward reads {values} + {extra}, the plan saves {plan.saved_values} + "
         f"{plan.saved_extra_inputs}")
    own = [v for v in reads if v not in running and v not in free and v != p.input_width]
    params = [value for op in p.ops for _, value in op.param_ids if value in reads]
    # two values one tensor holds (a stage that hands its input on: MakeExtraOutput's output is
    # its input) are saved once, as the backward names them once
    tensors = {}
    for value in values + own + extra + params:
        tensors.setdefault(em.name(value), value)
    return list(tensors.values())


def distinct_returns(names: list[str], aliases: dict[str, str], inputs: list[str] = ()) -> list[str]:
    """The Function's outputs, a tensor returned twice (an extra output that is the output itself)
    the second time as a view of it: torch.compile cannot trace one tensor as two outputs; one of
    its ``inputs`` returned (a Residual's input handed to a later Function) as a view of it too."""
    seen: set[str] = {aliases.get(name, name) for name in inputs}
    out = []
    for name in names:
        tensor = aliases.get(name, name)
        out.append(f"{name}.view_as({name})" if tensor in seen else name)
        seen.add(tensor)
    return out
