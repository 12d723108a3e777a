"""Errors that point at the user's spec, formatted like a compiler's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Location:
    """A place in a spec file: path as the user named it, 1-based line and column."""

    file: str
    line: int
    col: int
    source_line: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


class SpecError(Exception):
    """A problem in a spec file. ``str()`` gives ``file:line:col: message``, the line and a caret."""

    def __init__(self, message: str, location: Location | None = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        if self.location is None:
            return self.message
        loc = self.location
        text = f"{loc}: error: {self.message}"
        if loc.source_line:
            line = loc.source_line.rstrip("\n")
            text += f"\n    {line}\n    {' ' * (loc.col - 1)}^"
        return text


class UsageError(Exception):
    """A mistake in how fusegen was invoked: arguments, configuration, paths. Exit code 2."""

    exit_code = 2


class ToolchainError(Exception):
    """The pinned NVRTC toolchain is missing or failed (headers, an arch NVRTC rejects). Exit code 3."""

    exit_code = 3
