"""A pipeline that runs user modules, under autograd: its fused stages as autograd Functions of
their own around the modules (stages/module.py), each taking, saving and returning what its calls
read and write."""

from __future__ import annotations

from ..calls import TorchCall, literal
from ..plan import Plan
from ..stages import Block, Emitter
from ..stages.base import extra_output_name
from . import convention
from .blocks import distinct_returns, own_memory, reads_of, writes_of
from .function import function_parts


def segments(plan: Plan, em: Emitter, fwd: list[Block], bwd: list[Block], grads: dict[int, int], saved: list[int],
             tees: list, inputs: list[int], kind: str = "") -> tuple[list[dict], list[Block]]:
    """A pipeline that runs user modules, under autograd: its fused stages between them as autograd
    Functions of their own (one a run of stages), the modules between them in ``grad_forward``,
    so autograd records each module as eager PyTorch does (stages/module.py). Returns each
    Function's parts (``inputs``: its arguments, of the names the pipeline's forward has, with
    ``n`` for the input width a size-generic backward reshapes with) and grad_forward's steps.
    ``kind``: what the Functions' names and their stages' carry ("Fp8": the FP8 emission's)."""
    p = plan.pipeline
    backward_of = list(zip(reversed(plan.backward), bwd))  # backward_blocks runs the last stage first
    steps, after_pair = [], set()  # after_pair: the runs whose input a collective makes, by run number
    for stage, block in zip(plan.forward, fwd):
        if stage.rule.stage.between_functions:
            steps.append(block)
            following = sum(isinstance(step, list) for step in steps)  # the number of the run after it
            if stage.rule.stage.starts_pair_early:
                after_pair.add(following)
            else:  # (a user module's output: the run after it reads no collective's)
                after_pair.discard(following)
        elif steps and isinstance(steps[-1], list):
            steps[-1].append((stage, block))
        else:
            steps.append([(stage, block)])
    functions = []
    runs = [[block for _, block in run] for run in steps if isinstance(run, list)]
    for k, run in enumerate(step for step in steps if isinstance(step, list)):
        start, end = run[0][0].start, run[-1][0].end  # the run's ops
        blocks = runs[k]
        backward = [block for stage, block in backward_of if start <= stage.start < end]
        first, last = run[0][0], run[-1][0]
        # values one Function makes and a later one reads (a Residual's input, kept for its add
        # across a collective): an output of the first and an input of the second, their grads
        # flowing back the same way
        later, earlier = set(reads_of(sum(runs[k + 1:], []))), set(writes_of(sum(runs[:k], [])))
        sent = [v for v in writes_of(blocks) if v != last.output and v in later]
        received = [v for v in reads_of(blocks) if v != first.input and v in earlier]
        outputs = ([em.name(last.output)] + [extra_output_name(op) for op in tees if start <= op.index < end]
                   + [em.name(v) for v in sent])
        forward_reads = reads_of(blocks)
        taken = [value for value in inputs[1:] if value in forward_reads] + received  # the free values, the made ones
        args = [em.name(first.input)] + [em.name(value) for value in taken]
        grad_inputs = [grads[first.input]] + [em.grad(v) if em.table[v].role in convention.TENSOR_ROLES
                                              else None for v in taken]
        copies = own_memory(em, [g for g in grad_inputs if g is not None])
        backward += [copies] if copies else []
        backward_reads = reads_of(backward)
        takes_n = p.input_width is not None and p.input_width in backward_reads
        span = f"ops {first.ops[0].number} to {last.ops[-1].number}"
        functions.append(dict(function_parts(
            em, f"{p.class_name}{kind}Function{k}", f"{span} of `{p.name}`" + (" (FP8 GEMMs)" if kind else ""),
            f"grad_forward{'_' + kind.lower() if kind else ''} runs the user modules and collectives between such "
            "Functions (``graph``: None).", f"{'_' + kind.lower() if kind else ''}{k}",
            args + (["n"] if takes_n else []), blocks, distinct_returns(outputs, em.aliases, args),
            [em.name(v) for v in saved if v in backward_reads],
            [em.grad(last.output)] + [em.grad(op.extra_out) for op in tees if start <= op.index < end]
            + [em.grad(v) for v in sent], backward,
            grad_inputs + ([None] if takes_n else []), "args[-1]" if takes_n else None, early=k in after_pair),
            span=span, outputs=outputs))
    calls = iter(functions)
    return functions, [step if isinstance(step, Block) else _call_block(next(calls)) for step in steps]


def _call_block(function: dict) -> Block:
    """grad_forward's step that applies one of the Functions of ``segments``."""
    outputs = function["outputs"]
    args = ["None"] + ["x.shape[1]" if name == "n" else name for name in function["inputs"]]  # no CUDA graphs
    block = Block(f"{function['span']}, fused")
    block.add(TorchCall(literal(f"{', '.join(outputs)} = {function['name']}.apply({', '.join(args)})")))
    return block
