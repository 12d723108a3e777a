"""torch.compile's training ops of a graph-replaying pipeline (the runtime's compiled_passes.py):
its forward under autograd and its backward as two custom ops, ``fusegen::<pipeline>_forward_<d>``
and ``fusegen::<pipeline>_backward_<d>``, joined by ``torch.library.register_autograd``.

An op's outputs are tensors of its own, never its arguments: so the forward op returns the
Function's outputs, then only the saved tensors neither its arguments nor its outputs hold (the
activations, statistics and keys it makes), and autograd's setup keeps the rest from the op's
arguments and outputs. The backward op takes what ``backward_stages`` takes and returns what it
returns, flat: the grads but the weight grads, then what the weight-grad GEMMs read; the GEMMs run
in the autograd formula, each only where its parameter needs a grad. ``d``: a digest of both
passes' text, so a changed pass gets new ops and packages holding the same pass share them.
"""

from __future__ import annotations

import hashlib

from ..values import Role
from . import convention


def _schema_returns(types: list[str]) -> str:
    return types[0] if len(types) == 1 else "(" + ", ".join(types) + ")"


def training_ops(name: str, args: list[convention.Argument], f: dict) -> dict:
    """The template context of the compiled ops of ``f`` (function.function_parts' dict, the
    pipeline's one Function) over the pipeline's arguments ``args``."""
    inputs = [arg.name for arg in args]
    outputs = [returned.split(".view_as(")[0] for returned in f["returns"]]
    # the saved tensors the forward op makes: neither an argument nor an output (each once)
    made = [s for s in dict.fromkeys(f["saved"]) if s not in inputs and s not in outputs]
    host = {f["saved"][i] for i in f["host"]}
    # parameters read where they are; one made anew each call (convention's compiled_per_call) is copied in
    parameters = {arg.name for arg in args if arg.role is Role.PARAMETER}
    fresh = {arg.name for arg in args if arg.compiled_per_call}
    forward_schema = (f"({convention.schema_arguments(args)}) -> "
                      + _schema_returns(["Tensor"] * len(outputs) + ["Tensor?"] * len(made)))
    grads = f["grad_outputs"]

    def saved_type(saved: str) -> str:
        return "int" if saved in host else "Tensor" if saved in parameters else "Tensor?"

    backward_arguments = ([f"Tensor {g}" for g in grads] + [f"{saved_type(s)} {s}" for s in f["saved"]]
                          + (["SymInt n"] if f["width"] is not None else []))
    backward_returns = f["stage_grads"] + f["weight_grad_operands"]
    backward_schema = f"({', '.join(backward_arguments)}) -> " + _schema_returns(["Tensor"] * len(backward_returns))
    text = "\n".join([forward_schema, backward_schema,
                      *(line for block in f["forward"] + f["backward"] for line in block.lines)])
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    # each call's own tensors, copied into a replayed graph's buffers (the rest: parameters, read
    # where they are, and flags and host ints, which pick the graph)
    forward_per_call = [i for i, arg in enumerate(args)
                        if arg.role in convention.CALLER_ROLES or arg.typed == "Tensor" or arg.name in fresh]
    backward_per_call = list(range(len(grads))) + [len(grads) + i for i, s in enumerate(f["saved"])
                                                   if saved_type(s) == "Tensor?" or s in fresh]
    return dict(
        forward=f"{name}_forward_{digest}", forward_schema=forward_schema, forward_per_call=tuple(forward_per_call),
        backward=f"{name}_backward_{digest}", backward_schema=backward_schema,
        backward_per_call=tuple(backward_per_call),
        inputs=inputs, outputs=outputs, made=made, op_outputs=outputs + made, backward_returns=backward_returns,
        backward_arguments=grads + f["saved"] + (["ctx.n"] if f["width"] is not None else []),
        # each weight grad, and its parameter's position among the op's inputs (ctx.needs_input_grad)
        needs=[(name, expression, f["grad_inputs"].index(name))
               for block in f["weight_grad_blocks"] for name, expression in block.weight_grads],
    )
