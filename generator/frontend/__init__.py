"""The spec frontend: reads a spec file with libcst, never importing or running it.

Every module-level ``NAME = Sequential(...)`` becomes a ``SequentialSpec``: the op calls in order,
their arguments bound to the op registry's signatures (defaults filled in) and source locations for
error messages. Spellings follow Transformer Engine (``te.ops.Linear``, ``from
transformer_engine.pytorch.ops import Linear as L``) or fusegen's eager module (``fusegen.eager``).
Arguments may be literals, module-level constants defined earlier, and arithmetic on them.

The file is read top to bottom like Python would run it, so a constant means the value of its
latest assignment above the use. Anything fusegen cannot evaluate makes the name unusable rather
than silently keeping an older value; a statement that would bind a name in a way fusegen cannot
follow (``:=``, unpacking) is an error, and so is a Sequential(...) that only code would build.

Whatever the text, the result is specs or a SpecError inside the file, never another exception:
the file's size, its nesting depth and every number in it are bounded before anything recurses
over it or converts it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import Location, SpecError
from .calls import MAX_OPS, OpCall, SequentialSpec
from .reader import _SpecReader
from .source import _MAX_INT_BITS, MAX_NESTING, MAX_SOURCE_CHARS, SpecSource, nesting_hint

# The package, module by module: source.py (the text: bounds, parsing, locations), scope.py
# (module-level names: imports, constants), values.py (constant folding), calls.py (op calls
# bound to the registry; OpCall, SequentialSpec), reader.py (the statement walk).


def parse_spec(source: str, display_path: str) -> list[SequentialSpec]:
    """Every ``NAME = Sequential(...)`` of a spec's source, in file order; raises SpecError."""
    text = SpecSource(source, display_path)
    try:
        # This package's MAX_NESTING, read at each call: setting fusegen.frontend.MAX_NESTING takes effect.
        text.parse(MAX_NESTING)
        return _SpecReader(text).read()
    except RecursionError:  # a last resort: MAX_NESTING is meant to keep every recursion shallow
        raise SpecError(f"expression nested too deeply for fusegen; {nesting_hint()}", text.deepest) from None


def parse_spec_file(path: Path, display_path: str | None = None) -> list[SequentialSpec]:
    """``parse_spec`` on a file (UTF-8); ``display_path`` is how errors name it (default: ``path``)."""
    display = display_path if display_path is not None else str(path)
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of the text, as for Python.
        source = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError(f"spec file is not valid UTF-8 (byte {err.start}); save it as UTF-8",
                        Location(display, 1, 1)) from None
    return parse_spec(source, display)


__all__ = [
    "MAX_NESTING", "MAX_OPS", "MAX_SOURCE_CHARS", "_MAX_INT_BITS", "OpCall", "SequentialSpec",
    "parse_spec", "parse_spec_file",
]
