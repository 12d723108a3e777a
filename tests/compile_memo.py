"""One NVRTC compile per distinct job for the whole test session.

The build tests make many small packages, and most of their compile jobs repeat an earlier
test's (44 distinct of 188 in tests/builds and tests/cli). NVRTC's output, and ptxas's, is a pure
function of the source, the headers, the arch and the options (tests/builds/test_compiles.py and
test_two_builds_give_identical_bytes check that on real compiles), so a job seen before gets its
binaries from this session's memo instead of another compile. What a test observes of a build is
unchanged: ``toolchain.jobs.run_compiles`` is still called with every job (the build-cache tests count
them there), the progress reaches its total, and a failing compile is never remembered.
A test marked ``real_nvrtc`` compiles everything it asks for.
"""

from __future__ import annotations

import hashlib

from fusegen import toolchain
from fusegen.toolchain import nvrtc, ptxas
from fusegen.progress import Progress

_binaries: dict[tuple, dict[str, bytes]] = {}  # job key -> {target: bytes}


class _Shifted(Progress):
    """The real compiles' progress, counted after the jobs the memo answered."""

    def __init__(self, progress: Progress, answered: int):
        self.progress, self.answered = progress, answered

    def update(self, done: int, in_flight: list[str]) -> None:
        self.progress.update(self.answered + done, in_flight)


def _key(job: toolchain.Compile, headers_digest: str) -> tuple:
    """What a job's binaries are a function of: ptxas's version only where the job assembles (a
    machine without the nvidia-cuda-nvcc package builds the other jobs, as the build itself does)."""
    assembler = ptxas.version() if job.assembled else None
    options = (*nvrtc.LANGUAGE_OPTIONS, *nvrtc.SPEED_OPTIONS, nvrtc.nvrtc_version(), assembler)
    return job.source, job.arch, job.with_ptx, job.assembled, headers_digest, options


def remembering(run_compiles):
    """``run_compiles`` that compiles only the jobs this session has not compiled yet."""

    def run(jobs: list[toolchain.Compile], progress: Progress, headers: dict[str, str]) -> dict[str, bytes]:
        digest = hashlib.sha256(repr(sorted(headers.items())).encode()).hexdigest()
        keys = [_key(job, digest) for job in jobs]
        missing = [job for job, key in zip(jobs, keys) if key not in _binaries]
        compiled = run_compiles(missing, _Shifted(progress, len(jobs) - len(missing)), headers) if missing else {}
        for job, key in zip(jobs, keys):
            if key not in _binaries:
                _binaries[key] = {t: compiled[toolchain.binary_name(job.kernel, t)] for t in job.targets}
        progress.update(len(jobs), [])
        return {toolchain.binary_name(job.kernel, target): binary
                for job, key in zip(jobs, keys) for target, binary in _binaries[key].items()}

    return run
