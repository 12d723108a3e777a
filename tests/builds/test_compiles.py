"""How a build compiles: an sm_XY compile also gives the compute_XY PTX (the same bytes a compile
for compute_XY gives), so a kernel wanted as both takes one NVRTC compile, and ptxas assembles
that PTX for the arch's twin (sm_90 from sm_80's, sm_120 from sm_100's) into the machine code
NVRTC's own compile writes; NVRTC's speed-only options change no binary; its precompiled headers
and ptxas's files go to a folder of the build's, removed after; a few compiles run on threads,
many in worker processes, with the same bytes."""

import json
import os
import signal
import tempfile
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

from fusegen import build, output, toolchain
from fusegen.toolchain import jobs as compile_jobs, nvrtc, ptxas
from fusegen.errors import ToolchainError
from fusegen.explain import elf_sections
from fusegen.progress import Progress

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = json.loads((ROOT / "generated" / output.MANIFEST).read_text())["kernels"]
# One shipped kernel of each template, its quickest to compile (each source holds every dtype:
# 16-bit ones with fast math); the elementwise backward's sums a Bias grad.
KERNELS = [next(k for k in sorted(MANIFEST) if k.startswith(prefix))
           for prefix in ("add_fwd_", "bias_bwd_", "rmsnorm_fwd_", "layernorm_bwd_", "column_sum_")]


def shipped_source(kernel):
    return (ROOT / "generated" / MANIFEST[kernel]["source"]).read_text()


def compile_shipped(kernel, target, pch_dir, with_ptx=False):
    return nvrtc.compile_source(shipped_source(kernel), f"kernels/{kernel}.cu", target, toolchain.cuda_headers(),
                                [nvrtc.cuda_include_dir()], pch_dir, with_ptx)


@pytest.mark.parametrize("kernel", KERNELS)
def test_an_sm_compile_gives_the_ptx_of_a_compute_compile(kernel, tmp_path):
    both = compile_shipped(kernel, "sm_80", tmp_path, with_ptx=True)
    assert set(both) == {"sm_80", "compute_80"}
    assert both["compute_80"] == compile_shipped(kernel, "compute_80", tmp_path)["compute_80"]
    assert both["sm_80"] == compile_shipped(kernel, "sm_80", tmp_path)["sm_80"]
    # and the shipped binaries, built with the speed-only options, are the same bytes
    assert both["sm_80"] == (ROOT / "generated" / f"kernels/{kernel}.sm_80.cubin").read_bytes()
    assert both["compute_80"] == (ROOT / "generated" / f"kernels/{kernel}.compute_80.ptx").read_bytes()


def test_speed_options_change_no_binary(tmp_path, monkeypatch):
    """-minimal and --pch only make NVRTC faster: without them, the same bytes."""
    kernel = KERNELS[2]
    fast = compile_shipped(kernel, "sm_90", tmp_path)
    monkeypatch.setattr(nvrtc, "SPEED_OPTIONS", ())
    assert compile_shipped(kernel, "sm_90", tmp_path) == fast


def test_one_compile_gives_a_kernels_cubins_and_ptx_and_leaves_no_files(tmp_path, monkeypatch):
    spec = tmp_path / "small.py"
    spec.write_text(textwrap.dedent("""\
        from fusegen.eager import Sequential, RMSNorm, GELU
        block = Sequential(RMSNorm(64), GELU())
    """))
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    nvrtc_default = set(Path("/tmp").glob("__nvrtc_auto_pch_*"))  # where NVRTC puts them unless told
    compiled = []
    run_compiles = compile_jobs.run_compiles
    monkeypatch.setattr(compile_jobs, "run_compiles",
                        lambda jobs, *rest: compiled.extend(jobs) or run_compiles(jobs, *rest))
    archs = ("sm_80", "sm_90", "compute_80")
    files = build.build_package(build.Config((spec,), tmp_path / "out", archs=archs, dtypes=("float32",), root=tmp_path))

    kernels = json.loads(files[output.MANIFEST])["kernels"]
    # the sm_80 compile gives the compute_80 PTX, and ptxas assembles it for sm_90 (nvrtc.ASSEMBLED_FROM)
    assert sorted(compiled) == sorted(toolchain.Compile(kernel, files[f"kernels/{kernel}.cu"].decode(), "sm_80", True,
                                                    ("sm_90",)) for kernel in kernels)
    for kernel, entry in kernels.items():
        records = entry["binaries"]
        assert set(records) == set(archs)
        # each binary records the compile it came from, and sm_90's the ptxas run too
        for target in archs:
            assert records[target]["options"] == nvrtc.compile_options("sm_80")
        assert records["sm_90"]["ptxas"] == {"version": ptxas.version(), "options": ["-arch=sm_90"]}
        assert "ptxas" not in records["sm_80"] and "ptxas" not in records["compute_80"]
        assert files[records["compute_80"]["file"]].startswith(b"//")  # PTX text
    assert list(temporary.iterdir()) == []  # the folder of the precompiled headers and ptxas's files is gone
    assert set(Path("/tmp").glob("__nvrtc_auto_pch_*")) == nvrtc_default


def refuse(*args, **kwargs):
    raise AssertionError("this pool should not have been used")


@pytest.mark.real_nvrtc  # both runs compile (the session's memo would answer the second)
def test_threads_and_worker_processes_give_the_same_binaries(monkeypatch):
    jobs = [toolchain.Compile(kernel, shipped_source(kernel), arch, arch == "sm_80")
            for kernel in KERNELS[:4] for arch in ("sm_80", "sm_90")]
    jobs.append(toolchain.Compile(KERNELS[0], shipped_source(KERNELS[0]), "sm_100", assembled=("sm_120",)))
    assert len(jobs) <= compile_jobs.THREADED_COMPILES
    with monkeypatch.context() as patch:
        patch.setattr(compile_jobs, "ProcessPoolExecutor", refuse)
        threaded = compile_jobs.run_compiles(jobs, Progress(), toolchain.cuda_headers())
    assert set(threaded) == {toolchain.binary_name(kernel, target) for kernel in KERNELS[:4]
                             for target in ("sm_80", "compute_80", "sm_90")} | {
        toolchain.binary_name(KERNELS[0], target) for target in ("sm_100", "sm_120")}
    assert threaded[toolchain.binary_name(KERNELS[0], "sm_120")] == (
        ROOT / "generated" / f"kernels/{KERNELS[0]}.sm_120.cubin").read_bytes()
    monkeypatch.setattr(compile_jobs, "THREADED_COMPILES", len(jobs) - 1)
    monkeypatch.setattr(compile_jobs, "ThreadPoolExecutor", refuse)
    assert compile_jobs.run_compiles(jobs, Progress(), toolchain.cuda_headers()) == threaded


def test_the_worker_context_lists_the_pools_processes_and_a_second_ctrl_c_kills_them():
    """A second Ctrl-C kills the worker processes _WorkerContext recorded (_CtrlC): they must be
    the ones the pool runs its jobs in, all of them."""
    context = compile_jobs._WorkerContext()
    pool = ProcessPoolExecutor(2, context)
    try:
        futures = [pool.submit(os.getpid) for _ in range(4)]  # the first two submits start a worker each
        ran_in = {future.result(timeout=60) for future in futures}
        assert len(context.processes) == 2 and ran_in <= {process.pid for process in context.processes}
        compile_jobs._kill_workers(context.processes)
        for process in context.processes:
            process.join(timeout=30)
            # the pool's own thread reaps a dead worker too: where it does so first, this join
            # returns before that thread has recorded the exit code (waitpid raced), so wait for it
            deadline = time.monotonic() + 30
            while process.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert process.exitcode == -signal.SIGKILL
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("arch, twin", sorted(nvrtc.ASSEMBLED_FROM.items()))
def test_an_assembled_shipped_cubin_holds_the_machine_code_of_nvrtcs_own_compile(arch, twin, tmp_path):
    """sm_90 and sm_120 are assembled by ptxas from the PTX of the sm_80 and sm_100 compiles
    (nvrtc.ASSEMBLED_FROM): each section of such a cubin is the one NVRTC's own compile for the arch
    writes, but the toolkit note, which names the build of the ptxas that wrote it (NVRTC's own, or
    the pinned executable). One kernel of each template."""
    for kernel in KERNELS:
        shipped = elf_sections((ROOT / "generated" / f"kernels/{kernel}.{arch}.cubin").read_bytes())
        own = elf_sections(compile_shipped(kernel, arch, tmp_path)[arch])
        assert set(shipped) == set(own) and any(name.startswith(".text.") for name in own)
        assert [name for name in own if own[name] != shipped[name]] == [".note.nv.tkinfo"], kernel
        assert b"ptxas\0Cuda compilation tools, release 13.0, V13.0.88" in shipped[".note.nv.tkinfo"]
        record = MANIFEST[kernel]["binaries"][arch]
        assert record["options"] == nvrtc.compile_options(twin)
        assert record["ptxas"] == {"version": "13.0.88", "options": [f"-arch={arch}"]}


def test_ptxas_assembles_the_shipped_sm_120_cubin_from_the_sm_100_compiles_ptx(tmp_path):
    kernel = KERNELS[2]
    sm_100 = compile_shipped(kernel, "sm_100", tmp_path, with_ptx=True)
    assert b"\n.target sm_100\n" in sm_100["compute_100"]
    work = tmp_path / "work"
    work.mkdir()
    assembled = ptxas.assemble(sm_100["compute_100"], "sm_120", work, kernel)
    assert assembled == (ROOT / "generated" / f"kernels/{kernel}.sm_120.cubin").read_bytes()
    assert list(work.iterdir()) == []  # its PTX and cubin files are removed


def test_a_ptxas_failure_is_a_toolchain_error_with_its_log(tmp_path):
    with pytest.raises(ToolchainError, match=r"k: ptxas failed for sm_120 \(exit \d+\):\n.*(?i:error)"):
        ptxas.assemble(b".version 9.0\n.target sm_100\n.address_size 64\nnot ptx;\n", "sm_120", tmp_path, "k")
    with pytest.raises(ToolchainError, match="k: the PTX NVRTC wrote has 0 .target lines, not one"):
        ptxas.assemble(b".version 9.0\n", "sm_120", tmp_path, "k")
    assert list(tmp_path.iterdir()) == []


PROBE_KERNEL = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }\n'


@pytest.mark.parametrize("source, header, tests_arch", [
    ('#include "probe.cuh"\n' + PROBE_KERNEL, "#pragma once\n", False),
    ('#include "probe.cuh"\n#if __CUDA_ARCH__ >= 900\n#endif\n' + PROBE_KERNEL, "#pragma once\n", True),
    ('#include "probe.cuh"\n' + PROBE_KERNEL, "#pragma once\n#if __CUDA_ARCH__ >= 1200\n#define WIDE 1\n#endif\n",
     True),
    ('#include "probe.cuh"\n' + PROBE_KERNEL,
     "#pragma once\n#include <nv/target>\nNV_IF_TARGET(NV_PROVIDES_SM_90, (), ())\n", True),
], ids=["plain", "arch-test-in-source", "arch-test-in-header", "nv-target-in-header"])
def test_an_arch_comes_from_its_twins_compile_unless_the_kernel_tests_the_arch(source, header, tests_arch, tmp_path,
                                                                                monkeypatch):
    (tmp_path / "probe.cuh").write_text(header)
    headers = {**toolchain.header_files(), "probe.cuh": tmp_path / "probe.cuh"}
    jobs = []

    def run_compiles(batch, progress, texts):  # what the compiles would give, without NVRTC
        jobs.extend(batch)
        return {toolchain.binary_name(job.kernel, target): f"{job.arch}->{target}".encode()
                for job in batch for target in job.targets}

    monkeypatch.setattr(compile_jobs, "run_compiles", run_compiles)
    archs = ("sm_80", "sm_90", "sm_100", "sm_120", "compute_80")
    files, manifest = toolchain.compile_kernels({"k": source}, archs, None, Progress(), headers)
    records = manifest["k"]["binaries"]
    if not tests_arch:
        assert jobs == [toolchain.Compile("k", source, "sm_80", True, assembled=("sm_90",)),
                        toolchain.Compile("k", source, "sm_100", assembled=("sm_120",))]
        for arch, twin in nvrtc.ASSEMBLED_FROM.items():
            assert files[f"kernels/k.{arch}.cubin"] == f"{twin}->{arch}".encode()
            assert records[arch]["options"] == nvrtc.compile_options(twin)
            assert records[arch]["ptxas"] == {"version": ptxas.version(), "options": [f"-arch={arch}"]}
    else:  # compiled for each arch by itself
        assert jobs == [toolchain.Compile("k", source, arch, arch == "sm_80") for arch in archs[:4]]
        for arch in nvrtc.ASSEMBLED_FROM:
            assert files[f"kernels/k.{arch}.cubin"] == f"{arch}->{arch}".encode()
            assert records[arch]["options"] == nvrtc.compile_options(arch) and "ptxas" not in records[arch]


def test_an_assembled_binary_is_reused_only_if_its_ptxas_record_matches(tmp_path, monkeypatch):
    jobs = []

    def run_compiles(batch, progress, texts):
        jobs.extend(batch)
        return {toolchain.binary_name(job.kernel, target): f"{job.arch}->{target}".encode()
                for job in batch for target in job.targets}

    monkeypatch.setattr(compile_jobs, "run_compiles", run_compiles)
    source, archs, out = '#include "common.cuh"\n' + PROBE_KERNEL, ("sm_100", "sm_120"), tmp_path / "out"

    def build_into_out():
        files, manifest = toolchain.compile_kernels({"k": source}, archs, out if out.is_dir() else None, Progress())
        output.write_package({**files, output.MANIFEST: output.manifest_bytes(
            {"generator": "fusegen", "kernels": manifest, "files": sorted([*files, output.MANIFEST])})}, out)

    build_into_out()
    assert jobs == [toolchain.Compile("k", source, "sm_100", assembled=("sm_120",))]
    jobs.clear()
    build_into_out()
    assert jobs == []  # every binary reused
    written = json.loads((out / output.MANIFEST).read_text())
    written["kernels"]["k"]["binaries"]["sm_120"]["ptxas"]["version"] = "12.9.86"  # as if another ptxas wrote it
    (out / output.MANIFEST).write_text(json.dumps(written))
    build_into_out()
    # sm_120 is assembled again from a new sm_100 compile, whose cubin the build already had
    assert jobs == [toolchain.Compile("k", source, "sm_100", assembled=("sm_120",))]
