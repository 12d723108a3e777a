"""Progress of a long compile: a live display on a terminal, plain lines elsewhere (CI logs).

Both report kernels compiled / total and the kernels in flight. The live display (rich) redraws
several times a second by itself, so its clock moves even while one slow kernel compiles; the
plain reporter prints a line per batch of finished kernels and, during a long wait, one at least
every ``QUIET_SECONDS`` naming what is still compiling.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .console import say

QUIET_SECONDS = 10.0


class Progress:
    """Silent: the interface, and what library callers and tests get by default."""

    def message(self, text: str) -> None:
        pass

    def start(self, total: int, title: str) -> None:
        pass

    def update(self, done: int, in_flight: list[str]) -> None:
        pass

    def finish(self) -> None:
        pass


class PlainProgress(Progress):
    def __init__(self, stream: TextIO):
        self.stream = stream
        self.total = 0
        self.last_line = 0.0
        self.last_done = 0

    def message(self, text: str) -> None:
        say(text, self.stream)  # a log reader that leaves stops the lines, not the compile
        self.last_line = time.monotonic()

    def start(self, total: int, title: str) -> None:
        self.total, self.last_done = total, 0
        self.message(f"fusegen: {title}")

    def update(self, done: int, in_flight: list[str]) -> None:
        quiet = time.monotonic() - self.last_line >= QUIET_SECONDS
        if done == self.total or (done > self.last_done and (done - self.last_done >= 20 or quiet)):
            self.message(f"  [{done}/{self.total}] compiled" + (f"; compiling {in_flight[0]}" if in_flight else ""))
            self.last_done = done
        elif quiet and in_flight:
            self.message(f"  [{done}/{self.total}] still compiling {', '.join(in_flight)}")


class LiveProgress(Progress):
    def __init__(self, stream: TextIO):
        from rich.console import Console  # only on a terminal: plain runs never import rich

        self.console = Console(file=stream)
        self.bar = None
        self.task = None

    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def start(self, total: int, title: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, SpinnerColumn, TextColumn, \
            TimeElapsedColumn

        self.message(f"fusegen: {title}")
        self.bar = Bar(SpinnerColumn(), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[in_flight]}"), console=self.console, refresh_per_second=4)
        self.bar.start()
        self.task = self.bar.add_task("kernels", total=total, in_flight="")

    def update(self, done: int, in_flight: list[str]) -> None:
        self.bar.update(self.task, completed=done, in_flight=", ".join(in_flight))

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def for_stream(stream: TextIO = sys.stderr) -> Progress:
    """The live display on a terminal, plain lines otherwise."""
    return LiveProgress(stream) if stream.isatty() else PlainProgress(stream)
