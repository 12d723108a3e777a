"""The whole compile: spec files → pipelines → plans → files of the output package.

``build_package`` returns the complete output set as {relative path: bytes}, MANIFEST.json
included (it lists every file, which is what fusegen owns in the output folder; see output.py for
how it is written). Kernel binaries are reused from the existing package instead of recompiled
when its MANIFEST.json records, for that kernel, the same source sha256, the same digest of every
header the source includes (transitively: ``included_headers``), the same NVRTC version and
options, and the binary's sha256 (verified first). So an edit to activations.cuh recompiles the
elementwise kernels only, never the norms.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import multiprocessing
import os
import re
import signal
import tempfile
import threading
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

from . import emit, ops, plugins, stages
from . import kernels as kn
from .config import Config
from .console import counted
from .errors import UsageError
from .frontend import SequentialSpec, parse_spec_file
from .names import NameTable
from .output import MANIFEST, manifest_bytes, read_manifest
from .pipeline import build_pipeline
from .plan import Plan, Rule, plan_pipeline
from .progress import Progress
from .wrap import wrap_python

CUDA_HEADERS = emit.TEMPLATES / "cuda"
# `#include "name"` or `#include <name>` at the start of a line (the templates write no other form).
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>)', re.MULTILINE)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def display(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.name


def plan_specs(specs: Iterable[SequentialSpec], names: NameTable, forward_rules: Sequence[Rule],
               backward_rules: Sequence[Rule], features: dict[str, tuple[int, ...]] | None = None) -> list[Plan]:
    """Pipelines and plans for parsed specs, each name claimed in ``names`` (one table per build,
    so names collide across files too). The whole path from a parsed file to its plans.
    ``features``: input sizes to specialise size-generic pipelines for, by name."""
    plans = []
    for spec in specs:
        names.claim(spec.name, spec.name_location)
        pipeline = build_pipeline(spec, (features or {}).get(spec.name, ()))
        plans.append(plan_pipeline(pipeline, forward_rules, backward_rules))
    return plans


def check_features(config: Config, plans: list[Plan]) -> None:
    """Each [tool.fusegen.pipelines.<name>] names a size-generic pipeline of the specs, and its
    sizes are ones the pipeline accepts. Spec files named on the command line may be a part of
    the project's: a table naming a pipeline they do not hold is then for another file."""
    where = f"{config.source}: [tool.fusegen.pipelines"
    pipelines = {plan.pipeline.name: plan.pipeline for plan in plans}
    for name, sizes in config.features:
        pipeline = pipelines.get(name)
        if pipeline is None and config.specs_named_on_command_line:
            continue
        if pipeline is None:
            close = difflib.get_close_matches(name, pipelines, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"pipelines: {', '.join(sorted(pipelines))}"
            raise UsageError(f"{where}.{name}] names no pipeline of the specs; {hint}")
        if not pipeline.generic:
            raise UsageError(f"{where}.{name}] features: pipeline '{name}' ({pipeline.location}) has a fixed "
                             f"input size, {pipeline.in_features}; features is for pipelines in which no op "
                             "fixes the size. Remove the table")
        odd = [n for n in sizes if n % pipeline.divisor]
        if odd:
            raise UsageError(f"{where}.{name}] features: {odd[0]} is not a multiple of {pipeline.divisor}, "
                             f"which pipeline '{name}' needs (each GLU halves the size); give sizes it accepts")


def load_plans(config: Config) -> list[Plan]:
    """The plans of the config's specs, with its plugins loaded while planning."""
    with plugins.loaded(config.plugins, config.root) as ext:
        return plans_with(config, ext)


def plans_with(config: Config, ext: plugins.Extensions) -> list[Plan]:
    plans: list[Plan] = []
    names = NameTable()  # pipeline names become module and class names of one package
    features = dict(config.features)
    for path in config.specs:
        specs = parse_spec_file(path, display(path, config.root))
        plans.extend(plan_specs(specs, names, ext.forward_rules, ext.backward_rules, features))
    check_features(config, plans)
    return plans


def collect_kernels(plans: list[Plan]) -> tuple[dict[str, kn.KernelSpec], dict[str, dict]]:
    """Unique kernels by name (a name fixes the source), and each plan's stage → kernels map."""
    unique: dict[str, kn.KernelSpec] = {}
    per_plan = {}
    for plan in plans:
        stage_kernels = stages.stage_kernels(plan)
        per_plan[plan.pipeline.name] = stage_kernels
        for specs in stage_kernels.values():
            for spec in specs:
                if unique.setdefault(spec.name, spec) != spec:
                    raise AssertionError(f"two different kernels are both named {spec.name}")
    return dict(sorted(unique.items())), per_plan


def op_name(spec: kn.KernelSpec, sources: dict[str, str]) -> str:
    """The torch.library op of one kernel's launcher (in the "fusegen" namespace): its name and a
    digest of its CUDA source, so packages that hold the same kernel share its op, a kernel that
    changes gets a new one (two packages never register different kernels under one name), and
    a change to one kernel changes no other launcher's lines."""
    return f"{spec.name}_{sha256(sources[spec.name].encode())[:8]}"


def fixed_sizes(unique: dict[str, kn.KernelSpec]) -> dict[str, list[kn.KernelSpec]]:
    """{size-generic kernel: the package's fixed-size kernels of the same run, by width}: a
    size-generic launcher dispatches to them (a fixed-size pipeline's kernel counts too: same ops,
    same constants, so the same computation)."""
    fixed: dict[str, list[kn.KernelSpec]] = {}
    for spec in unique.values():
        generic = spec.ctx.get("generic_name")
        if generic is not None and not spec.ctx["generic"] and generic in unique:
            fixed.setdefault(generic, []).append(spec)
    return {name: sorted(specs, key=lambda s: s.ctx["width"]) for name, specs in fixed.items()}


def by_dtype(size, dtypes: tuple[str, ...]) -> str:
    """``{torch.<dtype>: size(itemsize), ...}`` as a Python dict literal (torch's dtype names)."""
    return "{" + ", ".join(f"torch.{dtype}: {size(kn.DTYPES[dtype][2])}" for dtype in dtypes) + "}"


def geometry(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> str:
    """The spec's per-dtype launch constant (KernelSpec.launch_size) as a dict literal; "" when
    the launch does not depend on the dtype."""
    if any(spec.launch_size(kn.DTYPES[dtype][2]) is None for dtype in dtypes):
        return ""
    return by_dtype(spec.launch_size, dtypes)


def row_vectors(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> str:
    """A column-tiled backward's vectors a row per dtype (KernelSpec.row_vectors) as a dict
    literal; "" for every other kernel."""
    return by_dtype(spec.row_vectors, dtypes) if spec.ctx.get("column_tiled") else ""


def few_rows(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> str:
    """The dtypes whose kernel has a ``_few_rows`` entry (KernelSpec.few_rows) as a Python tuple
    literal; "" when none has."""
    having = [f"torch.{dtype}" for dtype in dtypes if spec.few_rows(kn.DTYPES[dtype][2])]
    return f"({', '.join(having)},)" if having else ""


def cuda_source(spec: kn.KernelSpec, dtypes: tuple[str, ...], env) -> str:
    """One kernel's CUDA source: its family template instantiated for each dtype, in one
    translation unit (templates/kernel_source.cu.j2)."""
    family = env.get_template(f"{spec.family}.cu.j2")
    bodies = [(kn.DTYPES[dtype][0], family.render(**spec.template_context(dtype)).strip("\n")) for dtype in dtypes]
    return env.get_template("kernel_source.cu.j2").render(spec=spec, bodies=bodies)


def kernel_details(spec: kn.KernelSpec, dtypes: tuple[str, ...]) -> dict:
    """A kernel's full (uncut) name, specialisation and entry points (its binaries' functions,
    by dtype) for MANIFEST.json."""
    entries = {}
    for dtype in dtypes:
        suffix, _, itemsize = kn.DTYPES[dtype]
        symbol = f"{spec.name}_{suffix}"
        entries[suffix] = [symbol, *([f"{symbol}_few_rows"] if spec.few_rows(itemsize) else [])]
    return {"full_name": spec.full_name, "specialisation": spec.summary, "entries": entries}


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
            # spawn, not fork: the calling process may run threads (torch's, in tests and
            # notebooks), and a forked child can inherit a lock one of them held and hang
            pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), _start_worker,
                                       (headers, Path(folder)))
            compile_one = _compile_in_worker
        ctrl_c.pool = pool
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
        self.pool: ProcessPoolExecutor | ThreadPoolExecutor | None = None  # set once started
        self.pressed = False
        self.previous = None

    def __enter__(self) -> _CtrlC:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        if self.pressed:
            _kill_workers(self.pool)
        self.pressed = True

    def __exit__(self, *exc_info) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.pressed:
            raise KeyboardInterrupt


def _kill_workers(pool: ProcessPoolExecutor | ThreadPoolExecutor | None) -> None:
    """SIGKILL ``pool``'s worker processes, if it has any. Called from a signal handler, which may
    run while the main thread holds the pool's shutdown lock: so not ProcessPoolExecutor's
    kill_workers (Python 3.14), which takes that lock, but its table of processes (private, and
    the same from Python 3.9 to 3.14; None once the pool is shut down). Process.kill only sends
    the signal (a reaped worker is skipped); the pool's own thread reaps them."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()


def compile_kernels(sources: dict[str, str], archs: tuple[str, ...], previous: Path | None,
                    progress: Progress, headers: dict[str, Path] | None = None) -> tuple[dict[str, bytes], dict]:
    """Compile every (kernel, arch), reusing matching binaries from a previous output package.

    A binary is reused only when the previous MANIFEST.json records for its kernel the same source
    sha256 and header digests (``included_headers``), and for the binary the same NVRTC version
    and options (and ptxas's, for one it assembled), and the file's sha256 matches."""
    manifest = {kernel: {"source": f"kernels/{kernel}.cu", "source_sha256": sha256(source.encode()),
                         "headers": included_headers(source, f"kernels/{kernel}.cu", headers), "binaries": {}}
                for kernel, source in sources.items()}
    if not archs:  # a CPU-only package: sources, no binaries
        return {}, manifest
    from . import nvrtc, ptxas

    version = nvrtc.nvrtc_version()
    nvrtc.cuda_include_dir()  # fail before compiling anything when the headers are missing
    # and when ptxas is: an arch of the build may be assembled from another's PTX
    assembler = ptxas.version() if any(nvrtc.ASSEMBLED_FROM.get(a) in archs for a in archs) else None
    testing_headers = arch_testing_headers(headers)
    prior_manifest = read_manifest(previous) if previous is not None else None
    old = prior_manifest.get("kernels", {}) if prior_manifest is not None else {}
    files, jobs, stale_count = {}, [], 0
    for kernel, source in sources.items():
        entry = manifest[kernel]
        prior = old.get(kernel, {})
        key = ("source_sha256", "headers")  # the text it is compiled from
        same_text = {k: prior.get(k) for k in key} == {k: entry[k] for k in key}
        # no arch's binary comes from another's PTX when the kernel tests the arch it is built for
        arch_tested = bool(nvrtc.TESTS_ARCH.search(source)) or not testing_headers.isdisjoint(entry["headers"])
        stale: dict[str, list[str]] = {}  # arch of a compile to make -> the stale targets it gives
        for target in archs:
            name = binary_name(kernel, target)
            arch = nvrtc.compiled_with(target, archs, arch_tested)
            record = {"file": name, "nvrtc": version, "options": nvrtc.compile_options(arch)}
            if target.startswith("sm_") and target != arch:  # assembled from the PTX of arch's compile
                record["ptxas"] = {"version": assembler, "options": ptxas.options(target)}
            prior_bin = prior.get("binaries", {}).get(target, {})
            path = previous / name if previous is not None else None
            how = ("nvrtc", "options", "ptxas")
            if (same_text and path is not None and path.is_file()
                    and {k: prior_bin.get(k) for k in how} == {k: record.get(k) for k in how}
                    and sha256(path.read_bytes()) == prior_bin.get("sha256")):
                files[name] = path.read_bytes()
            else:
                stale.setdefault(arch, []).append(target)
            entry["binaries"][target] = record
        for arch, targets in stale.items():
            stale_count += len(targets)
            # a target other than the compile's own arch is its PTX, or assembled from it (compiled_with)
            jobs.append(Compile(kernel, source, arch, with_ptx=any(t.startswith("compute_") for t in targets),
                                assembled=tuple(t for t in targets if t.startswith("sm_") and t != arch)))
    if jobs:
        assembled = sum(len(job.assembled) for job in jobs)
        by_ptxas = f", {assembled} of them assembled from their PTX by ptxas" if assembled else ""
        progress.start(len(jobs), f"compiling {counted(stale_count, 'kernel binary', 'kernel binaries')} in "
                                  f"{counted(len(jobs), 'compile')} with NVRTC {version}{by_ptxas} "
                                  f"({len(sources) * len(archs) - stale_count} reused)")
        try:
            compiled = run_compiles(jobs, progress, cuda_headers(headers))
        finally:
            progress.finish()
        # a compile for a stale compute_XY or assembled arch also gives its sm_XY cubin, which may
        # have been reused
        files.update((name, binary) for name, binary in compiled.items() if name not in files)
    for kernel, entry in manifest.items():
        for target, record in entry["binaries"].items():
            record["sha256"] = sha256(files[record["file"]])
    return files, manifest


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


def plan_documents(config: Config) -> dict[str, str]:
    """{pipeline: its plan.md text}, without compiling anything (`fusegen plan`)."""
    with plugins.loaded(config.plugins, config.root) as ext:
        plans = plans_with(config, ext)
        _, per_plan = collect_kernels(plans)
        env = emit.environment()
        return {plan.pipeline.name: env.get_template("plan.md.j2").render(
            **emit.pipeline_context(plan, per_plan[plan.pipeline.name])) for plan in plans}


def build_package(config: Config, progress: Progress | None = None, reuse: bool = True,
                  before_compiling: Callable[[set[str]], None] | None = None) -> dict[str, bytes]:
    """The complete output set; ``reuse`` lets matching binaries of the existing package stand.
    ``before_compiling`` is given the names of every file of the set before the first compile (the
    CLI refuses there to overwrite a file fusegen did not write, not minutes later)."""
    with plugins.loaded(config.plugins, config.root) as ext:
        return _build(config, ext, progress or Progress(), reuse, before_compiling)


def _build(config: Config, ext: plugins.Extensions, progress: Progress, reuse: bool,
           before_compiling: Callable[[set[str]], None] | None) -> dict[str, bytes]:
    plans = plans_with(config, ext)
    unique, per_plan = collect_kernels(plans)
    headers = header_files(ext.headers)
    env = emit.environment()
    files: dict[str, str | bytes] = {}
    sources = {name: cuda_source(spec, config.dtypes, env) for name, spec in unique.items()}
    details = {name: kernel_details(spec, config.dtypes) for name, spec in unique.items()}
    for name, source in sources.items():
        files[f"kernels/{name}.cu"] = source
    shipped = {name for source in sources.values() for name in included_headers(source, "", headers)}
    for name, path in headers.items():  # shipped so the sources rebuild as they stand
        if name not in ext.headers or name in shipped:
            files[f"kernels/{name}"] = path.read_text()
    launchers = [dict(name=s.name, op=op_name(s, sources), family=s.family, ctx=s.ctx, summary=s.summary,
                      geometry=geometry(s, config.dtypes), few_rows=few_rows(s, config.dtypes),
                      row_vectors=row_vectors(s, config.dtypes),
                      params=kn.kernel_abi(s), shared=s.shared_bytes, **kn.launcher_io(s))
                 for s in unique.values()]
    files["_kernels.py"] = env.get_template("kernels.py.j2").render(
        kernels=launchers, fixed=fixed_sizes(unique), sums_in_kernel_splits=kn.SUMS_IN_KERNEL_SPLITS,
        column_tiled_rows=kn.COLUMN_TILED_ROWS, column_tile_lanes=kn.COLUMN_TILE_LANES)
    for module in sorted((emit.TEMPLATES / "runtime").glob("*.py")):  # the runtime, a package of modules
        files[f"_runtime/{module.name}"] = module.read_text()
    files["_reference.py"] = ops.reference_source()  # the ops' reference math, copied by source
    for plan in plans:
        ctx = emit.pipeline_context(plan, per_plan[plan.pipeline.name])
        files[f"{plan.pipeline.name}.py"] = env.get_template("pipeline.py.j2").render(**ctx)
        files[f"{plan.pipeline.name}.plan.md"] = env.get_template("plan.md.j2").render(**ctx)
    files["__init__.py"] = env.get_template("package_init.py.j2").render(
        pipelines=[p.pipeline for p in plans], dtypes=config.dtypes, archs=config.archs)
    if before_compiling is not None:
        before_compiling({*files, *(binary_name(kernel, target) for kernel in sources for target in config.archs),
                          MANIFEST})
    previous = config.out if reuse and config.out.is_dir() else None
    binaries, manifest = compile_kernels(sources, config.archs, previous, progress, headers)
    for name, entry in manifest.items():
        entry.update(details[name])
    files.update(binaries)
    files[MANIFEST] = manifest_bytes({
        "generator": "fusegen", "archs": list(config.archs), "dtypes": list(config.dtypes),
        "kernels": manifest, "files": sorted(files),
    })
    for name, text in files.items():  # every Python file at most 100 columns wide
        if name.endswith(".py"):
            files[name] = wrap_python(text)
    return {k: v.encode() if isinstance(v, str) else v for k, v in sorted(files.items())}
