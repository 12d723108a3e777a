"""Loading a kernel's prebuilt binary (part of a fusegen output's runtime: templates/runtime/,
copied verbatim; do not edit).

Prebuilt only: every kernel was compiled ahead of time into ``kernels/<name>.sm_XY.cubin`` files
(plus, optionally, ``compute_XY.ptx`` for GPUs newer than every cubin), one binary holding the
kernel's functions for every dtype (``<name>_<dtype suffix>``); nothing is compiled here.
A kernel is loaded on its first launch: the binary for the device's compute capability, checked
against the sha256 MANIFEST.json records for it, is loaded once per process with
cuLibraryLoadData (context-independent) and bound to each device's primary context once.
A binary that is missing or not the one generated is a typed error saying what to do.
"""

import hashlib
import json
import re
import threading
from pathlib import Path

import torch

# the output package's kernels/ folder (this module is in its _runtime/)
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
BINARY_FILE = re.compile(r"(?P<name>.+)\.(?:sm_(?P<sm>\d+)\.cubin|compute_(?P<compute>\d+)\.ptx)")


class KernelNotAvailableError(RuntimeError):
    """No prebuilt binary of a kernel runs on this GPU."""


class KernelIntegrityError(RuntimeError):
    """A kernel binary's bytes are not the ones MANIFEST.json records for it."""


def verified_binary(name, file):
    """The bytes of ``kernels/<file>``, checked against the sha256 MANIFEST.json records for it
    (the manifest is read once, on the first load): a binary changed or damaged after generation
    is never handed to the driver."""
    arch = BINARY_FILE.fullmatch(file)
    arch = f"sm_{arch['sm']}" if arch["sm"] else f"compute_{arch['compute']}"
    if "kernels" not in _MANIFEST:
        _MANIFEST.update(json.loads((KERNELS_DIR.parent / "MANIFEST.json").read_text()))
    entry = _MANIFEST["kernels"].get(name, {}).get("binaries", {}).get(arch)
    image = (KERNELS_DIR / file).read_bytes()
    digest = hashlib.sha256(image).hexdigest()
    if entry is None or digest != entry["sha256"]:
        why = ("MANIFEST.json records no such binary" if entry is None else
               f"its sha256 is {digest}, MANIFEST.json records {entry['sha256']}")
        raise KernelIntegrityError(f"kernel {name}: {KERNELS_DIR / file} is not the binary "
                                   f"fusegen generated ({why}); regenerate the package with "
                                   "`fusegen generate`")
    return image


def select_binary(available, capability):
    """The file for a device of compute capability (major, minor) among names like
    'k.sm_90.cubin' / 'k.compute_80.ptx', or None: a cubin of the same major and the highest minor
    not above the device's (cubins run only within their major), else the newest PTX not above
    the device (the driver JIT-compiles it). Pure, so it is testable without a GPU."""
    major, minor = capability
    cubins, ptx = {}, {}
    for file in available:
        match = BINARY_FILE.fullmatch(file)
        if match and match["sm"]:
            cubins[int(match["sm"])] = file
        elif match:
            ptx[int(match["compute"])] = file
    # sm_XY is major X, minor Y; sm_100 / sm_120 are majors 10 / 12.
    same_major = [n for n in cubins if n // 10 == major and n % 10 <= minor]
    if same_major:
        return cubins[max(same_major)]
    older_ptx = [n for n in ptx if n <= major * 10 + minor]
    return ptx[max(older_ptx)] if older_ptx else None


def choose_binary(name, available, capability):
    """select_binary among the files of kernel ``name``, or KernelNotAvailableError saying what to do."""
    own = sorted(f for f in available if f.startswith(name + ".") and BINARY_FILE.fullmatch(f))
    chosen = select_binary(own, capability)
    if chosen is None:
        arch = f"sm_{capability[0]}{capability[1]}"
        raise KernelNotAvailableError(
            f"kernel {name} has no binary for this GPU ({arch}); found: "
            f"{', '.join(own) or 'none'} in {KERNELS_DIR}. Add \"{arch}\" to the archs of "
            "[tool.fusegen] in the pyproject.toml that generated this package (or pass --archs) "
            "and run `fusegen generate`.")
    return chosen


def _driver():
    from cuda.bindings import driver  # lazy: CPU-only use of the package needs no cuda-bindings

    return driver


def _check(result, full_name, what):
    driver = _driver()
    if result != driver.CUresult.CUDA_SUCCESS:
        err, name = driver.cuGetErrorName(result)
        name = name.decode() if err == driver.CUresult.CUDA_SUCCESS else str(result)
        raise RuntimeError(f"kernel {full_name}: {what} failed with {name}")


_LOCK = threading.Lock()  # guards the load path; launches read the caches without it
_STATE = {"initialized": False}
_FILES = {}  # kernel name -> its binary files present in KERNELS_DIR
_LIBRARIES = {}  # file name -> (CUlibrary, image kept alive alongside)
_FUNCTIONS = {}  # (entry symbol, device index) -> CUfunction bound to that device's primary context
_PRIMARY = {}  # device index -> primary context retained here (only if none was current)
_MANIFEST = {}  # MANIFEST.json, read on the first load


def _ensure_context(full_name, index):
    """Make sure a context is current (PyTorch's device guard normally made it the primary one)."""
    driver = _driver()
    err, context = driver.cuCtxGetCurrent()
    _check(err, full_name, "cuCtxGetCurrent")
    if context is None or int(context) == 0:
        if index not in _PRIMARY:
            err, dev = driver.cuDeviceGet(index)
            _check(err, full_name, f"cuDeviceGet({index})")
            err, _PRIMARY[index] = driver.cuDevicePrimaryCtxRetain(dev)  # held for the process
            _check(err, full_name, "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(_PRIMARY[index])[0], full_name, "cuCtxSetCurrent")


# Dynamic shared memory a block gets without opting in; more needs the function's attribute raised.
DEFAULT_SHARED_LIMIT = 48 * 1024


def _load(name, symbol, index, shared=0):
    """The function ``symbol`` of kernel ``name``'s binary (``<name>_<dtype suffix>``, or a second
    entry point such as a norm forward's ``<name>_<dtype suffix>_few_rows``) on device ``index``."""
    driver = _driver()
    torch.cuda.init()  # PyTorch creates the primary contexts; the driver calls below use them
    with _LOCK:
        if (symbol, index) in _FUNCTIONS:  # another thread got here first
            return _FUNCTIONS[symbol, index]
        if not _STATE["initialized"]:
            _check(driver.cuInit(0)[0], symbol, "cuInit")
            _STATE["initialized"] = True
        if name not in _FILES:
            files = [p.name for p in KERNELS_DIR.glob(f"{name}.*")] if KERNELS_DIR.is_dir() else []
            _FILES[name] = sorted(files)
        chosen = choose_binary(name, _FILES[name], torch.cuda.get_device_capability(index))
        if chosen not in _LIBRARIES:
            image = verified_binary(name, chosen)
            if chosen.endswith(".ptx"):
                image += b"\0"  # the driver takes PTX as a NUL-terminated string
            err, library = driver.cuLibraryLoadData(image, None, None, 0, None, None, 0)
            _check(err, symbol, f"cuLibraryLoadData({chosen})")
            _LIBRARIES[chosen] = (library, image)
        err, kernel = driver.cuLibraryGetKernel(_LIBRARIES[chosen][0], symbol.encode())
        _check(err, symbol, f"cuLibraryGetKernel({symbol}) in {chosen}")
        with torch.cuda.device(index):
            _ensure_context(symbol, index)
            # With a PTX file the driver JIT-compiles here; an old driver fails with
            # CUDA_ERROR_UNSUPPORTED_PTX_VERSION (then add the GPU's sm_XY to archs instead).
            err, function = driver.cuKernelGetFunction(kernel)
            _check(err, symbol, f"cuKernelGetFunction({chosen}) on device {index}")
            if shared > DEFAULT_SHARED_LIMIT:
                limit = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(driver.cuFuncSetAttribute(function, limit, shared)[0], symbol,
                       f"raising its dynamic shared memory to {shared} bytes on device {index}")
        _FUNCTIONS[symbol, index] = function
        return function
