"""What a generated module holds and calls around its stages: its ops' holders, its inputs as
rows and its results in the caller's shape, the guard against second derivatives (part of a
fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).
"""

import functools

import torch

from .training_graphs import saved_tensors


class SpecOp(torch.nn.Module):
    """One op of the spec's Sequential, holding its parameters under the Sequential's index (so
    state_dict keys match the eager module's); its repr is the op as the spec writes it."""

    def __init__(self, call):
        super().__init__()
        self.call = call  # "Linear(4096, 28672)"

    def _get_name(self):
        return self.call[:self.call.index("(")]

    def extra_repr(self):
        return self.call[self.call.index("(") + 1:-1]


class TeModuleOp(SpecOp):
    """A TE module of the spec (``te.LayerNormMLP(...)``): besides its parameters under TE's names,
    TE's checkpoints hold an ``_extra_state`` entry per module (its FP8 scaling state; an empty
    uint8 tensor where FP8 never ran: TransformerEngineBaseModule.get_extra_state), which this
    child saves and loads the same way, so a TE state_dict loads with strict=True."""

    def get_extra_state(self):
        fp8 = self.__dict__.get("fp8")  # its GEMMs' FP8 state (fp8.Fp8State) where built for FP8
        return torch.empty(0, dtype=torch.uint8) if fp8 is None else fp8.extra_state(module=True)

    def set_extra_state(self, state):
        fp8 = self.__dict__.get("fp8")
        if fp8 is not None:
            fp8.load_extra_state(state, self.call)
            return
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise RuntimeError(
            f"{self.call}: the checkpoint's _extra_state holds TE's FP8 scaling state (saved after training under "
            "FP8), which this module does not hold (its pipeline is not built for FP8: "
            "[tool.fusegen] fp8); build it "
            "for FP8, or leave the '_extra_state' entries out and load with strict=False (the "
            "parameters are all "
            "there)")


def as_rows(tensor, features):
    """``tensor`` as a dense [rows, features] tensor: the tensor itself when it is one already
    (no new view object: at a few rows each op's dispatch is a measurable part of a call)."""
    if tensor.dim() == 2 and tensor.is_contiguous():
        return tensor
    return tensor.reshape(-1, features).contiguous()


def with_shape(tensor, shape):
    """A module's [rows, n] result in ``shape``, x's (an elementwise pipeline's results have its
    shape, 0-D included): as it is when it has it already."""
    return tensor if tensor.shape == shape else tensor.reshape(shape)


def with_lead(tensor, lead, features):
    """A module's [rows, features] result in the caller's leading dims ``lead``: as it is for a
    2-D call (then not a view either, so hooks on views, FSDP's among them, have nothing to warn
    of)."""
    return tensor if len(lead) == 1 else tensor.reshape(*lead, features)


class _SecondDerivative(torch.autograd.Function):
    """Hands first-order grads through unchanged; differentiating them again raises."""

    @staticmethod
    def forward(ctx, module, count, *tensors):
        ctx.module = module
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.module}: second derivatives (double backward, gradgradcheck) are "
                           "not supported: its backward is fused and not itself differentiable")


def first_order_only(module):
    """Decorates a generated backward so that a second derivative raises instead of being wrong.

    Like torch's once_differentiable the backward runs without building a graph; unlike it, the
    guard node also hangs off the saved tensors, so it is reached (and raises) even when
    torch.autograd.grad differentiates with respect to an input whose only path is through them."""

    def decorate(backward):
        @functools.wraps(backward)
        def guarded(ctx, *grad_outputs):
            if not torch.is_grad_enabled():  # the usual case, no create_graph: nothing to guard
                return backward(ctx, *grad_outputs)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            anchors = [
                t for t in (*grad_outputs, *saved_tensors(ctx)) if t is not None and t.requires_grad
            ]
            # nothing the grads depend on is differentiable: their derivative is zero
            if not anchors:
                return grads
            grads = grads if isinstance(grads, tuple) else (grads,)
            present = [g for g in grads if g is not None]
            passed = iter(_SecondDerivative.apply(module, len(present), *present, *anchors))
            return tuple(None if g is None else next(passed) for g in grads)

        return guarded

    return decorate
