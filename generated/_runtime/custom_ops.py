"""torch.compile integration: the custom ops, ``fusegen::<name>``, that a compiled graph calls
for a launcher or a graph-replaying no-grad forward (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).
"""

import torch

_LIBRARY = []  # the torch.library fragment of fusegen's ops, made on the first registration


def register_op(name, schema, run, fake_source, tags=()):
    """Registers ``fusegen::<name>``, a custom op that torch.compile calls (a launcher, so the
    compiled graph holds one opaque node per kernel; a graph-replaying pipeline's no-grad forward,
    one node per pass). ``run`` is its implementation, its outputs made tensors of their own as an
    op's schema promises; its fake (shapes and dtypes, what tracing runs) is ``fake_source`` run on
    meta tensors. A name another package registered already is the same op (the name holds a
    digest of what it runs): that package's serves both (False; True: registered here). ``tags``:
    torch.Tag names (``nondeterministic_seeded``: a pass that draws random keys, which compiled
    activation checkpointing must not run again in the backward)."""
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("fusegen", "FRAGMENT"))
    library = _LIBRARY[0]
    try:
        library.define(name + schema, tags=tuple(getattr(torch.Tag, tag) for tag in tags))
    except RuntimeError:
        return False
    library.impl(name, lambda *args: _new_tensors(run(*args), args), "CompositeExplicitAutograd")
    library.impl(name, fake_on_meta(fake_source), "Meta")  # cheaper to register than register_fake
    return True


def register_no_grad_op(name, schema, forward, graphs):
    """Registers ``fusegen::<name>`` for ``forward`` (a generated no-grad forward): at run time the
    op replays it from ``graphs`` (CudaGraphs by parameters) where that pays, as the module's own
    call does."""
    register_op(name, schema, lambda *args: graphs.no_grad(forward, args), forward)


def fake_on_meta(function):
    """A custom op's fake (its outputs' shapes and dtypes, what tracing runs): ``function`` (a
    launcher, a generated pass) run on meta tensors, whose CPU path is the reference math (None
    where the pass has nothing: a compiled forward's Dropout key in eval mode)."""

    def fake(*args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        meta = [
            torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
        outputs = function(*meta)
        if isinstance(outputs, tuple):
            return tuple(None if o is None else torch.empty_like(o, device=device) for o in outputs)
        return torch.empty_like(outputs, device=device)

    return fake


def _new_tensors(outputs, inputs):
    """A custom op's outputs as tensors of their own, as an op's schema promises: copies of those
    that share memory with an input or an earlier output (a pass that hands an input out, or one
    tensor twice, or views of one). By storage, not ``_is_view``: below autograd (an op joined by
    register_autograd runs there) a view is not marked as one. None as it is (a compiled forward's
    Dropout key in eval mode). Copies too of those with gaps between their elements (a view of
    part of a buffer): the op's fake (``fake_on_meta``, ``empty_like``) gives such an output
    dense strides, and a compiled graph checks that the real output's strides are the fake's."""
    if isinstance(outputs, Fresh):  # made new by whoever returns them (a replayed graph's copies)
        return tuple(outputs)
    if not isinstance(outputs, tuple):
        return _new_tensors((outputs,), inputs)[0]
    seen = {_memory(a) for a in inputs if isinstance(a, torch.Tensor)}
    fresh = []
    for o in outputs:
        if o is not None:
            if _memory(o) in seen or not _dense(o):
                o = o.clone()  # (a clone of a tensor with gaps: contiguous, as empty_like makes it)
            seen.add(_memory(o))
        fresh.append(o)
    return tuple(fresh)


class Fresh(tuple):
    """Outputs that are new tensors already, which ``_new_tensors`` hands on unchecked."""


def _memory(tensor):
    return tensor.untyped_storage().data_ptr()


def _dense(tensor):
    """Whether ``tensor``'s elements fill its memory without gaps or overlaps, in some order of
    its dims (contiguous, or a permutation of contiguous): the strides ``empty_like`` keeps."""
    expected = 1
    for stride, size in sorted(
        (stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True
