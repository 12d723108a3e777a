"""The build cache: a kernel binary is reused only when its source, the headers it includes
(transitively), the NVRTC version and options, and the binary itself all match the previous
MANIFEST.json, so an edit to one header recompiles only the kernels that include it."""

import json
import shutil
import textwrap

import pytest

from fusegen import build, output, toolchain
from fusegen.toolchain import jobs as compile_jobs
from fusegen.toolchain.headers import CUDA_HEADERS

SPEC = textwrap.dedent("""\
    from fusegen.eager import Sequential, RMSNorm, Linear, GELU, AddExtraInput, MakeExtraOutput
    block = Sequential(AddExtraInput(), MakeExtraOutput(), RMSNorm(64), Linear(64, 128), GELU())
""")
# What each kernel family's source includes, directly or through another header.
# A backward that may add its own parameter grads (every norm backward: norm.cuh includes
# column_sum.cuh; here bias_gelu_bwd) includes column_sum.cuh.
FAMILY_HEADERS = {"norm": {"norm.cuh", "amax.cuh", "column_sum.cuh", "common.cuh"},
                  "column_sum": {"column_sum.cuh", "common.cuh"},
                  "elementwise": {"activations.cuh", "common.cuh"},
                  "elementwise_sums": {"activations.cuh", "column_sum.cuh", "common.cuh"}}


def family(kernel):
    if "norm_" in kernel:
        return "norm"
    if kernel.startswith("bias_gelu_bwd_"):
        return "elementwise_sums"
    return "column_sum" if kernel.startswith("column_sum_") else "elementwise"


def _config(root):
    return build.Config((root / "small.py",), root / "out", archs=("sm_90",), dtypes=("float32",), root=root)


@pytest.fixture(scope="module")
def first_build(tmp_path_factory):
    """The package's first build, compiled once for the module's tests (NVRTC is most of a build)."""
    root = tmp_path_factory.mktemp("first_build")
    (root / "small.py").write_text(SPEC)
    output.write_package(build.build_package(_config(root)), root / "out")
    return root / "out"


@pytest.fixture
def package(tmp_path, monkeypatch, first_build):
    """A written package built from a copy of templates/cuda (which the test may edit), and the
    (kernel, target) of every binary each later build_package compiles. The package starts as
    the first build's copy, which a build here then owns and reuses whole."""
    headers = tmp_path / "cuda"
    shutil.copytree(CUDA_HEADERS, headers)
    monkeypatch.setattr("fusegen.toolchain.headers.CUDA_HEADERS", headers)
    (tmp_path / "small.py").write_text(SPEC)
    config = _config(tmp_path)
    shutil.copytree(first_build, config.out)
    output.write_package(build.build_package(config), config.out)

    compiled = []
    run_compiles = compile_jobs.run_compiles

    def counting(jobs, progress, headers):  # jobs run in worker processes: count them here, in the parent
        compiled.extend((job.kernel, job.arch) for job in jobs)
        return run_compiles(jobs, progress, headers)

    monkeypatch.setattr(compile_jobs, "run_compiles", counting)
    return config, headers, compiled


def kernels_of(files):
    return json.loads(files[output.MANIFEST])["kernels"]


def test_manifest_records_each_kernels_own_headers(package):
    config, headers, _ = package
    manifest = json.loads((config.out / output.MANIFEST).read_text())
    assert "cuda_headers" not in manifest  # no global digest: each kernel records its own
    assert {family(s) for s in manifest["kernels"]} == set(FAMILY_HEADERS)
    for kernel, entry in manifest["kernels"].items():
        assert set(entry["headers"]) == FAMILY_HEADERS[family(kernel)], kernel
        for name, digest in entry["headers"].items():
            assert digest == toolchain.sha256((headers / name).read_bytes())
    # the headers still ship beside the sources, so they rebuild as they stand
    assert {p.name for p in (config.out / "kernels").glob("*.cuh")} == {p.name for p in headers.glob("*.cuh")}


def test_nothing_changed_compiles_nothing(package):
    config, _, compiled = package
    files = build.build_package(config)
    assert compiled == []
    assert output.stale_files(files, config.out) == []


@pytest.mark.parametrize("header,families", [
    ("activations.cuh", {"elementwise", "elementwise_sums"}),
    ("norm.cuh", {"norm"}),
    ("amax.cuh", {"norm"}),  # (an FP8 GEMM's x: the norm's _amax variant; none here is elementwise's)
    ("column_sum.cuh", {"column_sum", "norm", "elementwise_sums"}),
    ("common.cuh", {"norm", "column_sum", "elementwise", "elementwise_sums"}),  # included by every other header
])
def test_a_header_edit_recompiles_only_the_kernels_that_include_it(package, header, families):
    config, headers, compiled = package
    before = kernels_of({output.MANIFEST: (config.out / output.MANIFEST).read_bytes()})
    with open(headers / header, "a") as f:
        f.write("// an edit\n")

    files = build.build_package(config)
    after = kernels_of(files)
    expected = {(s, "sm_90") for s in after if family(s) in families}
    assert expected and sorted(compiled) == sorted(expected)
    for kernel, entry in after.items():  # the new digest is recorded where the header is included
        changed = {n for n in entry["headers"] if entry["headers"][n] != before[kernel]["headers"][n]}
        assert changed == ({header} if family(kernel) in families else set()), kernel

    compiled.clear()
    assert build.build_package(config, reuse=False) == files  # reusing gives a from-scratch build's bytes
    assert len(compiled) == len(after)
    output.write_package(files, config.out)
    compiled.clear()
    build.build_package(config)
    assert compiled == []  # and the next build reuses everything again


def test_a_binary_is_reused_only_if_its_record_matches(package):
    config, _, compiled = package
    manifest = json.loads((config.out / output.MANIFEST).read_text())
    norm = next(s for s in manifest["kernels"] if s.startswith("add_rmsnorm_fwd"))
    gelu = next(s for s in manifest["kernels"] if s.startswith("gelu_fwd"))
    column_sum = next(s for s in manifest["kernels"] if s.startswith("column_sum_"))
    manifest["kernels"][norm]["headers"]["norm.cuh"] = "0" * 64  # as if compiled from another norm.cuh
    del manifest["kernels"][gelu]["headers"]  # a manifest from before per-kernel headers
    manifest["kernels"][column_sum]["binaries"]["sm_90"]["nvrtc"] = "12.9"
    (config.out / output.MANIFEST).write_text(json.dumps(manifest))
    build.build_package(config)
    assert sorted(compiled) == sorted([(norm, "sm_90"), (gelu, "sm_90"), (column_sum, "sm_90")])


def test_includes_are_followed_through_headers(tmp_path, monkeypatch):
    monkeypatch.setattr("fusegen.toolchain.headers.CUDA_HEADERS", tmp_path)
    (tmp_path / "a.cuh").write_text('#pragma once\n  #  include "b.cuh"\n#include <cuda_fp16.h>\n')
    (tmp_path / "b.cuh").write_text("#pragma once\n#include <a.cuh>\n")  # NVRTC finds <a.cuh> in templates/cuda too
    (tmp_path / "unused.cuh").write_text("#pragma once\n")
    digests = toolchain.included_headers('#include "a.cuh"\n// #include "unused.cuh"\n', "kernels/k.cu")
    assert digests == {name: toolchain.sha256((tmp_path / name).read_bytes()) for name in ("a.cuh", "b.cuh")}
    assert list(digests) == sorted(digests)


@pytest.mark.parametrize("source,where", [
    ('#include "missing.cuh"\n', "kernels/k.cu"),
    ('#include "a.cuh"\n', "templates/cuda/a.cuh"),
])
def test_a_missing_header_is_a_clear_error(tmp_path, monkeypatch, source, where):
    monkeypatch.setattr("fusegen.toolchain.headers.CUDA_HEADERS", tmp_path)
    (tmp_path / "a.cuh").write_text('#include "missing.cuh"\n')
    with pytest.raises(AssertionError, match=f'{where} includes "missing.cuh", which is not a header in templates/cuda/'):
        toolchain.included_headers(source, "kernels/k.cu")


def test_the_edited_copy_is_what_nvrtc_compiles(package):
    """The harness itself: the compiles (in worker processes) read the monkeypatched folder."""
    from fusegen.toolchain.nvrtc import NvrtcError

    config, headers, compiled = package
    with open(headers / "norm.cuh", "a") as f:
        f.write("#error the edited copy\n")
    with pytest.raises(NvrtcError, match="the edited copy"):
        build.build_package(config)
    assert compiled and all(family(s) == "norm" for s, _ in compiled)


def test_a_header_in_the_working_directory_is_never_compiled_instead(tmp_path, monkeypatch):
    """fusegen's headers go to NVRTC in memory, which it prefers to files: a user's own
    common.cuh (in the working directory or a kernels/ folder there) cannot replace them."""
    from fusegen.toolchain import nvrtc

    monkeypatch.chdir(tmp_path)
    (tmp_path / "kernels").mkdir()
    for path in (tmp_path / "common.cuh", tmp_path / "kernels" / "common.cuh"):
        path.write_text('#error "the user\'s header was compiled"\n')
    source = '#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[0] = 1.f; }\n'
    ptx = nvrtc.compile_source(source, "kernels/k.cu", "compute_80", toolchain.cuda_headers(),
                               [nvrtc.cuda_include_dir()], tmp_path)["compute_80"]
    assert b".entry k" in ptx
