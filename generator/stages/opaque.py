"""Opaque stages: one op that fusegen does not fuse, run as its reference math in PyTorch.

An op registered with ``opaque=True`` (a plugin's module fusegen has no kernel for) is a node like
any other; its stage calls the op's shipped reference forward ``f(x, *params, *constants)`` and
backward ``f_bwd(x, dy, *params, *constants) -> (dx, *dparams)`` from ``_reference.py``, in fp32
(float64 for float64) with one rounding to the storage dtype, on CPU and GPU alike. The stage saves
its input for the backward. An op that reads the packed sequences (``OpDef.reads_sequences``)
gets them after its parameters: ``f(x, *params, cu_seqlens, max_seqlen, *constants)``, and its
backward ``f_bwd(x, dy, *params, cu_seqlens, max_seqlen, *constants)``.
"""

from __future__ import annotations

from ..calls import TorchCall, literal
from .base import Saves, StageImpl


def _arguments(op) -> tuple[list[str], dict[str, int]]:
    """The reference function's arguments after x (and dy): its parameters, its constants; and
    the parameters' values."""
    params = {f"p{k}": op.param(p.name) for k, p in enumerate(op.opdef.params)}
    sequences = {"cu_seqlens": op.cu_seqlens, "max_seqlen": op.max_seqlen} if op.opdef.reads_sequences else {}
    return ([f"ref.compute({{{slot}}})" for slot in params] + [f"{{{slot}}}" for slot in sequences]
            + [literal(repr(c)) for c in op.opdef.reference_arguments(op.args)]), {**params, **sequences}


class OpaqueStage(StageImpl):
    name = "opaque"
    takes_any_op = True  # which ops: those registered opaque, checked per op

    def check(self, pass_, chain):
        return None if len(chain) == 1 else "an opaque stage runs one op"

    def saves(self, pipeline, stage, have):
        return Saves(values=frozenset({stage.input}))

    def runs_as(self, pass_, stage, kernels):
        return f"PyTorch: the op's reference {pass_} (`ref.{stage.ops[0].opdef.reference_names[pass_ == 'backward']}`)"

    def forward(self, em, stage, block):
        op = stage.ops[0]
        rest, params = _arguments(op)
        args = ", ".join(["ref.compute({x})", *rest])
        block.add(TorchCall(f"{{y}} = ref.{op.opdef.reference_names[0]}({args}).to({{x}}.dtype)",
                            dict(params, x=stage.input), dict(y=stage.output)))
        return em.table[stage.output].name

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        # dx, then each parameter's grad: what the reference backward returns
        grads = {f"g{k}": grad for k, grad in enumerate([d_in] + [em.grad(op.param(p.name)) for p in op.opdef.params])}
        rest, params = _arguments(op)
        args = ", ".join(["ref.compute({x})", "ref.compute({dy})", *rest])
        slots = ["{" + slot + "}" for slot in grads]
        unpack = ", ".join(slots) + ("," if len(slots) == 1 else "")  # the backward returns (dx, *dparams)
        block.add(TorchCall(f"{unpack} = ref.{op.opdef.reference_names[1]}({args})", dict(params, x=stage.input, dy=dy),
                            grads))
        # each to dy's dtype: the line reads the grads it writes, under slots of their own
        cast = {f"r{slot}": grad for slot, grad in grads.items()}
        block.add(TorchCall(f"{', '.join(slots)} = " + ", ".join(f"{{r{slot}}}.to({{dy}}.dtype)" for slot in grads),
                            dict(cast, dy=dy), grads))
        em.shares_memory(d_in, dy)  # a reference backward may hand dy itself on (an identity's)
        return d_in


OPAQUE = OpaqueStage()
