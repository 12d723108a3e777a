"""Lines for the user: on a terminal, into a file, or into a pipe whose reader may leave early.

A reader that leaves (``fusegen plan | head``, ``fusegen generate --check | head``, a log
collector that dies) ends the output, never the command: what is left to write goes nowhere, and
the command finishes its work and exits with its own status (``--check``: 1 when stale), with no
"Broken pipe" error of its own.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


def counted(count: int, one: str, many: str | None = None) -> str:
    """``count`` and the noun that fits it: "1 kernel binary", "3 kernel binaries"."""
    return f"{count} {one if count == 1 else many or one + 's'}"


def say(text: str, stream: TextIO | None = None) -> None:
    """``text`` and a newline on ``stream`` (default: standard output), flushed."""
    stream = sys.stdout if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        _discard(stream)


def _discard(stream: TextIO) -> None:
    """Point the stream's file descriptor at the null device: later writes, and the flush of
    what is still buffered when Python exits, then succeed instead of failing again."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not backed by a file: nothing to redirect
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, descriptor)
    finally:
        os.close(null)
