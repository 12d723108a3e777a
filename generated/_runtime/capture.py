"""Capturing a run into a CUDA graph on a stream of its own (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).
"""

import warnings

import torch

from .launch import _current_device, _raw_stream
from .loading import _LOCK


def _capture(run):
    """``run()`` captured into a new CUDA graph on the current device's capture stream, after a
    warm-up run there (cuBLAS's workspace): (graph, what the captured run returned), or the
    RuntimeError that failed the capture."""
    stream = torch.cuda.current_stream()
    side = _capture_stream(stream.device.index)
    side.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            run()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                returned = run()
            finally:
                graph.capture_end()
    except RuntimeError as error:
        _end_failed_capture(side)
        stream.wait_stream(side)
        return error
    stream.wait_stream(side)
    return graph, returned


_CAPTURE_STREAMS = {}  # device index -> the stream captures run on (never the legacy default)


def _capture_stream(index):
    with _LOCK:
        if index not in _CAPTURE_STREAMS:
            _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
        return _CAPTURE_STREAMS[index]


def _end_failed_capture(side):
    """Leave PyTorch as a successful capture would. When a capture fails, CUDAGraph.capture_end
    raises before it takes the random-number generator out of capture mode, and every later
    random op then fails ("Offset increment outside graph capture"); a small capture that
    succeeds ends that mode."""
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            torch.empty(1, device=side.device).zero_()
        finally:
            graph.capture_end()


def _capturing():
    """Whether the current stream is being captured by a caller (its graph then holds our
    launches; a graph cannot be captured inside another)."""
    return torch._C._cuda_isCurrentStreamCapturing()


def replay_place(graphs, x):
    """(stream, device index) a graph of ``graphs`` (CudaGraphs, PassGraphs) replays a call whose
    first tensor is ``x`` on, or None where the call runs as usual: off CUDA, above its
    ``max_rows``, once a capture has failed, inside a caller's capture, in a dtype not among its
    ``dtypes`` (None: any), or on a device other than the current one (a graph captures and
    replays on the current device's streams)."""
    if (not x.is_cuda or x.shape[0] > graphs.max_rows or graphs.failed or _capturing()
            or (graphs.dtypes is not None and x.dtype not in graphs.dtypes)):
        return None
    index = x.get_device()
    if index != _current_device():
        return None
    return _raw_stream(index), index


def capture_failed(graphs, what, error):
    """Turn ``graphs``' replay off for good after a failed capture of ``what``, saying why."""
    graphs.failed = f"{type(error).__name__}: {error}"
    graphs._graphs.clear()
    warnings.warn(f"{graphs.module}: capturing {what} in a CUDA graph failed, so it runs without graphs "
                  f"from now on ({graphs.failed})", RuntimeWarning)
