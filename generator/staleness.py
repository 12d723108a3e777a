"""What `fusegen generate --check` shows when the checked-in package is stale: a unified diff of
each text file that differs (a reviewer sees what changed without regenerating), binaries by name
and sha256, files that would be removed, and a one-line summary. Long diffs are cut per file and
in all, saying how much was left out."""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from .output import owned_files, read_manifest

BINARY_SUFFIXES = (".cubin", ".ptx")  # PTX is text, but thousands of lines no reviewer reads
LINES_PER_FILE = 60
LINES_IN_ALL = 600


@dataclass
class Staleness:
    """How ``out`` differs from a fresh build: text diffs, binaries, files to remove."""

    diffs: dict[str, list[str]] = field(default_factory=dict)  # rel -> unified diff lines
    binaries: dict[str, tuple[str | None, str]] = field(default_factory=dict)  # rel -> (old sha, new sha)
    removed: list[str] = field(default_factory=list)

    @property
    def stale(self) -> bool:
        return bool(self.diffs or self.binaries or self.removed)

    def files(self) -> list[str]:
        return sorted([*self.diffs, *self.binaries, *self.removed])

    def report(self, where: str) -> list[str]:
        """The diff and the lists, cut to LINES_PER_FILE lines a file and LINES_IN_ALL in all."""
        lines: list[str] = []
        for done, (rel, diff) in enumerate(sorted(self.diffs.items())):
            if len(lines) >= LINES_IN_ALL:
                lines.append(f"... the diffs of {len(self.diffs) - done} more files left out")
                break
            shown = diff[:LINES_PER_FILE]
            lines += [line.rstrip("\n") for line in shown]
            if len(diff) > len(shown):
                lines.append(f"... {len(diff) - len(shown)} more lines of {where}/{rel} left out")
        for rel, (old, new) in sorted(self.binaries.items()):
            before = "missing" if old is None else f"sha256 {old[:12]}"
            lines.append(f"binary {where}/{rel}: {before} -> sha256 {new[:12]}")
        lines += [f"remove {where}/{rel} (fusegen no longer makes it)" for rel in self.removed]
        return lines

    def summary(self) -> str:
        added = sum(1 for d in self.diffs.values() for line in d[2:] if line.startswith("+"))
        deleted = sum(1 for d in self.diffs.values() for line in d[2:] if line.startswith("-"))
        differ = "text file differs" if len(self.diffs) == 1 else "text files differ"
        parts = [f"{len(self.diffs)} {differ} (+{added} -{deleted} lines)"]
        parts.append(f"{len(self.binaries)} binar{'ies' if len(self.binaries) != 1 else 'y'}")
        parts.append(f"{len(self.removed)} to remove")
        return ", ".join(parts)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def staleness(files: dict[str, bytes], out: Path, where: str) -> Staleness:
    """How the folder ``out`` (shown as ``where``) differs from ``files``, a fresh build of it."""
    result = Staleness()
    label = where.lstrip("/")  # git's a/ and b/ prefixes, before an absolute path too
    for rel, data in sorted(files.items()):
        path = out / rel
        old = path.read_bytes() if path.is_file() else None
        if old == data:
            continue
        if rel.endswith(BINARY_SUFFIXES):
            result.binaries[rel] = (None if old is None else _sha(old), _sha(data))
            continue
        try:
            before = [] if old is None else old.decode().splitlines(keepends=True)
            after = data.decode().splitlines(keepends=True)
        except UnicodeDecodeError:
            result.binaries[rel] = (None if old is None else _sha(old), _sha(data))
            continue
        result.diffs[rel] = list(difflib.unified_diff(
            before, after, "/dev/null" if old is None else f"a/{label}/{rel}", f"b/{label}/{rel}", n=2))
    previous = read_manifest(out)
    if previous is not None:
        result.removed = sorted(rel for rel in owned_files(previous) - set(files) if (out / rel).is_file())
    return result
