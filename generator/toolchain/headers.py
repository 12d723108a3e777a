"""Which device headers a kernel source includes, and their digests.

A binary is compiled from its source and the fusegen (and plugin) headers it includes, transitively:
those headers' sha256, with the source's, are its cache key (cache.py). NVRTC is given the same
headers in memory (``cuda_headers``).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from ..emit import TEMPLATES

CUDA_HEADERS = TEMPLATES / "cuda"
# `#include "name"` or `#include <name>` at the start of a line (the templates write no other form).
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)', re.MULTILINE)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def header_files(extra: dict[str, Path] | None = None) -> dict[str, Path]:
    """{name: file} of the device headers kernels may include: templates/cuda's, then plugins'."""
    return {**{p.name: p for p in sorted(CUDA_HEADERS.glob("*.cuh"))}, **(extra or {})}


def included_headers(source: str, source_name: str, headers: dict[str, Path] | None = None) -> dict[str, str]:
    """{header: sha256} of every header of ``headers`` (default: templates/cuda's) that ``source``
    includes, transitively.

    These, with the source itself, are all the fusegen text a binary is compiled from, so they
    are its cache key (with the NVRTC version and options, recorded per binary). NVRTC is given the
    templates/cuda headers in memory (compile_source) and takes them first for both include forms,
    so any include of a file found there is followed. An angle-bracket include found elsewhere (<cuda_bf16.h>,
    <cuda_fp16.h>) comes from the nvidia-cuda-runtime package pinned in pyproject.toml: the pin
    fixes those, and each binary's record (NVRTC version, options naming that include folder)
    stands for them. A quoted include not found in templates/cuda (or a plugin's folder) is a
    fusegen template bug."""
    files = header_files() if headers is None else headers
    digests: dict[str, str] = {}
    pending = [(source_name, source)]
    while pending:
        including, text = pending.pop()
        for quoted, angled in INCLUDE.findall(text):
            name = quoted or angled
            path = files.get(name)
            if name in digests or (angled and path is None):
                continue
            if path is None:
                raise AssertionError(f'{including} includes "{name}", which is not a header in templates/cuda/ '
                                     f"or a plugin's folder (a fusegen template bug)")
            data = path.read_bytes()
            digests[name] = sha256(data)
            pending.append((f"templates/cuda/{name}" if path.parent == CUDA_HEADERS else name, data.decode()))
    return dict(sorted(digests.items()))


def arch_testing_headers(headers: dict[str, Path] | None = None) -> set[str]:
    """The fusegen and plugin headers (header_files) that test the arch a kernel is compiled for
    (nvrtc.TESTS_ARCH), each read once a build."""
    from . import nvrtc

    files = header_files() if headers is None else headers
    return {name for name, path in files.items() if nvrtc.TESTS_ARCH.search(path.read_text())}


def cuda_headers(headers: dict[str, Path] | None = None) -> dict[str, str]:
    """The kernel-math headers the generated sources may include, by file name (NVRTC gets them in
    memory): ``headers`` (header_files), default templates/cuda's."""
    return {name: path.read_text() for name, path in (header_files() if headers is None else headers).items()}
