"""torch.compile's whole passes: a graph-replaying module's forward under autograd and its backward
as two custom ops joined by ``torch.library.register_autograd``, each replayed from CUDA graphs at a
few rows (part of a fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).

Under torch.compile the module's autograd.Function would be traced into one custom op per kernel
plus the GEMMs: every step host time at a few rows, and no graph replay (a compiled region cannot
hand a Function a module's CudaGraphs). As ops, each pass is one node of the compiled graph that
replays a graph where that pays; the weight-grad GEMMs stay in the autograd formula, where the
compiler sees them and skips those of parameters that need no grad.
"""

import threading

import torch

from .capture import _capture, capture_failed, replay_place
from .custom_ops import Fresh, register_op


class PassGraphs:
    """The CUDA graphs of a pipeline's compiled forward and backward ops, per call shape and
    parameter addresses (an op is given tensors, not its module: two modules of one pipeline get
    graphs of their own, found by where their parameters are).

    A call on CUDA of at most ``max_rows`` rows runs from a graph on its key's second call (the
    first runs as usual): the per-call tensors copied into the graph's buffers in one launch a
    dtype, the graph replayed, its outputs copied out into new tensors likewise (an op's outputs are
    tensors of its own; the next replay rewrites the buffers). Calls run as usual: with more rows,
    on CPU, on a device other than the current one, under autocast (its casts make new parameter
    tensors every call), inside a caller's graph capture, in a dtype of x not in ``dtypes`` (None:
    any; the attention's fp32 reference math reads the offsets on the host, which no graph
    captures), and once a capture has failed (with a warning saying why). At most ``max_graphs`` are held, every module of the pipeline together (a
    forward and a backward graph a module and shape: 32 serve 16 layers of one pipeline at one
    shape; each holds its buffers, the TE docs MLP's pair about 30 MB at 128 rows); the oldest
    key's makes way for a new one. ``max_rows = 0`` turns them off; ``clear()`` frees them."""

    def __init__(self, module, max_rows=128, max_graphs=32, dtypes=None):
        self.module = module  # the class name, for messages
        self.dtypes = dtypes
        self.max_rows = max_rows
        self.max_graphs = max_graphs
        self.failed = None
        self._graphs = {}  # key -> _PassGraph (None: seen once, captured on the next call)
        self._lock = threading.Lock()
        self._others = {}  # an op's name -> the positions of its arguments that are not per call

    @property
    def captured(self):
        """How many graphs are held now."""
        return sum(graph is not None for graph in self._graphs.values())

    def clear(self):
        with self._lock:
            self._graphs.clear()

    def run(self, mode, stages, args, per_call):
        """``stages(*args)`` (a tensor, or a tuple of tensors, None where a pass has nothing: a
        Dropout's key in eval mode), or its replay: the same values in new tensors. ``per_call``:
        the positions of the arguments that are each call's own tensors (copied into the graph);
        the other tensors are parameters, read where they are, and the rest (flags, host ints) are
        part of the key."""
        where = self._where(args[0])
        if where is None:
            return stages(*args)
        others = self._others.get(mode)
        if others is None:  # the same for every call of an op: found once
            others = self._others[mode] = [i for i in range(len(args)) if i not in per_call]
        key = (mode, *where,
               *[None if args[i] is None else (args[i].shape, args[i].dtype) for i in per_call],
               *[args[i].data_ptr() if isinstance(args[i], torch.Tensor) else args[i] for i in others])
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._graphs:  # seen once: captured on the next call
                with self._lock:
                    if len(self._graphs) >= self.max_graphs:  # the oldest goes, not mid-replay
                        self._graphs.pop(next(iter(self._graphs)), None)
                    self._graphs[key] = None
                return stages(*args)
            graph = self._capture(key, mode, stages, args, per_call)
            if graph is None:
                return stages(*args)
        with self._lock:
            inputs = [args[i] for i in graph.positions]
            if inputs:
                _copy_each(graph.inputs, inputs)
            graph.graph.replay()
            present = [o for o in graph.outputs if o is not None]
            fresh = [torch.empty_like(o) for o in present]
            if fresh:
                _copy_each(fresh, present)
        if graph.single:
            return fresh[0]
        fresh = iter(fresh)
        return Fresh(None if o is None else next(fresh) for o in graph.outputs)

    def _where(self, x):
        """(stream, device) a graph of a call whose first argument is ``x`` replays on, or None
        where the call runs as usual (capture.replay_place; and under autocast, whose casts make
        new parameter tensors every call)."""
        return None if torch.is_autocast_enabled("cuda") else replay_place(self, x)

    def _capture(self, key, mode, stages, args, per_call):
        with self._lock, torch.inference_mode(False), torch.no_grad():
            if self._graphs.get(key) is not None:  # another thread captured it meanwhile
                return self._graphs[key]
            positions = [i for i in per_call if args[i] is not None]
            static = list(args)
            for i in positions:  # the graph's input buffers
                static[i] = args[i].clone()
            captured = _capture(lambda: stages(*static))
            if isinstance(captured, Exception):
                capture_failed(self, f"its compiled {mode} op", captured)
                return None
            graph, outputs = captured
            entry = _PassGraph(graph, positions, [static[i] for i in positions], outputs)
            if key in self._graphs:  # (not made way for meanwhile)
                self._graphs[key] = entry
        return entry

    def __getstate__(self):
        return {"module": self.module, "max_rows": self.max_rows, "max_graphs": self.max_graphs,
                "dtypes": self.dtypes}

    def __setstate__(self, state):
        self.__init__(**state)


def _copy_each(targets, sources):
    """``targets[i].copy_(sources[i])`` for every i, one ``_foreach_copy_`` a dtype: a list of
    one dtype takes its one-launch path, a list of several dtypes (a pass's activations and its
    fp32 statistics) would fall back to a copy a tensor, each a launch of its own."""
    groups = {}
    for target, source in zip(targets, sources):
        group = groups.setdefault(target.dtype, ([], []))
        group[0].append(target)
        group[1].append(source)
    for group_targets, group_sources in groups.values():
        torch._foreach_copy_(group_targets, group_sources)


class _PassGraph:
    """One captured pass: the graph, the positions and buffers of its per-call inputs, its outputs
    (``single``: the pass returns one tensor, not a tuple)."""

    __slots__ = ("graph", "positions", "inputs", "outputs", "single")

    def __init__(self, graph, positions, inputs, outputs):
        self.graph, self.positions, self.inputs = graph, positions, inputs
        self.single = isinstance(outputs, torch.Tensor)
        self.outputs = [outputs] if self.single else list(outputs)


def register_training_ops(forward, backward, graphs, setup_context, autograd_backward, random=False):
    """Registers a pipeline's compiled forward and backward ops and joins them for autograd.

    ``forward``, ``backward``: (name, schema, the pass, its per-call argument positions), each pass
    returning its op's outputs (the forward: its outputs, then the tensors its backward reads that
    its arguments and outputs do not hold; the backward: its grads but the weight grads, then what
    the weight-grad GEMMs read). ``setup_context`` keeps what the backward reads;
    ``autograd_backward`` calls the backward op and runs the weight-grad GEMMs. ``random``: the
    forward draws random keys (Dropout): tagged ``nondeterministic_seeded``, so compiled activation
    checkpointing runs it again in the backward under the random-number state of its first run
    (run_with_rng_state: the same keys, where untagged it drew other masks)."""
    registered = [register_op(name, schema, _replayed(graphs, name, run, per_call), run,
                              tags=("nondeterministic_seeded",) if random and run is forward[2] else ())
                  for name, schema, run, per_call in (forward, backward)]
    if registered[0]:  # (else another package registered this pass, by its digest, and joined its ops)
        torch.library.register_autograd(f"fusegen::{forward[0]}", autograd_backward, setup_context=setup_context)


def _replayed(graphs, mode, run, per_call):
    return lambda *args: graphs.run(mode, run, args, per_call)


def keep_for_backward(ctx, saved, made, host=()):
    """What a compiled forward op's backward reads, kept as a Function keeps it: the tensors
    through ``ctx.save_for_backward`` (saved-tensor hooks, activation checkpointing see them), the
    host ints (``host``: their positions in ``saved``, max_seqlen) on the ctx; ``made``: the op's
    outputs that exist only for the backward, which have no grad. saved_tensors gives them back."""
    ctx.mark_non_differentiable(*(t for t in made if t is not None))
    if host:
        ctx.host_values = {i: saved[i] for i in host}
        saved = [None if i in ctx.host_values else s for i, s in enumerate(saved)]
    ctx.save_for_backward(*saved)
