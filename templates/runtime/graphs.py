"""A module's CUDA graphs, per input shape: its no-grad forward replayed, and the graphs its
forward and backward under autograd replay (training_graphs) found and captured (part of a fusegen
output's runtime: templates/runtime/, copied verbatim; do not edit).
"""

import threading
import warnings

import torch

from .capture import _capture, capture_failed, replay_place
from .training_graphs import _Parameter, _TrainingGraph

MAX_PARAMETER_MOVES = 3  # a module whose parameters move this often replays no graphs


class CudaGraphs:
    """A module's forward, and under autograd its backward, replayed from CUDA graphs per input
    shape where that pays.

    At a few rows a pipeline is bound by the host: every launch and GEMM call costs it several
    µs of Python and dispatch, more than the device needs. So a call on CUDA with at most
    ``max_rows`` rows runs from graphs captured for its shape (on its second call: the first runs
    as usual, loading the kernels):
    - without autograd (``no_grad``): the inputs copied into the graph's own buffers, one graph
      launch, the outputs cloned out (three calls, whatever the pipeline's length);
    - under autograd (``training``, ``replay_forward``, ``replay_backward``): the forward likewise,
      keeping what its backward reads in the graph's buffers (no copies), and the backward as the
      output grads copied in, one graph launch, the grads cloned out, then the weight-grad GEMMs
      run as usual (a graph would write them into fixed memory, and handing that to autograd
      would cost a parameter-sized copy). One forward's tensors live in the buffers at a time:
      while its backward has not run (and its autograd graph lives), another forward of that
      shape runs as usual.
    Every call returns new tensors and sees the parameters' current values (the graph reads them
    where they are; a parameter moved to new memory, by ``module.to`` or an assignment, drops the
    module's graphs). A module keeps at most ``max_graphs`` graphs; calls of other shapes run as
    usual.

    Calls run as usual, not from a graph: under torch.compile (where the no-grad forward is one
    custom op that replays graphs by parameters, register_no_grad_op, and the training call two,
    compiled_passes.py, with graphs of their own), inside a caller's own graph
    capture, with more rows, on CPU, on a device other than the current one, under autocast or
    saved-tensor hooks (training: activation checkpointing, offloading), and once a capture has
    failed or the parameters have moved ``MAX_PARAMETER_MOVES`` times (with a warning saying
    why). Each graph holds its stages' tensors for its shape (the TE docs MLP: about 14 MB a
    no-grad graph at 128 rows, 30 MB a training pair).
    Set ``module.cuda_graphs.max_rows = 0`` to turn graphs off; ``module.cuda_graphs.clear()``
    frees their memory. A module is pickled, copied and saved without its graphs.

    ``by_parameters``: the graphs of every module of a pipeline at once, each found by the
    addresses of the parameters it reads (the no-grad custom op that torch.compile calls, which is
    given tensors, not its module); a module whose parameters move gets graphs of its own, and
    once ``max_graphs`` are held the oldest makes way for a new key.

    ``per_call``: the positions of arguments after the caller's tensors that are tensors made
    anew each call (a pipeline's packed-sequence offsets, cu_seqlens): copied into the graph's
    buffers like the inputs, and their shapes part of the key (a graph per row count and batch
    count), never taken for parameters. The host ints among the arguments (max_seqlen, which the
    module bounds by the rows at a few rows) are part of the key. ``dtypes``: the dtypes of x a
    graph can capture the pipeline in (None: any); calls in others run as usual, without a
    warning (an attention in float32 runs reference math that reads the offsets on the host).
    """

    def __init__(self, module, inputs, max_rows=128, max_graphs=8, by_parameters=False,
                 per_call=(), dtypes=None):
        self.module = module  # the class name, for messages
        self.inputs = inputs  # the first ``inputs`` arguments are the caller's tensors
        self.per_call = tuple(per_call)  # then parameters, flags and ``per_call`` tensors
        self.dtypes = dtypes
        self.max_rows = max_rows
        self.max_graphs = max_graphs
        self.by_parameters = by_parameters
        self._reset()

    @property
    def copied(self):
        """The positions of the arguments a replay copies into the graph's buffers."""
        return (*range(self.inputs), *self.per_call)

    def _reset(self):
        self.failed = None  # why graphs are off for this module from then on
        self.moves = 0  # how often a call found the parameters moved since its graph's capture
        self._graphs = {}  # key -> _Graph or _TrainingGraph (or None: seen once, not captured yet)
        self._lock = threading.Lock()  # one call at a time copies in, replays and clones out
        self._layout = None  # positions of the parameters and of the flags in a call's arguments

    @property
    def captured(self):
        """How many graphs the module holds now."""
        return sum(graph is not None for graph in self._graphs.values())

    def clear(self):
        """Drop every captured graph and the memory it holds; shapes are captured again (a
        backward still to come of a replayed forward keeps its own graph until it has run)."""
        with self._lock:
            self._graphs.clear()

    def __getstate__(self):
        return {"module": self.module, "inputs": self.inputs, "per_call": self.per_call,
                "dtypes": self.dtypes, "max_rows": self.max_rows, "max_graphs": self.max_graphs,
                "by_parameters": self.by_parameters}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def no_grad(self, forward, args):
        """``forward(*args)`` (a generated no-grad forward), or its replay: the same values."""
        if torch.compiler.is_compiling():
            return forward(*args)
        graph = self._find("no-grad", forward, args)
        if graph is None:
            return forward(*args)
        with self._lock:
            for static, i in zip(graph.inputs, self.copied):
                static.copy_(args[i])
            graph.graph.replay()
            outputs = [out.clone() for out in graph.outputs]
        return outputs[0] if graph.single else tuple(outputs)

    def training(self, stages, args):
        """The graphs that ``replay_forward`` replays ``stages(*args)`` from (a generated
        forward_stages under autograd), or None where the call runs as usual."""
        if (torch.compiler.is_compiling() or torch.is_autocast_enabled("cuda")
                # saved-tensor hooks (activation checkpointing, offloading) must see every tensor
                # a forward keeps, where a replayed one keeps them in its graph
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
            return None
        return self._find("training", stages, args)

    def _find(self, mode, stages, args):
        """This call's graph for ``mode``: found, captured now (the key's second call), or None
        where the call runs as usual."""
        place = replay_place(self, args[0])
        if place is None:
            return None
        key = self._key(mode, args, *place)
        parameters = self._layout[0]
        graph = self._graphs.get(key)
        if graph is None:
            full = len(self._graphs) >= self.max_graphs
            if self.by_parameters and full and key not in self._graphs:
                with self._lock:  # the oldest goes (its module may be long gone), not mid-replay
                    self._graphs.pop(next(iter(self._graphs), None), None)
            if key not in self._graphs and len(self._graphs) < self.max_graphs:
                self._graphs[key] = None  # seen once: captured on the next call
                return None
            if key not in self._graphs:  # as many shapes as allowed already
                return None
            return self._capture(key, mode, stages, args)
        if graph.parameters != [args[i].data_ptr() for i in parameters]:
            self.clear()  # a parameter moved: every graph reads the old memory
            self.moves += 1
            if self.moves >= MAX_PARAMETER_MOVES:  # they move every call (FSDP's resharding)
                self.failed = (f"its parameters moved to new memory {self.moves} times, as a "
                               f"wrapper that regathers them every call does")
                warnings.warn(f"{self.module}: {self.failed}, so it runs without CUDA graphs "
                              f"from now on", RuntimeWarning)
            return None
        return graph

    def _key(self, mode, args, stream, index):
        """A call's graph key: the mode, the stream and device, x's dtype, the shapes of what a
        replay copies in (the caller's tensors; the per-call tensors: the offsets' batch count),
        the host values (flags; max_seqlen), and by parameters their addresses. Finds the
        arguments' layout on a module's first call: which are parameters (tensors, not per call)
        and which host values."""
        if self._layout is None:  # the same for every call of a module: found once
            rest = [i for i in range(self.inputs, len(args)) if i not in self.per_call]
            self._layout = ([i for i in rest if isinstance(args[i], torch.Tensor)],
                            [i for i in rest if not isinstance(args[i], torch.Tensor)])
        parameters, flags = self._layout
        key = (mode, stream, index, args[0].dtype,
               *[args[i].shape for i in self.copied], *[args[i] for i in flags])
        if self.by_parameters:  # then a graph's parameters are where it reads them, by its key
            key += tuple(args[i].data_ptr() for i in parameters)
        return key

    def _capture(self, key, mode, stages, args):
        """Capture ``stages`` on this device's capture stream into a new graph, or None with
        graphs turned off for the module (and a warning) where a capture fails."""
        parameters_at = self._layout[0]
        # ordinary tensors even under inference_mode (whose tensors could not be copied into
        # outside it); autograd stays off
        with self._lock, torch.inference_mode(False), torch.no_grad():
            if self._graphs.get(key) is not None:  # another thread captured it meanwhile
                return self._graphs[key]
            # the graph's input buffers, allocated on the stream that will use them
            static = {i: args[i].clone() for i in self.copied}
            captured = _capture(lambda: stages(*[static.get(i, a) for i, a in enumerate(args)]))
            if isinstance(captured, Exception):
                capture_failed(self, f"its {mode} forward", captured)
                return None
            graph, outputs = captured
            parameters = [args[i].data_ptr() for i in parameters_at]
            static = [static[i] for i in self.copied]
            if mode == "training":
                outputs, saved = outputs
                # a parameter as its position in ``args`` (the entry keeps none alive)
                position = {id(args[i]): _Parameter(i) for i in parameters_at}
                saved = [position.get(id(s), s) for s in saved]
                entry = _TrainingGraph(self, graph, static, outputs, saved, parameters)
            else:
                entry = _Graph(graph, static, outputs, parameters)
            self._graphs[key] = entry
        return entry


class _Graph:
    """One captured no-grad forward: the graph, its input and output buffers, and the addresses
    of the parameters it reads."""

    __slots__ = ("graph", "inputs", "outputs", "single", "parameters")

    def __init__(self, graph, inputs, outputs, parameters):
        self.graph, self.inputs, self.parameters = graph, inputs, parameters
        self.single = isinstance(outputs, torch.Tensor)
        self.outputs = [outputs] if self.single else list(outputs)
