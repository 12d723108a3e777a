"""How a build compiles: an sm_XY compile also gives the compute_XY PTX (the same bytes a compile
for compute_XY gives), so a kernel wanted as both takes one NVRTC compile; NVRTC's speed-only
options change no binary; its precompiled headers go to a folder of the build's, removed after;
a few compiles run on threads, many in worker processes, with the same bytes."""

import json
import tempfile
import textwrap
from pathlib import Path

import pytest

from fusegen import build, nvrtc, output
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
    return nvrtc.compile_source(shipped_source(kernel), f"kernels/{kernel}.cu", target, build.cuda_headers(),
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


def test_one_compile_gives_a_kernels_cubin_and_ptx_and_leaves_no_files(tmp_path, monkeypatch):
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
    run_compiles = build.run_compiles
    monkeypatch.setattr(build, "run_compiles", lambda jobs, *rest: compiled.extend(jobs) or run_compiles(jobs, *rest))
    archs = ("sm_80", "sm_90", "compute_80")
    files = build.build_package(build.Config((spec,), tmp_path / "out", archs=archs, dtypes=("float32",), root=tmp_path))

    kernels = json.loads(files[output.MANIFEST])["kernels"]
    assert sorted((job.kernel, job.arch, job.with_ptx) for job in compiled) == sorted(
        [(kernel, "sm_80", True) for kernel in kernels] + [(kernel, "sm_90", False) for kernel in kernels])
    for kernel, entry in kernels.items():
        assert set(entry["binaries"]) == set(archs)
        # each binary records the compile it came from: the PTX, the sm_80 one
        assert entry["binaries"]["compute_80"]["options"] == entry["binaries"]["sm_80"]["options"] == nvrtc.compile_options("sm_80")
        assert files[entry["binaries"]["compute_80"]["file"]].startswith(b"//")  # PTX text
    assert list(temporary.iterdir()) == []  # the precompiled headers' folder is gone
    assert set(Path("/tmp").glob("__nvrtc_auto_pch_*")) == nvrtc_default


def refuse(*args, **kwargs):
    raise AssertionError("this pool should not have been used")


@pytest.mark.real_nvrtc  # both runs compile (the session's memo would answer the second)
def test_threads_and_worker_processes_give_the_same_binaries(monkeypatch):
    jobs = [build.Compile(kernel, shipped_source(kernel), arch, arch == "sm_80")
            for kernel in KERNELS[:4] for arch in ("sm_80", "sm_90")]
    assert len(jobs) <= build.THREADED_COMPILES
    with monkeypatch.context() as patch:
        patch.setattr(build, "ProcessPoolExecutor", refuse)
        threaded = build.run_compiles(jobs, Progress(), build.cuda_headers())
    assert set(threaded) == {build.binary_name(kernel, target) for kernel in KERNELS[:4]
                             for target in ("sm_80", "compute_80", "sm_90")}
    monkeypatch.setattr(build, "THREADED_COMPILES", len(jobs) - 1)
    monkeypatch.setattr(build, "ThreadPoolExecutor", refuse)
    assert build.run_compiles(jobs, Progress(), build.cuda_headers()) == threaded
