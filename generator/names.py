"""Pipeline names: each one becomes a module file ``<name>.py`` and a class of the output package.

So a name must be a plain ASCII identifier whose CamelCase class name is an identifier too, short
enough for a file name, and clear of the package's own modules. Two pipelines of one build may
not share a module (exactly, or up to case on case-insensitive file systems) or a class name.
``NameTable`` holds the names of one file (the frontend) or of one whole build (``load_plans``),
so the error points at the second definition and names the first.

The ops' numbers, the one numbering plans and generated code cite ops by, are here too
(``spec_numbers``, ``ops_cited``).
"""

from __future__ import annotations

import keyword
import re
import string
import unicodedata
from collections import Counter
from dataclasses import dataclass

from .errors import Location, SpecError

MAX_NAME_LENGTH = 64  # far under the 255-byte file-name limit, with room for ".plan.md"
# Modules the generated package ships beside the pipelines (build_package), and what Python
# itself gives a meaning to; a pipeline module of that name would replace or shadow them.
PACKAGE_MODULES = frozenset({"_runtime", "_kernels", "_reference", "kernels", "__init__", "__main__"})
PACKAGE_FOLDERS = frozenset({"_runtime", "kernels"})  # of PACKAGE_MODULES, those that are folders
# Windows refuses these file names whatever the extension (con.py cannot be created there).
WINDOWS_DEVICE_NAMES = frozenset({"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)),
                                  *(f"lpt{i}" for i in range(10))})
_ASCII_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def class_name(name: str) -> str:
    """The pipeline's class in the generated package: mlp_block -> MlpBlock."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def module_file(name: str) -> str:
    return f"{name}.py"


def ascii_spelling(name: str) -> str:
    """A suggestion for a non-ASCII name: its compatibility decomposition, accents dropped."""
    decomposed = unicodedata.normalize("NFKD", name).encode("ascii", "ignore").decode()
    spelled = re.sub(r"[^A-Za-z0-9_]", "", decomposed)
    return spelled if _ASCII_NAME.fullmatch(spelled) and not keyword.iskeyword(spelled) else "pipeline"


def check_name(name: str, location: Location) -> None:
    """Raise a SpecError at ``location`` if ``name`` cannot become a module file and a class."""
    if not name.isascii():
        # Python reads identifiers NFKC-normalised (the ligature 'ﬁ' is 'fi'), file systems do
        # not: the module file and the name the package imports would disagree.
        raise SpecError(f"pipeline name '{name}' is not ASCII; it becomes the module file {module_file(name)} "
                        "and a class name, so use ASCII letters, digits and underscores, e.g. "
                        f"'{ascii_spelling(name)}'", location)
    if not _ASCII_NAME.fullmatch(name):  # a spec's names are identifiers; this guards other callers
        raise SpecError(f"pipeline name '{name}' is not a Python identifier; use letters, digits and underscores, "
                        f"e.g. '{ascii_spelling(name)}'", location)
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(f"pipeline name '{name[:16]}...' is {len(name)} characters long; it becomes a module file "
                        f"name, so keep it to at most {MAX_NAME_LENGTH}", location)
    if keyword.iskeyword(name):
        raise SpecError(f"pipeline name '{name}' is a Python keyword, so its module could not be imported; "
                        f"rename it, e.g. '{name}_block'", location)
    suggestion = f"{name.strip('_') or 'pipeline'}_block"
    if name in PACKAGE_MODULES:
        own = f"folder {name}/" if name in PACKAGE_FOLDERS else f"module {module_file(name)}"
        raise SpecError(f"pipeline name '{name}' is taken by the generated package itself (its {own}); rename the "
                        f"pipeline, e.g. '{suggestion}'", location)
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        raise SpecError(f"pipeline name '{name}' is a dunder name, which Python reserves for itself (as in "
                        f"__init__.py and __main__.py); rename the pipeline, e.g. '{suggestion}'", location)
    if name.lower() in WINDOWS_DEVICE_NAMES:
        raise SpecError(f"pipeline name '{name}' would make the module file {module_file(name)}, which Windows "
                        f"does not allow ({name.upper()} is a device name); rename it, e.g. '{name}_block'", location)
    cls = class_name(name)
    if not cls or not cls[0].isalpha():
        # Underscores are dropped and each part capitalised: '_0' would be the class '0'.
        raise SpecError(f"pipeline name '{name}' gives the class name '{cls}', which is not a Python class "
                        "name; start the name with a letter, e.g. "
                        f"'pipeline{name if name.startswith('_') else '_' + name}'", location)


@dataclass(frozen=True)
class _Claim:
    name: str
    location: Location


class NameTable:
    """Pipeline names defined so far, and the module file and class each one claims."""

    def __init__(self) -> None:
        self.names: dict[str, _Claim] = {}
        self.files: dict[str, _Claim] = {}  # module file name, case-folded
        self.classes: dict[str, _Claim] = {}

    def claim(self, name: str, location: Location) -> None:
        """Check ``name`` and record it; raise a SpecError at ``location`` if it collides."""
        check_name(name, location)
        first = self.names.get(name)
        if first is not None:
            if first.location.file == location.file:
                raise SpecError(f"pipeline '{name}' is defined twice in this file (first at line "
                                f"{first.location.line}); give each pipeline its own name", location)
            raise SpecError(f"pipeline '{name}' is already defined at {first.location}; pipeline names become "
                            "module names and must be unique", location)
        file_key = module_file(name).lower()  # names are ASCII here, so lower() is the case fold
        first = self.files.get(file_key)
        if first is not None:
            raise SpecError(f"pipeline '{name}' would be written to {module_file(name)}, and pipeline "
                            f"'{first.name}' ({_where(first.location, location)}) to {module_file(first.name)}: "
                            "one file on case-insensitive file systems (macOS, Windows); rename one of them",
                            location)
        cls = class_name(name)
        first = self.classes.get(cls)
        if first is not None:
            raise SpecError(f"pipeline '{name}' gives the class name {cls}, like pipeline '{first.name}' "
                            f"({_where(first.location, location)}); rename one of them so the package can "
                            "export both", location)
        claim = _Claim(name, location)
        self.names[name] = self.files[file_key] = self.classes[cls] = claim


def _where(first: Location, second: Location) -> str:
    """Where the first definition is, as seen from the second: 'line 3' or 'a.py:3'."""
    return f"line {first.line}" if first.file == second.file else f"{first.file}:{first.line}"


def spec_numbers(ops: list) -> list[str]:
    """Each basic op's number, the one numbering plans and generated code use: its spec op's
    position in the Sequential as written (the eager Sequential's child index, the state_dict
    prefix; views count; inside a Residual its path, "0.1"), lettered where that op runs as several
    basic ops: "1a", "1b" for a Linear's BasicLinear and Bias, an in-place AddExtraInput's add and
    its write-back, or a Residual's tee and add."""
    parts = Counter(op.module_index for op in ops)
    seen: Counter[str] = Counter()
    numbers = []
    for op in ops:
        letter = string.ascii_lowercase[seen[op.module_index]] if parts[op.module_index] > 1 else ""
        numbers.append(f"{op.module_index}{letter}")
        seen[op.module_index] += 1
    return numbers


def ops_cited(ops) -> str:
    """``ops`` as plans and comments cite them: "op 3" or "ops 1a, 1b"."""
    return ("op " if len(ops) == 1 else "ops ") + ", ".join(op.number for op in ops)
