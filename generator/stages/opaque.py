"""Opaque stages: one op that fusegen does not fuse, run as its reference math in PyTorch.

An op registered with ``opaque=True`` (a plugin's module fusegen has no kernel for) is a node like
any other; its stage calls the op's shipped reference forward ``f(x, *params, *constants)`` and
backward ``f_bwd(x, dy, *params, *constants) -> (dx, *dparams)`` from ``_reference.py``, in fp32
(float64 for float64) with one rounding to the storage dtype, on CPU and GPU alike. The stage saves
its input for the backward.
"""

from __future__ import annotations

from .base import Saves, StageImpl, param_name


def _arguments(op) -> list[str]:
    params = [f"ref.compute({param_name(op, p.name)})" for p in op.opdef.params]
    return params + [repr(c) for c in op.opdef.reference_arguments(op.args)]


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
        x_in, out = em.name(stage.input), em.table[stage.output].name
        args = ", ".join([f"ref.compute({x_in})", *_arguments(op)])
        block.lines.append(f"{out} = ref.{op.opdef.reference_names[0]}({args}).to({x_in}.dtype)")
        return out

    def backward(self, em, stage, block, dy, d_in):
        op = stage.ops[0]
        x_in = em.name(stage.input)
        grads = [d_in] + [f"d_{param_name(op, p.name)}" for p in op.opdef.params]
        args = ", ".join([f"ref.compute({x_in})", f"ref.compute({dy})", *_arguments(op)])
        unpack = ", ".join(grads) + ("," if len(grads) == 1 else "")  # the backward returns (dx, *dparams)
        block.lines.append(f"{unpack} = ref.{op.opdef.reference_names[1]}({args})")
        block.lines.append(f"{', '.join(grads)} = {', '.join(f'{g}.to({dy}.dtype)' for g in grads)}")
        em.shares_memory(d_in, dy)  # a reference backward may hand dy itself on (an identity's)
        return d_in


OPAQUE = OpaqueStage()
