"""Which prebuilt binary the run-time loader picks for a GPU (CPU only: pure file-name logic)."""

import pytest

# templates/runtime/ is the package each output copies as its _runtime/: tested here as the template
from fusegen.templates.runtime import launch, loading

NAME = "rmsnorm_fwd_h4096"  # a kernel: one binary per arch holds its functions for every dtype
# The source and other kernels' binaries (one whose name extends this one's) sit in the same
# folder and must be ignored.
FILES = [f"{NAME}.cu", f"{NAME}.sm_80.cubin", f"{NAME}.sm_90.cubin", f"{NAME}.compute_80.ptx",
         "rmsnorm_fwd_h4096_add_dresidual.sm_86.cubin", f"{NAME}x.sm_86.cubin"]


@pytest.mark.parametrize("capability,files,chosen", [
    ((9, 0), FILES, f"{NAME}.sm_90.cubin"),
    ((8, 6), FILES, f"{NAME}.sm_80.cubin"),  # same major, older minor runs
    ((8, 0), FILES, f"{NAME}.sm_80.cubin"),
    ((8, 9), FILES, f"{NAME}.sm_80.cubin"),
    ((12, 0), FILES, f"{NAME}.compute_80.ptx"),  # newer major: the driver JITs the PTX
    ((10, 0), FILES, f"{NAME}.compute_80.ptx"),
    ((8, 0), [f"{NAME}.compute_80.ptx"], f"{NAME}.compute_80.ptx"),  # PTX only
    ((10, 3), [f"{NAME}.sm_100.cubin", f"{NAME}.sm_90.cubin"], f"{NAME}.sm_100.cubin"),  # 3-digit arch
    ((9, 0), [f"{NAME}.compute_80.ptx", f"{NAME}.compute_90.ptx"], f"{NAME}.compute_90.ptx"),
])
def test_choose_binary(capability, files, chosen):
    assert loading.choose_binary(NAME, files, capability) == chosen


def test_older_gpu_than_every_binary_is_a_clear_error():
    with pytest.raises(loading.KernelNotAvailableError) as info:
        loading.choose_binary(NAME, FILES, (7, 5))
    message = str(info.value)
    assert NAME in message and "sm_75" in message
    assert f"found: {NAME}.compute_80.ptx, {NAME}.sm_80.cubin, {NAME}.sm_90.cubin in " in message
    assert "archs of [tool.fusegen]" in message and "run `fusegen generate`" in message and "make " not in message
    assert f"{NAME}.cu," not in message and "dresidual" not in message  # only this kernel's binaries


def test_cubin_of_a_newer_minor_or_other_major_is_not_used():
    with pytest.raises(loading.KernelNotAvailableError, match="found: none"):
        loading.choose_binary(NAME, [], (9, 0))
    with pytest.raises(loading.KernelNotAvailableError, match="sm_80"):
        loading.choose_binary(NAME, [f"{NAME}.sm_86.cubin", f"{NAME}.sm_90.cubin"], (8, 0))


def test_kernel_is_lazy_and_rejects_unknown_dtypes():
    import torch

    kernel = launch.Kernel("rmsnorm_fwd_h4096", "pppppppppi")  # constructing loads nothing (and needs no GPU)
    assert kernel._full_name(torch.bfloat16) == "rmsnorm_fwd_h4096_bf16"
    with pytest.raises(TypeError, match="kernel rmsnorm_fwd_h4096: unsupported dtype torch.float64"):
        kernel.launch(torch.float64, (1, 1, 1), (1, 1, 1), (), 0)
