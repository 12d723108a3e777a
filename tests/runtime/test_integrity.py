"""The output package at run time: every binary is checked against the sha256 MANIFEST.json
records before the driver sees it (a damaged or replaced cubin is a typed error naming it), and
importing and running the package never reaches NVRTC (no nvrtc module imported, no libnvrtc
mapped into the process), on CPU and, marked cuda, on a GPU."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import generated
from generated import _runtime
from generated._runtime import loading

PACKAGE = Path(generated.__path__[0])
NAME = "gelu_fwd_n256"  # one binary per arch for every dtype
CUBIN = f"{NAME}.sm_90.cubin"


@pytest.fixture
def copy(tmp_path, monkeypatch):
    """A copy of the package's manifest and one kernel's binaries, the runtime pointed at it."""
    (tmp_path / "kernels").mkdir()
    shutil.copy(PACKAGE / "MANIFEST.json", tmp_path)
    for file in (PACKAGE / "kernels").glob(f"{NAME}.*"):
        shutil.copy(file, tmp_path / "kernels")
    monkeypatch.setattr(loading, "KERNELS_DIR", tmp_path / "kernels")
    monkeypatch.setattr(loading, "_MANIFEST", {})
    return tmp_path


def test_an_intact_binary_is_handed_over(copy):
    assert loading.verified_binary(NAME, CUBIN) == (PACKAGE / "kernels" / CUBIN).read_bytes()


def test_a_damaged_binary_is_a_typed_error_naming_it(copy):
    cubin = copy / "kernels" / CUBIN
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    cubin.write_bytes(bytes(data))
    with pytest.raises(_runtime.KernelIntegrityError) as info:
        loading.verified_binary(NAME, CUBIN)
    message = str(info.value)
    assert f"kernel {NAME}: {cubin} is not the binary fusegen generated (its sha256 is " in message
    assert "MANIFEST.json records" in message and "regenerate the package with `fusegen generate`" in message


def test_a_binary_the_manifest_does_not_list_is_refused(copy):
    manifest = json.loads((copy / "MANIFEST.json").read_text())
    del manifest["kernels"][NAME]["binaries"]["sm_90"]
    (copy / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(_runtime.KernelIntegrityError, match="MANIFEST.json records no such binary"):
        loading.verified_binary(NAME, CUBIN)


RUN = """
import sys, torch, generated
device = sys.argv[1]
module = generated.Gpt2Mlp(device=device)
y = module(torch.randn(3, 1024, device=device, requires_grad=True))
y.sum().backward()
with torch.no_grad():
    module(torch.randn(3, 1024, device=device))
if device == "cuda":
    torch.cuda.synchronize()
loaded = sorted(name for name in sys.modules if "nvrtc" in name)
mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if "nvrtc" in line})
print(loaded, mapped)
"""


def _never_reaches_nvrtc(device):
    """No nvrtc module is imported (cuda.bindings.nvrtc, fusegen.toolchain.nvrtc); on CPU not even the
    library is mapped. (A CUDA build of torch maps libnvrtc itself, for its own JIT.)"""
    root = PACKAGE.parent
    out = subprocess.run([sys.executable, "-c", RUN, device], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded, mapped = out.stdout.strip().split("\n")[-1].split("] [")
    assert loaded == "[", out.stdout
    if device == "cpu":
        assert mapped == "]", out.stdout


def test_importing_and_running_on_cpu_never_reaches_nvrtc():
    _never_reaches_nvrtc("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_importing_and_running_on_a_gpu_never_reaches_nvrtc():
    _never_reaches_nvrtc("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_damaged_cubin_stops_the_first_launch(copy):
    """Through the launch path: the check runs before cuLibraryLoadData."""
    if loading.choose_binary(NAME, [CUBIN], torch.cuda.get_device_capability()) != CUBIN:
        pytest.skip("this GPU does not run the sm_90 cubin")
    cubin = copy / "kernels" / CUBIN
    data = bytearray(cubin.read_bytes())
    data[-1] ^= 0xFF
    cubin.write_bytes(bytes(data))
    caches = (loading._FILES, loading._FUNCTIONS, loading._LIBRARIES)
    saved = [dict(cache) for cache in caches]
    try:  # as if nothing were loaded yet: this kernel's binaries are the damaged copy's
        for cache in caches:
            cache.clear()
        loading._FILES[NAME] = [CUBIN]
        with pytest.raises(_runtime.KernelIntegrityError, match=CUBIN):
            _runtime.Kernel(NAME, "ppi").launch(torch.bfloat16, (1, 1, 1), (128, 1, 1), (0, 0, 0), 0)
    finally:
        for cache, entries in zip(caches, saved):
            cache.clear()
            cache.update(entries)
