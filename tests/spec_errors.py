"""Assertions on SpecErrors: where they point and how they render (shared by the frontend, names
and plan tests)."""

from fusegen.errors import SpecError


def assert_points_at(err: SpecError, source: str, line: int, col: int, at: str) -> None:
    """The error's location is (line, col), the text there starts with ``at``, and str() shows it."""
    src_line = source.splitlines()[line - 1] if source else ""
    assert (err.location.file, err.location.line, err.location.col) == ("spec.py", line, col), str(err)
    assert err.location.source_line == src_line
    assert src_line[col - 1:].startswith(at), str(err)
    rendered = str(err).splitlines()
    assert rendered[0] == f"spec.py:{line}:{col}: error: {err.message}"
    if src_line:
        assert rendered[1:] == ["    " + src_line, "    " + " " * (col - 1) + "^"]
