"""The one shape of a generated autograd.Function, for a whole pipeline and for each run of fused
stages around user modules (segments.py) alike.

Its forward and backward are functions of their own, ``forward_stages`` (the outputs, then what
the backward reads) and ``backward_stages`` (the grads but the weight grads, then what the
weight-grad GEMMs read), which the Function runs through the runtime's ``replay_forward`` and
``replay_backward``: from a CUDA graph where the module hands one in (a graph-replaying pipeline
at a few rows), as they are otherwise (``graph`` None). The weight-grad GEMMs run in the
Function's backward, after the stages, each only where its parameter needs a grad.
"""

from __future__ import annotations

from ..stages import Block


def function_parts(name: str, title: str, doc: str, suffix: str, inputs: list[str], forward: list[Block],
                   returns: list[str], saved: list[str], grad_outputs: list[str], backward: list[Block],
                   grad_inputs: list[str], width: str | None) -> dict:
    """What pipeline.py.j2's ``function`` macro renders. ``inputs``: the Function's arguments
    (after ``graph``); ``grad_inputs``: the grad it returns for each; ``width``: where the
    Function finds the input width its backward reshapes with (None: it has none to find)."""
    weight_grads = {grad for block in backward for grad, _ in block.weight_grads}
    return dict(
        name=name, title=title, doc=doc, forward_stages=f"forward_stages{suffix}",
        backward_stages=f"backward_stages{suffix}", inputs=inputs, forward=forward, returns=returns, saved=saved,
        grad_outputs=grad_outputs, backward=backward, grad_inputs=grad_inputs, width=width,
        # what backward_stages returns: the grads but the weight grads, then what the weight-grad
        # GEMMs after it read; and what it takes (the input width last, where it reshapes)
        stage_grads=[grad for grad in grad_inputs if grad != "None" and grad not in weight_grads],
        weight_grad_operands=list(dict.fromkeys(read for block in backward for read in block.weight_grad_reads
                                                if read not in grad_outputs)),
        backward_stages_inputs=grad_outputs + saved + (["n"] if width is not None else []),
        weight_grad_blocks=[block for block in backward if block.weight_grads],
    )
