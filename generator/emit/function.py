"""The one shape of a generated autograd.Function, for a whole pipeline and for each run of fused
stages around user modules (segments.py) alike.

Its forward and backward are functions of their own, ``forward_stages`` (the outputs, then what
the backward reads) and ``backward_stages`` (the grads but the weight grads, then what the
weight-grad GEMMs read), which the Function runs through the runtime's ``replay_forward`` and
``replay_backward``: from a CUDA graph where the module hands one in (a graph-replaying pipeline
at a few rows), as they are otherwise (``graph`` None). The weight-grad GEMMs run in the
Function's backward, after the stages, each only where its parameter needs a grad.

A parameter TE holds as row blocks (emit/held.py) is one argument of the stages, joined by the
module without autograd, and its blocks are the Function's inputs after those arguments: its
backward hands each block its rows of the parameter's grad, which the weight-grad GEMM adds into
the blocks' grads in place where it can (the shipped reference's weight_grad, by
``ctx.row_blocks``).
"""

from __future__ import annotations

from ..stages import Block, Emitter
from ..values import HOST_DTYPES


def function_parts(em: Emitter, name: str, title: str, doc: str, suffix: str, inputs: list[str],
                   forward: list[Block], returns: list[str], saved: list[str], grad_outputs: list[int],
                   backward: list[Block], grad_inputs: list[int | None], width: str | None,
                   row_blocks: tuple[tuple[int, tuple[int, ...]], ...] = (), early: bool = False) -> dict:
    """What pipeline.py.j2's ``function`` macro renders. ``inputs``: the stages' arguments
    (after ``graph``); ``grad_outputs``: the grad values its backward takes, one per output;
    ``grad_inputs``: the grad value it returns for each input (None: no grad); ``width``: where
    the Function finds the input width its backward reshapes with (None: it has none to find);
    ``row_blocks``: (grad value, each block's rows) of each parameter taken as TE's row blocks
    after ``inputs``, in order; ``early``: its first input is a collective's output, whose backward
    pair the Function starts before its weight-grad GEMMs, to run behind them. The grads are
    values until here, where they take their names (``em.name``)."""
    weight_grads = {grad for block in backward for grad, _ in block.weight_grad_calls}
    # what backward_stages returns: the grads but the weight grads, then the grads the weight-grad
    # GEMMs after it read that it computes (not those it takes)
    stage_grads = [grad for grad in grad_inputs if grad is not None and grad not in weight_grads]
    operands = dict.fromkeys(read for block in backward for _, call in block.weight_grad_calls
                             for read in call.reads.values() if em.is_grad(read) and read not in grad_outputs)
    grad_output_names = [em.name(grad) for grad in grad_outputs]
    # the saved values that are no tensors (max_seqlen, an FP8 call): replay_forward keeps them on the ctx
    host_values = {value.name for value in em.table if value.dtype in HOST_DTYPES}
    grad_names = ["None" if grad is None else em.name(grad) for grad in grad_inputs]
    # whether the backward computes each grad: its input's needs_input_grad (after ``graph``), or
    # for a parameter taken as row blocks, any of its blocks'
    needs = {grad: f"ctx.needs_input_grad[{1 + i}]" for i, grad in enumerate(grad_names) if grad != "None"}
    first, taken, split = 1 + len(inputs), [], []
    # each block's AccumulateGrad node is in ctx.next_functions, which has the tensor inputs only
    # (not ``graph``, nor a host int): the blocks, the last inputs, are counted from its end
    end = first + sum(len(rows) for _, rows in row_blocks)
    for grad, rows in row_blocks:
        needs[em.name(grad)] = f"any(ctx.needs_input_grad[{first}:{first + len(rows)}])"
        taken.append(f"({first - end}, args[{first - 1}:{first - 1 + len(rows)}])")
        split.append(f"*split_rows({em.name(grad)}, {rows!r})")
        first += len(rows)
    joined = {em.name(grad) for grad, _ in row_blocks}
    return dict(
        name=name, title=title, doc=doc, forward_stages=f"forward_stages{suffix}",
        backward_stages=f"backward_stages{suffix}", inputs=inputs, forward=forward, returns=returns, saved=saved,
        grad_outputs=grad_output_names, backward=backward, width=width,
        grad_inputs=grad_names, needs=needs,
        # ctx.row_blocks: the blocks of each parameter taken as TE's row blocks (slices of ``args``),
        # each after its first's position among the Function's inputs, counted from the last
        row_blocks=taken,
        # what the backward returns: None for ``graph`` and for a parameter whose blocks take its grad
        backward_returns=["None"] + ["None" if grad in joined else grad for grad in grad_names] + split,
        stage_grads=[em.name(grad) for grad in stage_grads], weight_grad_operands=[em.name(grad) for grad in operands],
        # what backward_stages takes (the input width last, where it reshapes)
        backward_stages_inputs=grad_output_names + saved + (["n"] if width is not None else []),
        weight_grad_blocks=[block for block in backward if block.weight_grads],
        host=tuple(i for i, name in enumerate(saved) if name in host_values),
        # an FP8 Function's call (runtime Fp8Call), told when its backward is done
        fp8=em.name(em.fp8) if em.fp8 is not None else None,
        # the first input's grad, whose collective's backward pair the backward starts early
        early=grad_names[0] if early and grad_names[0] != "None" and weight_grads else None,
    )
