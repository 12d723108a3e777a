"""A generated Function's forward and backward under autograd, replayed from CUDA graphs that
CudaGraphs.training finds (part of a fusegen output's runtime: templates/runtime/, copied
verbatim; do not edit).
"""

import weakref

import torch

from .capture import _capture, _capturing


class _Parameter:
    """A saved tensor that is a parameter: its position in the call's arguments (each replay
    reads its own call's, which a key's graph finds at the same address)."""

    __slots__ = ("position",)

    def __init__(self, position):
        self.position = position


class _TrainingGraph:
    """One captured forward under autograd (its outputs, and the tensors its backward reads, in
    the graph's buffers), and its backward's graph, captured on the first backward.

    ``lease``: a weak reference to the replay whose tensors the buffers hold while its backward
    is still to come (dead once autograd drops that replay's ctx). Nothing here refers back to
    the CudaGraphs but weakly: a module's graphs are freed with it, never by the cycle collector
    (which could run during some other capture, where freeing a graph is not allowed)."""

    def __init__(self, graphs, graph, inputs, outputs, saved, parameters):
        self.owner = weakref.ref(graphs)
        self.module, self.lock, self.copied = graphs.module, graphs._lock, graphs.copied
        self.graph, self.inputs, self.parameters = graph, inputs, parameters
        self.single = isinstance(outputs, torch.Tensor)
        self.outputs = [outputs] if self.single else list(outputs)
        self.saved = saved
        self.lease = None
        self.replays = 0  # forward replays so far: a backward checks its forward's are still there
        # (graph, grad-output buffers, returned grads, weight-GEMM operands, the parameters it
        # reads: (position in saved, address))
        self.backward = None

    def leased(self):
        return self.lease is not None and self.lease() is not None


class _Replay:
    """A replayed forward's hold on its graph's buffers, kept by its autograd ctx: released at the
    end of its backward (backward_done), or when autograd drops the ctx without one."""

    __slots__ = ("entry", "replay", "saved", "__weakref__")

    def __init__(self, entry, args):
        self.entry, self.replay = entry, entry.replays
        # the buffers, and this call's own parameters where the capture's were
        self.saved = tuple(args[s.position] if isinstance(s, _Parameter) else s
                           for s in entry.saved)

    def release(self):
        if self.entry.lease is not None and self.entry.lease() is self:
            self.entry.lease = None


def replay_forward(graph, ctx, stages, args, host=()):
    """The outputs of ``stages(*args)`` (a generated forward_stages: the outputs, then what the
    backward reads, which go to ``ctx.save_for_backward``), or of its replay from ``graph``
    (CudaGraphs.training; None: as usual), whose buffers the backward reads instead (no autograd
    bookkeeping for them); ``ctx`` records which for replay_backward. ``host``: the positions of
    the saved values that are host ints (max_seqlen), kept on the ctx (saved_tensors puts them
    back)."""
    ctx.replayed = None
    if graph is not None:
        with graph.lock:
            if not graph.leased():  # else its buffers hold a pending backward's tensors
                for static, i in zip(graph.inputs, graph.copied):
                    static.copy_(args[i])
                graph.graph.replay()
                graph.replays += 1
                ctx.replayed = _Replay(graph, args)
                graph.lease = weakref.ref(ctx.replayed)
                outputs = [out.clone() for out in graph.outputs]
                return outputs[0] if graph.single else tuple(outputs)
    outputs, saved = stages(*args)
    if host:  # host ints are no tensors for save_for_backward
        ctx.host_values = {i: saved[i] for i in host}
        saved = [None if i in ctx.host_values else s for i, s in enumerate(saved)]
    ctx.save_for_backward(*saved)
    return outputs


def saved_tensors(ctx):
    """What the forward saved for the backward: ``ctx.saved_tensors``, or after a replayed forward
    the graph's buffers (and the call's parameters). (A Function of a module without graphs
    records no ``replayed``.)"""
    replayed = getattr(ctx, "replayed", None)
    if replayed is not None:
        return replayed.saved
    host = getattr(ctx, "host_values", None)
    if host is None:
        return ctx.saved_tensors
    return tuple(host.get(i, s) for i, s in enumerate(ctx.saved_tensors))


def replay_backward(ctx, stages, args):
    """``stages(*args)`` (a generated backward_stages on the output grads, then the saved tensors:
    the grads, then the operands of the weight-grad GEMMs run after it), or, after a replayed
    forward, its replay from a graph: the grads cloned out, the operands in the graph's buffers
    (which no other forward replaces until backward_done)."""
    replayed = ctx.replayed
    if replayed is None or _capturing():  # (a caller capturing the backward: its launches)
        return stages(*args)
    graph = replayed.entry
    if graph.replays != replayed.replay:
        raise RuntimeError(
            f"{graph.module}: a second backward (retain_graph=True) through a forward replayed "
            f"from a CUDA graph, after a later forward of the same shape reused the graph's "
            f"buffers; set module.cuda_graphs.max_rows = 0 to keep each forward's tensors apart")
    grad_outputs = len(graph.outputs)
    with graph.lock:
        if graph.backward is None:
            static = [d.clone(memory_format=torch.contiguous_format) for d in args[:grad_outputs]]
            rest = args[grad_outputs:]
            with torch.inference_mode(False), torch.no_grad():
                captured = _capture(lambda: stages(*static, *rest))
            if isinstance(captured, Exception):  # graphs off from now on; this backward as usual
                owner = graph.owner()
                if owner is not None:
                    owner._failed("its backward", captured)
                return stages(*args)
            backward, (grads, operands) = captured
            # the parameters it reads, where it reads them
            parameters = [(i, s.data_ptr()) for i, s in enumerate(replayed.saved)
                          if isinstance(graph.saved[i], _Parameter)]
            graph.backward = (backward, static, grads, operands, parameters)
        backward, static, grads, operands, parameters = graph.backward
        if any(replayed.saved[i].data_ptr() != at for i, at in parameters):
            # a parameter moved since the forward (regathered by a wrapper): the stages as usual,
            # on the forward's tensors in the graph's buffers
            return stages(*args)
        for buffer, d in zip(static, args[:grad_outputs]):
            buffer.copy_(d)
        backward.replay()
        grads = tuple(None if g is None else g.clone() for g in grads)
    return grads, operands


def backward_done(ctx):
    """The end of a backward (after replay_backward and the weight-grad GEMMs that read its
    operands): a replayed forward's graph buffers may take the next forward's tensors."""
    if ctx.replayed is not None:
        ctx.replayed.release()
