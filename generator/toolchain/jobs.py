"""Compile jobs: one NVRTC compile a kernel and arch (``Compile``), run in parallel on threads or
in worker processes (``run_compiles``), with Ctrl-C stopping the pool cleanly (``_CtrlC``)."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import tempfile
import threading
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import NamedTuple

from ..progress import Progress


class Compile(NamedTuple):
    """One NVRTC compile: ``kernel``'s source for ``arch``, with ``with_ptx`` (an sm_XY compile)
    its PTX kept as the compute_XY binary too, and that PTX assembled by ptxas for the archs of
    ``assembled`` (nvrtc.ASSEMBLED_FROM)."""
    kernel: str
    source: str
    arch: str
    with_ptx: bool = False
    assembled: tuple[str, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        from . import nvrtc

        return nvrtc.targets_of(self.arch, self.with_ptx) + self.assembled


# Up to this many compiles run on threads of the calling process, more in worker processes. NVRTC
# releases the GIL and is thread-safe (the shipped sources compiled for sm_90 on two threads gave
# the same bytes), but two threads on two cores ran 1.6-1.7x one, two processes 1.95x; a spawned
# worker costs 0.7 s to start (a fresh interpreter imports the compiler). With compiles of about
# 0.2 s (a source holds every dtype) break-even is near 35 compiles, and at 64 processes would
# save about 0.6 s: an edit of a few kernels (4 compiles each, one an arch) and the tests' small
# builds take threads, a rebuild takes processes.
THREADED_COMPILES = 64


def _compile(job: Compile, headers: dict[str, str], folder: Path) -> tuple[str, dict[str, bytes]]:
    """``job``'s binaries; ``folder`` (the run's) takes NVRTC's precompiled headers and ptxas's files."""
    from . import nvrtc, ptxas

    binaries = nvrtc.compile_source(job.source, f"kernels/{job.kernel}.cu", job.arch, headers,
                                    [nvrtc.cuda_include_dir()], folder, job.with_ptx or bool(job.assembled))
    ptx = binaries[f"compute_{job.arch.partition('_')[2]}"] if job.assembled else b""
    for arch in job.assembled:
        binaries[arch] = ptxas.assemble(ptx, arch, folder, job.kernel)
    return job.kernel, {target: binaries[target] for target in job.targets}


class _Worker:
    """A compile worker process's settings, set by its pool's initializer."""
    headers: dict[str, str] = {}
    folder: Path = Path()


# Signal masks (POSIX): worker processes start with SIGINT blocked (_sigint_blocked). Not on Windows.
_MASKS_SIGNALS = hasattr(signal, "pthread_sigmask")


def _start_worker(headers: dict[str, str], folder: Path) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    if _MASKS_SIGNALS:  # unblocked once ignored: a Ctrl-C pending from the start is dropped
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _Worker.headers, _Worker.folder = headers, folder


@contextlib.contextmanager
def _sigint_blocked(blocked: bool):
    """SIGINT blocked in this thread while it starts worker processes (ProcessPoolExecutor starts
    them in submit). They inherit the mask through fork and exec, so a Ctrl-C cannot reach one
    before its initializer ignores SIGINT: one still importing the compiler would print a
    KeyboardInterrupt traceback of its own. A Ctrl-C in these milliseconds reaches this process
    as soon as the mask is restored."""
    if not blocked or not _MASKS_SIGNALS:
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _compile_in_worker(job: Compile) -> tuple[str, dict[str, bytes]]:
    return _compile(job, _Worker.headers, _Worker.folder)


def binary_name(kernel: str, target: str) -> str:
    return f"kernels/{kernel}.{target}.{'ptx' if target.startswith('compute_') else 'cubin'}"


def run_compiles(jobs: list[Compile], progress: Progress, headers: dict[str, str]) -> dict[str, bytes]:
    """Run the compiles in parallel, on threads up to THREADED_COMPILES of them, else in worker
    processes; {binary file: bytes}.

    On any way out (done, an NVRTC error, Ctrl-C) the pool takes no more jobs and waits for the
    compiles in flight, under a second each, instead of signalling its workers: a worker stopped
    by a signal inside NVRTC can hang there for good (seen while it used precompiled headers).
    Only a second Ctrl-C during that wait kills them (_CtrlC). Those headers, and ptxas's files,
    go to a folder of this run's, removed with it. Jobs start in order, so the first pending ones
    are those in flight."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    binaries = {}
    in_processes = len(jobs) > THREADED_COMPILES
    # the Ctrl-C handler first: it covers the folder's removal too
    with _CtrlC() as ctrl_c, tempfile.TemporaryDirectory(prefix="fusegen-compile-") as folder:
        if not in_processes:
            pool = ThreadPoolExecutor(workers)
            compile_one = functools.partial(_compile, headers=headers, folder=Path(folder))
        else:
            context = _WorkerContext()
            pool = ProcessPoolExecutor(workers, context, _start_worker, (headers, Path(folder)))
            compile_one = _compile_in_worker
            ctrl_c.workers = context.processes
        try:
            with _sigint_blocked(in_processes):
                pending = {pool.submit(compile_one, job): job for job in jobs}
            while pending and not ctrl_c.pressed:
                done, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                if ctrl_c.pressed:  # a compile that failed since may be its doing: a thread's ptxas gets it too
                    break
                for future in done:
                    kernel, compiled = future.result()  # re-raises a compile's NvrtcError here
                    binaries.update((binary_name(kernel, target), binary) for target, binary in compiled.items())
                    del pending[future]
                in_flight = list(pending.values())[:workers]
                progress.update(len(jobs) - len(pending), [f"{job.kernel}.{job.arch}" for job in in_flight])
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return binaries


class _CtrlC:
    """Ctrl-C (SIGINT) while a pool compiles, taken by a handler of its own instead of Python's,
    which raises KeyboardInterrupt wherever the main thread is, inside concurrent.futures' code
    too: a second Ctrl-C raised inside the pool's shutdown left the pool's thread waiting for a
    worker process that never got the word to stop, and Python's exit waiting for both, for good
    (a third Ctrl-C then printed a traceback and left the workers running).

    The first Ctrl-C sets ``pressed``: the compile loop stops, and the pool takes no more jobs and
    waits for the compiles in flight (under a second each). A second one, during that wait, kills
    the worker processes (SIGKILL: immediate, unlike a signal a worker inside NVRTC may never act
    on); the pool sees them gone and ends at once. Later ones do the same, with nothing left to
    kill. A pool of threads cannot be cut short: its compiles end by themselves. On the way out the
    previous handler is back, and a pressed Ctrl-C is raised as KeyboardInterrupt (over any error
    of a compile it cut short).

    Only Python's own handler in the main thread is replaced: one a caller installed (or SIG_IGN,
    as a background job inherits it) is theirs, and only the main thread may set handlers."""

    def __init__(self):
        self.workers: list[BaseProcess] = []  # a pool of processes' workers, once started
        self.pressed = False
        self.previous = None

    def __enter__(self) -> _CtrlC:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        if self.pressed:
            _kill_workers(self.workers)
        self.pressed = True

    def __exit__(self, *exc_info) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.pressed:
            raise KeyboardInterrupt


class _WorkerContext:
    """multiprocessing's spawn context, keeping each process it makes: a ProcessPoolExecutor makes
    its workers through its context's ``Process``, so ``processes`` lists the pool's workers
    (for _kill_workers) with nothing read from the pool's private state. Spawn, not fork: the
    calling process may run threads (torch's, in tests and notebooks), and a forked child can
    inherit a lock one of them held and hang."""

    def __init__(self):
        self._spawn = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = []

    def Process(self, *args, **kwargs) -> BaseProcess:  # noqa: N802 - the name multiprocessing's contexts use
        process = self._spawn.Process(*args, **kwargs)
        self.processes.append(process)
        return process

    def __getattr__(self, name: str):  # the rest (queues, locks, the start method) is spawn's own
        return getattr(self._spawn, name)


def _kill_workers(workers: list[BaseProcess]) -> None:
    """SIGKILL the pool's worker processes (_WorkerContext.processes). Called from a signal
    handler, which may run while the main thread holds the pool's shutdown lock: so not
    ProcessPoolExecutor's kill_workers (Python 3.14), which takes that lock. A process not started
    yet has no pid; Process.kill only sends the signal, and skips a worker already reaped (the
    pool's own thread reaps them)."""
    for process in list(workers):
        if process.pid is not None:
            process.kill()
