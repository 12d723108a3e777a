"""The output folder: fusegen owns exactly the files its MANIFEST.json lists, and no others.

Before anything is compiled, ``check_output_folder`` refuses folders that are not plainly a
generated package (a project root, the working directory, a folder holding the specs, a non-empty
folder with no fusegen manifest), and files the new package would replace that fusegen did not
write (the build hands it every file name before its first compile: ``before_compiling``).
``write_package`` then writes only what changed, each file atomically (temporary file + rename),
and deletes only files the previous manifest lists. The manifest is written first with the union
of old and new files, so an interrupted run still owns (and the next run can clean up)
everything it may have written.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import UsageError

MANIFEST = "MANIFEST.json"
GENERATOR_TAG = "fusegen"
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py")  # a project root, never a generated package


def manifest_bytes(manifest: dict) -> bytes:
    """The one serialisation of MANIFEST.json: sorted keys, so identical bytes on every run."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def read_manifest(out: Path) -> dict | None:
    """The fusegen manifest of ``out``, or None if it has none (or one fusegen did not write)."""
    path = out / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("generator") == GENERATOR_TAG else None


def owned_files(manifest: dict) -> set[str]:
    """Files a previous run wrote. Manifests before the ``files`` list name only kernel files."""
    if "files" in manifest:
        return set(manifest["files"])
    owned = set()
    for entry in manifest.get("kernels", {}).values():
        owned.add(entry["source"])
        owned.update(binary["file"] for binary in entry.get("binaries", {}).values())
    return owned


def display_path(path: Path, cwd: Path) -> str:
    """A path as the user would write it: relative to the working directory when inside it."""
    try:
        return path.resolve().relative_to(cwd.resolve()).as_posix() or "."
    except ValueError:
        return path.resolve().as_posix()


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_output_folder(out: Path, specs: tuple[Path, ...], cwd: Path, new_files: set[str] | None = None) -> None:
    """Refuse, touching nothing, any output folder whose files fusegen could not safely own."""
    folder = out.resolve()
    shown = display_path(out, cwd)
    advice = "choose a new or empty folder just for the generated package (e.g. --out model/fused)"
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"output {shown} is a file, not a folder; {advice}")
    if _within(cwd.resolve(), folder):
        what = "the current directory" if folder == cwd.resolve() else "a parent of the current directory"
        raise UsageError(f"refusing to write into {shown}: it is {what}; fusegen owns its output folder and "
                         f"removes stale files there; {advice}")
    for spec in specs:
        if _within(spec.resolve(), folder):
            raise UsageError(f"refusing to write into {shown}: it holds the spec file {display_path(spec, cwd)}; "
                             f"keep specs outside the output package; {advice}")
    if not folder.is_dir():
        return
    for marker in PROJECT_MARKERS:
        if (folder / marker).exists():
            raise UsageError(f"refusing to write into {shown}: it holds {marker}, so it is a project, not a "
                             f"generated package; {advice}")
    manifest = read_manifest(folder)
    if manifest is None:
        if any(folder.iterdir()):
            raise UsageError(f"refusing to write into {shown}: it is not empty and has no {MANIFEST} written "
                             f"by fusegen, so its files are not fusegen's to replace; {advice}")
        return
    if new_files is not None and "files" in manifest:
        owned = owned_files(manifest)
        foreign = sorted(rel for rel in new_files if rel not in owned and rel != MANIFEST and (folder / rel).exists())
        if foreign:
            raise UsageError(f"refusing to overwrite {display_path(out / foreign[0], cwd)}: fusegen did not write it "
                             f"(it is not in {MANIFEST}); move it away or rename the pipeline")


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one rename: readers see the old or the new file, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_package(files: dict[str, bytes], out: Path) -> tuple[list[str], list[str]]:
    """Write what differs, delete what the previous manifest lists but the new output lacks.

    Returns (written, removed), relative paths. ``files`` must hold MANIFEST.json."""
    previous = read_manifest(out)
    stale = [rel for rel in sorted(owned_files(previous) - set(files)) if (out / rel).is_file()] if previous else []
    changed = [rel for rel, data in files.items()
               if not (out / rel).is_file() or (out / rel).read_bytes() != data]
    if not changed and not stale:
        return [], []
    manifest = json.loads(files[MANIFEST])
    # Claim old and new files before touching any, so an interruption leaves nothing unowned.
    claimed = sorted(set(manifest["files"]) | set(stale))
    _write_atomic(out / MANIFEST, manifest_bytes({**manifest, "files": claimed}))
    for rel in changed:
        if rel != MANIFEST:
            _write_atomic(out / rel, files[rel])
    for rel in stale:
        (out / rel).unlink()
    _write_atomic(out / MANIFEST, files[MANIFEST])
    return changed, stale


def stale_files(files: dict[str, bytes], out: Path) -> list[str]:
    """Files of ``out`` that differ from a fresh build: changed, missing, or owned and no longer made."""
    stale = [rel for rel, data in files.items() if not (out / rel).is_file() or (out / rel).read_bytes() != data]
    previous = read_manifest(out)
    if previous is not None:
        stale += [rel for rel in owned_files(previous) - set(files) if (out / rel).is_file()]
    return sorted(stale)
