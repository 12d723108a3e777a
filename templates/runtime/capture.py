"""Capturing a run into a CUDA graph on a stream of its own (part of a fusegen output's runtime:
templates/runtime/, copied verbatim; do not edit).
"""

import torch

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
