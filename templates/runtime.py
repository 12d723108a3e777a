"""Kernel loading and launching for a fusegen output package. Copied verbatim from fusegen's
templates/runtime.py; do not edit.

Prebuilt only: kernels were compiled ahead of time into ``kernels/<name>.<sm_XY>.cubin`` (plus a
``compute_XY`` PTX fallback) and nothing is compiled here. A kernel is loaded on its first launch,
once per process (cuLibraryLoadData is context-independent), and bound to each device's primary
context once. Launches go on PyTorch's current stream; this module never synchronises and never
allocates, so whole forward and backward passes can be captured in a CUDA graph.
Needs torch, plus cuda-bindings for CUDA tensors only.
"""

import ctypes
import threading
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class KernelNotAvailableError(RuntimeError):
    """No prebuilt binary of a kernel runs on this GPU."""


def check_input(module, name, tensor, features, like, lead=None):
    """Clear run-time errors for a wrong type, feature size, dtype, device or row shape."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{module}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() < 1 or tensor.shape[-1] != features:
        raise ValueError(f"{module}: {name} must have shape [..., {features}], got {list(tensor.shape)}")
    if tensor.dtype != like.dtype:
        raise TypeError(f"{module}: {name} has dtype {tensor.dtype} but the module's parameters are "
                        f"{like.dtype}; convert the input or the module (module.to(dtype))")
    if tensor.device != like.device:
        raise ValueError(f"{module}: {name} is on {tensor.device} but the module's parameters are on "
                         f"{like.device}; move one of them")
    if lead is not None and tensor.shape[:-1] != lead:
        raise ValueError(f"{module}: {name} must have the same leading shape as x, {list(lead)}, "
                         f"got {list(tensor.shape[:-1])}")


def select_binary(available, capability):
    """The binary for a device of compute capability (major, minor) among file names like
    'name.sm_90.cubin' / 'name.compute_80.ptx': a cubin of the same major and the highest minor
    not above the device's, else the newest PTX not above the device (JIT by the driver)."""
    major, minor = capability
    cubins, ptx = {}, {}
    for file in available:
        target = file.split(".")[-2]
        number = int(target.split("_")[1])
        (cubins if target.startswith("sm_") else ptx)[number] = file
    same_major = [n for n in cubins if n // 10 == major and n % 10 <= minor]
    if same_major:
        return cubins[max(same_major)]
    usable_ptx = [n for n in ptx if n <= major * 10 + minor]
    if usable_ptx:
        return ptx[max(usable_ptx)]
    return None


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what):
    driver = _driver()
    if result != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(result)
        raise RuntimeError(f"fusegen runtime: {what} failed: {name.decode() if name else result}")


class Kernel:
    """One generated kernel, in every dtype it was built for; ``name`` has no dtype suffix."""

    _lock = threading.Lock()
    _initialized = False

    def __init__(self, name):
        self.name = name
        self._libraries = {}  # full name -> (CUkernel, CUlibrary)
        self._functions = {}  # (full name, device index) -> CUfunction

    def _full_name(self, dtype):
        if dtype not in DTYPE_SUFFIX:
            supported = ", ".join(str(d) for d in DTYPE_SUFFIX)
            raise TypeError(f"kernel {self.name}: unsupported dtype {dtype}; supported: {supported}")
        return f"{self.name}_{DTYPE_SUFFIX[dtype]}"

    def _function(self, full, device):
        key = (full, device.index)
        function = self._functions.get(key)
        if function is not None:
            return function
        with Kernel._lock:
            driver = _driver()
            if not Kernel._initialized:
                _check(driver.cuInit(0)[0], "cuInit")
                Kernel._initialized = True
            capability = torch.cuda.get_device_capability(device)
            available = sorted(p.name for p in KERNELS_DIR.glob(f"{full}.*") if p.suffix in (".cubin", ".ptx"))
            chosen = select_binary(available, capability)
            if chosen is None:
                raise KernelNotAvailableError(
                    f"kernel {full} has no binary for this GPU (sm_{capability[0]}{capability[1]}); "
                    f"found: {', '.join(available) or 'none'}. Add the arch to [tool.fusegen] archs "
                    "and run `make generate`.")
            if full not in self._libraries:
                image = (KERNELS_DIR / chosen).read_bytes()
                if chosen.endswith(".ptx"):
                    image += b"\0"  # the driver JIT wants a NUL-terminated string
                err, library = driver.cuLibraryLoadData(image, None, None, 0, None, None, 0)
                _check(err, f"loading {chosen}")
                err, kernel = driver.cuLibraryGetKernel(library, full.encode())
                _check(err, f"finding {full} in {chosen}")
                self._libraries[full] = (kernel, library)
            with torch.cuda.device(device):
                torch.cuda.init()
                err, context = driver.cuCtxGetCurrent()
                _check(err, "cuCtxGetCurrent")
                if int(context) == 0:  # PyTorch has not made the primary context current yet
                    err, context = driver.cuDevicePrimaryCtxRetain(device.index)
                    _check(err, "cuDevicePrimaryCtxRetain")
                    _check(driver.cuCtxSetCurrent(context)[0], "cuCtxSetCurrent")
                err, function = driver.cuKernelGetFunction(self._libraries[full][0])
                _check(err, f"binding {full} to device {device.index}")
            self._functions[key] = function
            return function

    def launch(self, dtype, grid, block, args, device):
        """Launch on the current stream of ``device``. Tensors pass as device pointers, None as
        a null pointer, ints as C int, floats as C float."""
        driver = _driver()
        full = self._full_name(dtype)
        function = self._function(full, device)
        values, types = [], []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                values.append(arg.data_ptr())
                types.append(ctypes.c_void_p)
            elif arg is None:
                values.append(0)  # null pointer
                types.append(ctypes.c_void_p)
            elif isinstance(arg, int):
                values.append(arg)
                types.append(ctypes.c_int)
            else:
                values.append(float(arg))
                types.append(ctypes.c_float)
        stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
        (err,) = driver.cuLaunchKernel(function, *grid, *block, 0, stream, (tuple(values), tuple(types)), 0)
        _check(err, f"launching {full}")
