"""Assemble PTX into a cubin with ptxas, the assembler NVRTC runs inside itself.

The executable comes from the nvidia-cuda-nvcc wheel pinned in pyproject.toml, the same release
as the pinned NVRTC (13.0.88): for the same PTX and arch it writes the same machine code, every
section of the cubin alike but its toolkit note (``.note.nv.tkinfo``, which names the build of the
tool that wrote it). nvrtc.ASSEMBLED_FROM says which archs a build gets this way and why.
"""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path

from ..errors import ToolchainError

PACKAGE = "nvidia-cuda-nvcc"
INSTALL = f"pip install '{PACKAGE}==13.0.88'"


def _package() -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ToolchainError(f"ptxas not found: install the pinned {PACKAGE} package ({INSTALL})") from None


@functools.cache
def executable() -> Path:
    """The pinned ptxas (a ToolchainError that says how to install it when it is missing)."""
    dist = _package()
    for name in ("ptxas", "ptxas.exe"):
        path = Path(dist.locate_file(f"nvidia/cu13/bin/{name}"))
        if path.is_file():
            return path
    raise ToolchainError(f"ptxas not found in {PACKAGE} {dist.version} (nvidia/cu13/bin/ptxas); "
                         f"reinstall the pinned package ({INSTALL})")


def version() -> str:
    """The pinned package's version, recorded with each binary ptxas wrote."""
    return _package().version


def options(arch: str) -> list[str]:
    """ptxas's options for ``arch`` (sm_XY), as MANIFEST.json records them: its defaults (-O3,
    a whole program), which are NVRTC's."""
    return [f"-arch={arch}"]


def assemble(ptx: bytes, arch: str, folder: Path, name: str) -> bytes:
    """The cubin for ``arch`` (sm_XY) of ``ptx``, whatever sm_XY its ``.target`` line names (the
    line is rewritten to ``arch``). ``folder`` holds the two files ptxas reads and writes while it
    runs, named after ``name``; both are removed."""
    lines = ptx.split(b"\n")
    targets = [i for i, line in enumerate(lines) if line.startswith(b".target sm_")]
    if len(targets) != 1:
        raise ToolchainError(f"{name}: the PTX NVRTC wrote has {len(targets)} .target lines, not one")
    lines[targets[0]] = f".target {arch}".encode()
    source, cubin = folder / f"{name}.{arch}.ptx", folder / f"{name}.{arch}.cubin"
    source.write_bytes(b"\n".join(lines))
    try:
        # its own session: a Ctrl-C is for fusegen, which lets the compiles in flight finish
        done = subprocess.run([str(executable()), *options(arch), str(source), "-o", str(cubin)],
                              capture_output=True, start_new_session=True)
        if done.returncode != 0:
            log = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise ToolchainError(f"{name}: ptxas failed for {arch} (exit {done.returncode}):\n{log}")
        return cubin.read_bytes()
    finally:
        source.unlink(missing_ok=True)
        cubin.unlink(missing_ok=True)
