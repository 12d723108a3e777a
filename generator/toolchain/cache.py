"""Kernel binaries for a build: each compiled, or reused from the previous output package.

A binary is reused instead of recompiled when the previous MANIFEST.json records, for its kernel,
the same source sha256, the same digest of every header the source includes (transitively:
``headers.included_headers``), the same NVRTC version and options, and the binary's sha256
(verified first). So an edit to activations.cuh recompiles the elementwise kernels only, never the
norms. The records it returns are the kernels' entries of the new MANIFEST.json.
"""

from __future__ import annotations

from pathlib import Path

from ..console import counted
from ..output import read_manifest
from ..progress import Progress
from . import jobs
from .headers import arch_testing_headers, cuda_headers, included_headers, sha256
from .jobs import Compile, binary_name


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
    files, compiles, stale_count = {}, [], 0
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
            compiles.append(Compile(kernel, source, arch, with_ptx=any(t.startswith("compute_") for t in targets),
                                assembled=tuple(t for t in targets if t.startswith("sm_") and t != arch)))
    if compiles:
        assembled = sum(len(job.assembled) for job in compiles)
        by_ptxas = f", {assembled} of them assembled from their PTX by ptxas" if assembled else ""
        progress.start(len(compiles), f"compiling {counted(stale_count, 'kernel binary', 'kernel binaries')} in "
                                      f"{counted(len(compiles), 'compile')} with NVRTC {version}{by_ptxas} "
                                      f"({len(sources) * len(archs) - stale_count} reused)")
        try:
            compiled = jobs.run_compiles(compiles, progress, cuda_headers(headers))
        finally:
            progress.finish()
        # a compile for a stale compute_XY or assembled arch also gives its sm_XY cubin, which may
        # have been reused
        files.update((name, binary) for name, binary in compiled.items() if name not in files)
    for kernel, entry in manifest.items():
        for target, record in entry["binaries"].items():
            record["sha256"] = sha256(files[record["file"]])
    return files, manifest
