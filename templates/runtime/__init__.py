"""Kernel loading and launching for a fusegen output package. Copied verbatim from fusegen's
templates/runtime.py; do not edit.

Prebuilt only: every kernel was compiled ahead of time into ``kernels/<name>.sm_XY.cubin`` files
(plus, optionally, ``compute_XY.ptx`` for GPUs newer than every cubin), one binary holding the
kernel's functions for every dtype (``<name>_<dtype suffix>``); nothing is compiled here.
A kernel is loaded on its first launch: the binary for the device's compute capability, checked
against the sha256 MANIFEST.json records for it, is loaded once per process with
cuLibraryLoadData (context-independent) and bound to each device's primary context once.
Launches go on PyTorch's current stream; this module never synchronises the host
and never allocates, so whole forward and backward passes can be captured in a CUDA graph (after
one eager warm-up step, as usual, so that the loading happens outside the capture).
Needs torch, plus cuda-bindings for CUDA tensors only (imported on first launch).
"""

import ctypes
import functools
import hashlib
import json
import re
import struct
import threading
import warnings
import weakref
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
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


def check_input(module, name, tensor, features, like, lead=None, multiple_of=1,
                like_is="the module's parameters are", any_shape=False, shape=None):
    """Clear run-time errors for a wrong type, feature size, dtype, device or row shape.
    ``features``: the size the last dimension must have, or None for any size that is a multiple
    of ``multiple_of`` (a size-generic pipeline). ``any_shape``: any shape, 0-D included (an
    elementwise pipeline: TE's elementwise ops take any shape); ``shape``: exactly this shape
    (x's, for an extra input of such a pipeline). ``like``: the tensor whose dtype and device the
    input must have (a parameter, or x in a pipeline without parameters), ``like_is`` what it is.
    Every call: one quick pass, the messages only when it finds something."""
    if not _input_fits(tensor, features, like, lead, multiple_of, any_shape, shape):
        _input_error(module, name, tensor, features, like, lead, multiple_of, like_is, any_shape,
                     shape)


def _input_fits(tensor, features, like, lead, multiple_of, any_shape, shape):
    """check_input's quick pass (a generated module's every call: about a third quicker than the
    messages' checks in their order, measured on an H100 machine's host)."""
    try:
        dtype, size = tensor.dtype, tensor.shape
    except AttributeError:  # not a tensor: the messages say what it is
        return False
    if dtype is not like.dtype or not dtype.is_floating_point or tensor.device != like.device:
        return False
    if shape is not None:
        return size == shape
    if features is None:
        fits = any_shape or (len(size) >= 1 and size[-1] % multiple_of == 0)
    else:
        fits = len(size) >= 1 and size[-1] == features
    return fits and (lead is None or size[:-1] == lead)


def _input_error(module, name, tensor, features, like, lead, multiple_of, like_is, any_shape,
                 shape):
    """Raises the error that names what check_input's quick pass refused."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{module}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():  # as torch's own ops refuse them (in float they'd be wrong)
        raise TypeError(f"{module}: {name} has dtype {tensor.dtype}, but the module takes floating-"
                        "point tensors only (float32, float16, bfloat16; float64 on CPU); convert "
                        "it, e.g. x.float()")
    if shape is not None:
        if tensor.shape != shape:
            raise ValueError(f"{module}: {name} must have x's shape, {list(shape)}, got "
                             f"{list(tensor.shape)}")
    elif features is None:
        if not any_shape and (tensor.dim() < 1 or tensor.shape[-1] % multiple_of):
            constraint = " (rows of n values)" if multiple_of == 1 else (
                f" with n a multiple of {multiple_of} (the pipeline's GLUs split each row)")
            raise ValueError(f"{module}: {name} must have shape [..., n]{constraint}, got "
                             f"{list(tensor.shape)}")
    elif tensor.dim() < 1 or tensor.shape[-1] != features:
        raise ValueError(f"{module}: {name} must have shape [..., {features}], got "
                         f"{list(tensor.shape)}")
    if tensor.dtype != like.dtype:
        raise TypeError(f"{module}: {name} has dtype {tensor.dtype} but {like_is} {like.dtype}; "
                        "convert the input or the module (module.to(dtype))")
    if tensor.device != like.device:
        meta = "" if like.device.type != "meta" else (
            " (meta parameters hold no values: module.to_empty(device=...), then "
            "module.reset_parameters() or load_state_dict)")
        raise ValueError(f"{module}: {name} is on {tensor.device} but {like_is} on "
                         f"{like.device}; move one of them{meta}")
    if lead is not None and tensor.shape[:-1] != lead:
        raise ValueError(f"{module}: {name} must have the same leading shape as x, {list(lead)}, "
                         f"got {list(tensor.shape[:-1])}")
    raise AssertionError(f"{module}: check_input's quick pass refused {name}, but no check names "
                         "why")


def check_parameters(module, keys, shapes, parameters):
    """Clear run-time errors for a parameter replaced or cast since the module was built (a
    tensor of another shape, dtype or device than the others; the kernels would read it as the
    first one's): ``keys`` their state_dict keys, ``shapes`` the shapes the spec gives them. Every
    call: one quick pass, the messages only when it finds something."""
    if not _parameters_agree(shapes, parameters):
        _parameter_error(module, keys, shapes, parameters)


def _parameters_agree(shapes, parameters):
    """Whether the parameters have their shapes, one dtype and one device (the quick pass: about
    0.75 us a parameter on an H100 machine's host, a third less than with an isinstance check and
    get_device and is_meta per parameter)."""
    try:
        first = parameters[0]
        dtype, device = first.dtype, first.device
        for shape, parameter in zip(shapes, parameters):
            if (parameter.dtype is not dtype or parameter.shape != shape
                    or parameter.device != device):
                return False
    except AttributeError:  # not a tensor (None, say): the messages say which
        return False
    return True


def _parameter_error(module, keys, shapes, parameters):
    """Raises the error that names the first parameter check_parameters' quick pass refused."""
    first = parameters[0]
    for key, shape, parameter in zip(keys, shapes, parameters):
        if not isinstance(parameter, torch.Tensor):
            raise TypeError(f"{module}: parameter {key} must be a torch.Tensor, got "
                            f"{type(parameter).__name__}")
        if parameter.shape != shape:
            raise ValueError(f"{module}: parameter {key} has shape {list(parameter.shape)}, but "
                             f"the spec's op makes it {list(shape)}; load a state_dict of the "
                             "spec's shapes, or regenerate the module from a spec of the new "
                             "sizes")
        if parameter.dtype != first.dtype:
            raise TypeError(f"{module}: parameter {key} has dtype {parameter.dtype} but {keys[0]} "
                            f"has {first.dtype}; the module computes in one dtype: cast the whole "
                            "module (module.to(dtype))")
        if parameter.device != first.device:
            raise ValueError(f"{module}: parameter {key} is on {parameter.device} but {keys[0]} is "
                             f"on {first.device}; move the whole module (module.to(device))")
    raise AssertionError(f"{module}: check_parameters' quick pass refused a parameter, but no "
                         "check names which")


def check_row_input(module, name, tensor, like, lead, like_is="the module's parameters are"):
    """Clear run-time errors for a per-row input (a row-scaled activation's scales): one value per
    row, shape ``lead`` (the output's shape without its last dim)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{module}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != lead:
        raise ValueError(f"{module}: {name} holds one scale per row: it must have shape "
                         f"{list(lead)}, got {list(tensor.shape)}")
    check_input(module, name, tensor.unsqueeze(-1), 1, like, None, like_is=like_is)


class SpecOp(torch.nn.Module):
    """One op of the spec's Sequential, holding its parameters under the Sequential's index (so
    state_dict keys match the eager module's); its repr is the op as the spec writes it."""

    def __init__(self, call):
        super().__init__()
        self.call = call  # "Linear(4096, 28672)"

    def _get_name(self):
        return self.call[:self.call.index("(")]

    def extra_repr(self):
        return self.call[self.call.index("(") + 1:-1]


def as_rows(tensor, features):
    """``tensor`` as a dense [rows, features] tensor: the tensor itself when it is one already
    (no new view object: at a few rows each op's dispatch is a measurable part of a call)."""
    if tensor.dim() == 2 and tensor.is_contiguous():
        return tensor
    return tensor.reshape(-1, features).contiguous()


def with_shape(tensor, shape):
    """A module's [rows, n] result in ``shape``, x's (an elementwise pipeline's results have its
    shape, 0-D included): as it is when it has it already."""
    return tensor if tensor.shape == shape else tensor.reshape(shape)


def with_lead(tensor, lead, features):
    """A module's [rows, features] result in the caller's leading dims ``lead``: as it is for a
    2-D call (then not a view either, so hooks on views, FSDP's among them, have nothing to warn
    of)."""
    return tensor if len(lead) == 1 else tensor.reshape(*lead, features)


class _SecondDerivative(torch.autograd.Function):
    """Hands first-order grads through unchanged; differentiating them again raises."""

    @staticmethod
    def forward(ctx, module, count, *tensors):
        ctx.module = module
        return tuple(t.clone() for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.module}: second derivatives (double backward, gradgradcheck) are "
                           "not supported: its backward is fused and not itself differentiable")


def first_order_only(module):
    """Decorates a generated backward so that a second derivative raises instead of being wrong.

    Like torch's once_differentiable the backward runs without building a graph; unlike it, the
    guard node also hangs off the saved tensors, so it is reached (and raises) even when
    torch.autograd.grad differentiates with respect to an input whose only path is through them."""

    def decorate(backward):
        @functools.wraps(backward)
        def guarded(ctx, *grad_outputs):
            if not torch.is_grad_enabled():  # the usual case, no create_graph: nothing to guard
                return backward(ctx, *grad_outputs)
            with torch.no_grad():
                grads = backward(ctx, *grad_outputs)
            anchors = [t for t in (*grad_outputs, *saved_tensors(ctx)) if t is not None and t.requires_grad]
            if not anchors:  # nothing the grads depend on is differentiable: their derivative is zero
                return grads
            grads = grads if isinstance(grads, tuple) else (grads,)
            present = [g for g in grads if g is not None]
            passed = iter(_SecondDerivative.apply(module, len(present), *present, *anchors))
            return tuple(None if g is None else next(passed) for g in grads)

        return guarded

    return decorate


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


def pointer(tensor):
    """A kernel argument for a tensor that may be absent (a Dropout key in eval mode): its device
    pointer, or 0 (a null pointer, which the kernel reads as "none")."""
    return 0 if tensor is None else tensor.data_ptr()


class _ThreadBuffers(threading.local):
    """Each thread's argument buffers, by (kernel, dtype, device): launches from several threads
    never share one."""

    def __init__(self):
        self.buffers = {}
        self.contexts = set()  # devices whose context this thread has made sure of


_THREAD = _ThreadBuffers()
# cuda-bindings' cuLaunchKernel, looked up on the first launch. Called with a prebuilt pointer
# array it measured faster than the same driver function through ctypes (6.5 µs against 9.5 µs a
# call on an H100 host, where ctypes converts eleven arguments; bench/bench_launch.py).
_LAUNCH = None
_LAUNCH_COOPERATIVE = None  # cuLaunchCooperativeKernel, looked up with it
_SUCCESS = None  # CUresult.CUDA_SUCCESS, looked up with it


class _Ready:
    """One kernel loaded on one device in one dtype: its function handle and the layout of its
    packed arguments. A launch packs the values into the thread's buffer (one struct.pack_into)
    and hands the driver the address of a prebuilt array of pointers into it."""

    __slots__ = ("key", "full_name", "function", "index", "layout", "size", "resident", "shared")

    def __init__(self, key, full_name, function, index, signature, shared):
        self.key, self.full_name, self.function, self.index = key, full_name, function, index
        self.shared = shared  # bytes of dynamic shared memory a block gets
        self.resident = {}  # threads per block -> blocks the device runs at once
        # every argument in its own 8-byte slot: a pointer ("p", 8 bytes) or a C int ("i", 4)
        self.layout = struct.Struct("<" + "".join("Q" if kind == "p" else "i4x" for kind in signature))
        self.size = len(signature)

    def buffer(self):
        """This thread's (argument bytes, address of the pointer array, the array: kept alive with
        the bytes) for the kernel."""
        held = _THREAD.buffers.get(self.key)
        if held is None:
            data = ctypes.create_string_buffer(max(8, self.layout.size))
            base = ctypes.addressof(data)
            slots = (ctypes.c_void_p * max(1, self.size))(*[base + 8 * k for k in range(self.size)])
            held = _THREAD.buffers[self.key] = (data, ctypes.addressof(slots), slots)
        return held


class Kernel:
    """One generated kernel, in every dtype it was built for; ``name`` has no dtype suffix,
    ``signature`` its C parameters in order, one letter each: "p" a pointer, "i" a C int;
    ``shared`` the bytes of dynamic shared memory each block gets (a norm backward's partials, a
    column-tiled backward's lane sums);
    ``few_rows`` the dtypes whose binary has a second entry point, ``<symbol>_few_rows``, that a
    grid of at most one wave of its blocks runs instead (a norm forward's: templates/cuda/norm.cuh,
    FEW_ROWS); ``entry`` names such an entry (the symbol's suffix) for the Kernel that launches it."""

    def __init__(self, name, signature, shared=0, few_rows=(), entry=""):
        self.name = name  # nothing is loaded before the first launch
        self.signature = signature
        self.shared = shared
        self.entry = entry
        self.few_rows = Kernel(name, signature, shared, entry="few_rows") if few_rows else None
        self.few_rows_dtypes = frozenset(few_rows)
        self._ready = {}  # (dtype, device index) -> _Ready

    def _full_name(self, dtype):
        if dtype not in DTYPE_SUFFIX:
            supported = ", ".join(str(d) for d in DTYPE_SUFFIX)
            raise TypeError(f"kernel {self.name}: unsupported dtype {dtype}; supported: {supported}")
        return f"{self.name}_{DTYPE_SUFFIX[dtype]}"

    def _prepare(self, dtype, index):
        global _LAUNCH, _LAUNCH_COOPERATIVE, _SUCCESS
        full = self._full_name(dtype)
        symbol = f"{full}_{self.entry}" if self.entry else full
        function = _FUNCTIONS.get((symbol, index)) or _load(self.name, symbol, index, self.shared)
        if _LAUNCH is None:
            driver = _driver()
            _LAUNCH, _LAUNCH_COOPERATIVE = driver.cuLaunchKernel, driver.cuLaunchCooperativeKernel
            _SUCCESS = driver.CUresult.CUDA_SUCCESS
        ready = _Ready((self.name, self.entry, dtype, index), full, function, index, self.signature, self.shared)
        self._ready[dtype, index] = ready
        return ready

    def resident_blocks(self, dtype, index, threads):
        """How many blocks of ``threads`` threads device ``index`` runs at once: its SMs times the
        blocks an SM holds with this kernel's registers and shared memory (the driver's occupancy
        query, asked once). A grid of this many is one full wave: a kernel whose blocks loop over
        rows gets every SM busy, none idle behind a partial second wave."""
        ready = self._ready.get((dtype, index))
        if ready is None:
            ready = self._prepare(dtype, index)
        blocks = ready.resident.get(threads)
        if blocks is None:
            with torch.cuda.device(index):  # the function belongs to that device's context
                err, per_sm = _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    ready.function, threads, ready.shared)
            _check(err, ready.full_name, "cuOccupancyMaxActiveBlocksPerMultiprocessor")
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            blocks = ready.resident[threads] = max(1, per_sm) * sms
        return blocks

    def launch(self, dtype, grid, block, args, index, cooperative=False):
        """Launch on the current stream of CUDA device ``index``. ``args``: the kernel's
        arguments in order, pointers as ints (``tensor.data_ptr()``, ``pointer(t)``) and C ints.
        ``cooperative``: a cooperative launch (every block resident at once, so the kernel may
        wait on a barrier across its grid: templates/cuda/column_sum.cuh, grid_sync), for a grid
        of at most ``resident_blocks``. A grid of at most one wave of the ``few_rows`` entry's
        blocks runs that entry, where the dtype's binary has one.
        The generated module checks its inputs' devices and dtypes once per call; here nothing is
        checked but what the packing itself rejects (an int that does not fit)."""
        kernel = self
        if self.few_rows is not None and dtype in self.few_rows_dtypes:
            blocks, threads = grid[0] * grid[1] * grid[2], block[0] * block[1] * block[2]
            if blocks <= self.few_rows.resident_blocks(dtype, index, threads):
                kernel = self.few_rows
        ready = kernel._ready.get((dtype, index))
        if ready is None:
            ready = kernel._prepare(dtype, index)
        data, params, _ = ready.buffer()
        try:
            ready.layout.pack_into(data, 0, *args)
        except struct.error as error:
            raise ValueError(f"kernel {ready.full_name}: arguments {args} do not fit its "
                             f"parameters ({self.signature}: p a pointer, i a C int): "
                             f"{error}") from None
        if _current_device() != index:  # launch under the device's context, as torch's own ops do
            with torch.cuda.device(index):
                self._launch(ready, grid, block, params, cooperative)
        else:
            self._launch(ready, grid, block, params, cooperative)

    @staticmethod
    def _launch(ready, grid, block, params, cooperative):
        index = ready.index
        stream = _raw_stream(index)
        if stream == 0 and index not in _THREAD.contexts:
            # the legacy default stream belongs to whatever context is current on this thread
            _ensure_context(ready.full_name, index)
            _THREAD.contexts.add(index)
        if cooperative:
            (err,) = _LAUNCH_COOPERATIVE(ready.function, *grid, *block, ready.shared, stream, params)
        else:
            (err,) = _LAUNCH(ready.function, *grid, *block, ready.shared, stream, params, 0)
        if err != _SUCCESS:
            _check(err, ready.full_name, "cuLaunchCooperativeKernel" if cooperative else "cuLaunchKernel")


def _current_device():
    return torch._C._cuda_getDevice()


def _raw_stream(index):
    """PyTorch's current stream on device ``index`` as the driver's handle (an int)."""
    return torch._C._cuda_getCurrentRawStream(index)


MAX_PARAMETER_MOVES = 3  # a module whose parameters move this often replays no graphs


class CudaGraphs:
    """A module's forward, and under autograd its backward, replayed from CUDA graphs per input
    shape where that pays.

    At a few rows a pipeline is bound by the host: every launch and GEMM call costs it several
    µs of Python and dispatch, more than the device needs. So a call on CUDA with at most
    ``max_rows`` rows runs from graphs captured for its shape (on its second call: the first runs
    as usual, loading the kernels):
    - without autograd (``no_grad``): the inputs copied into the graph's own buffers, one graph
      launch, the outputs cloned out (three calls, whatever the pipeline's length);
    - under autograd (``training``, ``replay_forward``, ``replay_backward``): the forward likewise,
      keeping what its backward reads in the graph's buffers (no copies), and the backward as the
      output grads copied in, one graph launch, the grads cloned out, then the weight-grad GEMMs
      run as usual (a graph would write them into fixed memory, and handing that to autograd
      would cost a parameter-sized copy). One forward's tensors live in the buffers at a time:
      while its backward has not run (and its autograd graph lives), another forward of that
      shape runs as usual.
    Every call returns new tensors and sees the parameters' current values (the graph reads them
    where they are; a parameter moved to new memory, by ``module.to`` or an assignment, drops the
    module's graphs). A module keeps at most ``max_graphs`` graphs; calls of other shapes run as
    usual.

    Calls run as usual, not from a graph: under torch.compile (where the no-grad forward is one
    custom op that replays graphs by parameters, register_no_grad_op), inside a caller's own graph
    capture, with more rows, on CPU, on a device other than the current one, under autocast or
    saved-tensor hooks (training: activation checkpointing, offloading), and once a capture has
    failed or the parameters have moved ``MAX_PARAMETER_MOVES`` times (with a warning saying
    why). Each graph holds its stages' tensors for its shape (the TE docs MLP: about 14 MB a
    no-grad graph at 128 rows, 30 MB a training pair).
    Set ``module.cuda_graphs.max_rows = 0`` to turn graphs off; ``module.cuda_graphs.clear()``
    frees their memory. A module is pickled, copied and saved without its graphs.

    ``by_parameters``: the graphs of every module of a pipeline at once, each found by the
    addresses of the parameters it reads (the no-grad custom op that torch.compile calls, which is
    given tensors, not its module); a module whose parameters move gets graphs of its own, and
    once ``max_graphs`` are held the oldest makes way for a new key.
    """

    def __init__(self, module, inputs, max_rows=128, max_graphs=8, by_parameters=False):
        self.module = module  # the class name, for messages
        self.inputs = inputs  # the first ``inputs`` arguments are per-call tensors; then parameters and flags
        self.max_rows = max_rows
        self.max_graphs = max_graphs
        self.by_parameters = by_parameters
        self._reset()

    def _reset(self):
        self.failed = None  # why graphs are off for this module from then on
        self.moves = 0  # how often a call found the parameters moved since its graph's capture
        self._graphs = {}  # key -> _Graph or _TrainingGraph (or None: seen once, not captured yet)
        self._lock = threading.Lock()  # one call at a time copies in, replays and clones out
        self._layout = None  # positions of the parameters and of the flags in a call's arguments

    @property
    def captured(self):
        """How many graphs the module holds now."""
        return sum(graph is not None for graph in self._graphs.values())

    def clear(self):
        """Drop every captured graph and the memory it holds; shapes are captured again (a
        backward still to come of a replayed forward keeps its own graph until it has run)."""
        with self._lock:
            self._graphs.clear()

    def __getstate__(self):
        return {"module": self.module, "inputs": self.inputs, "max_rows": self.max_rows,
                "max_graphs": self.max_graphs, "by_parameters": self.by_parameters}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset()

    def no_grad(self, forward, args):
        """``forward(*args)`` (a generated no-grad forward), or its replay: the same values."""
        if torch.compiler.is_compiling():
            return forward(*args)
        graph = self._find("no-grad", forward, args)
        if graph is None:
            return forward(*args)
        inputs = args[:self.inputs]
        with self._lock:
            for static, a in zip(graph.inputs, inputs):
                static.copy_(a)
            graph.graph.replay()
            outputs = [out.clone() for out in graph.outputs]
        return outputs[0] if graph.single else tuple(outputs)

    def training(self, stages, args):
        """The graphs that ``replay_forward`` replays ``stages(*args)`` from (a generated
        forward_stages under autograd), or None where the call runs as usual."""
        if (torch.compiler.is_compiling() or torch.is_autocast_enabled("cuda")
                # saved-tensor hooks (activation checkpointing, offloading) must see every tensor
                # a forward keeps, where a replayed one keeps them in its graph
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
            return None
        return self._find("training", stages, args)

    def _find(self, mode, stages, args):
        """This call's graph for ``mode``: found, captured now (the key's second call), or None
        where the call runs as usual."""
        x = args[0]
        if not x.is_cuda or x.shape[0] > self.max_rows or self.failed or _capturing():
            return None
        index = x.get_device()
        if index != _current_device():  # a graph captures and replays on the current device's streams
            return None
        if self._layout is None:  # the same for every call of a module: found once
            rest = range(self.inputs, len(args))
            self._layout = ([i for i in rest if isinstance(args[i], torch.Tensor)],
                            [i for i in rest if not isinstance(args[i], torch.Tensor)])
        parameters, flags = self._layout
        key = (mode, _raw_stream(index), index, x.dtype,
               *[args[i].shape for i in range(self.inputs)], *[args[i] for i in flags])
        if self.by_parameters:  # then a graph's parameters are where it reads them, by its key
            key += tuple(args[i].data_ptr() for i in parameters)
        graph = self._graphs.get(key)
        if graph is None:
            full = len(self._graphs) >= self.max_graphs
            if self.by_parameters and full and key not in self._graphs:
                with self._lock:  # the oldest goes (its module may be long gone), not mid-replay
                    self._graphs.pop(next(iter(self._graphs), None), None)
            if key not in self._graphs and len(self._graphs) < self.max_graphs:
                self._graphs[key] = None  # seen once: captured on the next call
                return None
            if key not in self._graphs:  # as many shapes as allowed already
                return None
            return self._capture(key, mode, stages, args)
        if graph.parameters != [args[i].data_ptr() for i in parameters]:
            self.clear()  # a parameter moved: every graph reads the old memory
            self.moves += 1
            if self.moves >= MAX_PARAMETER_MOVES:  # they move every call (FSDP's resharding)
                self.failed = (f"its parameters moved to new memory {self.moves} times, as a "
                               f"wrapper that regathers them every call does")
                warnings.warn(f"{self.module}: {self.failed}, so it runs without CUDA graphs "
                              f"from now on", RuntimeWarning)
            return None
        return graph

    def _capture(self, key, mode, stages, args):
        """Capture ``stages`` on this device's capture stream into a new graph, or None with
        graphs turned off for the module (and a warning) where a capture fails."""
        inputs, rest = args[:self.inputs], args[self.inputs:]
        # ordinary tensors even under inference_mode (whose tensors could not be copied into
        # outside it); autograd stays off
        with self._lock, torch.inference_mode(False), torch.no_grad():
            if self._graphs.get(key) is not None:  # another thread captured it meanwhile
                return self._graphs[key]
            # the graph's input buffers, allocated on the stream that will use them
            static = [a.clone() for a in inputs]
            captured = _capture(lambda: stages(*static, *rest))
            if isinstance(captured, Exception):
                self._failed(f"its {mode} forward", captured)
                return None
            graph, outputs = captured
            parameters = [a.data_ptr() for a in rest if isinstance(a, torch.Tensor)]
            if mode == "training":
                outputs, saved = outputs
                # a parameter as its position in ``args`` (the entry keeps none alive)
                position = {id(a): i for i, a in enumerate(args) if i >= self.inputs}
                saved = [position.get(id(s), s) for s in saved]
                entry = _TrainingGraph(self, graph, static, outputs, saved, parameters)
            else:
                entry = _Graph(graph, static, outputs, parameters)
            self._graphs[key] = entry
        return entry

    def _failed(self, what, error):
        self.failed = f"{type(error).__name__}: {error}"
        self._graphs.clear()
        warnings.warn(f"{self.module}: capturing {what} in a CUDA graph failed, so it runs "
                      f"without graphs from now on ({self.failed})", RuntimeWarning)


_LIBRARY = []  # the torch.library fragment of fusegen's ops, made on the first registration


def register_op(name, schema, run, fake_source):
    """Registers ``fusegen::<name>``, a custom op that torch.compile calls (a launcher, so the
    compiled graph holds one opaque node per kernel; a graph-replaying pipeline's no-grad forward,
    one node per pass). ``run`` is its implementation, its outputs made tensors of their own as an
    op's schema promises; its fake (shapes and dtypes, what tracing runs) is ``fake_source`` run on
    meta tensors. A name another package registered already is the same op (the name holds a
    digest of what it runs): that package's serves both."""
    if not _LIBRARY:
        _LIBRARY.append(torch.library.Library("fusegen", "FRAGMENT"))
    library = _LIBRARY[0]
    try:
        library.define(name + schema)
    except RuntimeError:
        return
    library.impl(name, lambda *args: _new_tensors(run(*args), args), "CompositeExplicitAutograd")
    library.impl(name, fake_on_meta(fake_source), "Meta")  # cheaper to register than register_fake


def register_no_grad_op(name, schema, forward, graphs):
    """Registers ``fusegen::<name>`` for ``forward`` (a generated no-grad forward): at run time the
    op replays it from ``graphs`` (CudaGraphs by parameters) where that pays, as the module's own
    call does."""
    register_op(name, schema, lambda *args: graphs.no_grad(forward, args), forward)


def fake_on_meta(function):
    """A custom op's fake (its outputs' shapes and dtypes, what tracing runs): ``function`` (a
    launcher, a generated pass) run on meta tensors, whose CPU path is the reference math."""

    def fake(*args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        meta = [torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args]
        outputs = function(*meta)
        if isinstance(outputs, tuple):
            return tuple(torch.empty_like(o, device=device) for o in outputs)
        return torch.empty_like(outputs, device=device)

    return fake


def _new_tensors(outputs, inputs):
    """A custom op's outputs as tensors of their own, as an op's schema promises: copies of those
    that are views, inputs, or another output (a pass that hands an input out as an extra output)."""
    if not isinstance(outputs, tuple):
        return _new_tensors((outputs,), inputs)[0]
    seen = {id(a) for a in inputs}
    fresh = []
    for o in outputs:
        if o._is_view() or id(o) in seen:
            o = o.clone()
        seen.add(id(o))
        fresh.append(o)
    return tuple(fresh)


def _capture(run):
    """``run()`` captured into a new CUDA graph on the current device's capture stream, after a
    warm-up run there (cuBLAS's workspace): (graph, what the captured run returned), or the
    RuntimeError that failed the capture."""
    stream = torch.cuda.current_stream()
    side = _capture_stream(stream.device.index)
    side.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(side):
            run()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                returned = run()
            finally:
                graph.capture_end()
    except RuntimeError as error:
        _end_failed_capture(side)
        stream.wait_stream(side)
        return error
    stream.wait_stream(side)
    return graph, returned


class _Graph:
    """One captured no-grad forward: the graph, its input and output buffers, and the addresses
    of the parameters it reads."""

    __slots__ = ("graph", "inputs", "outputs", "single", "parameters")

    def __init__(self, graph, inputs, outputs, parameters):
        self.graph, self.inputs, self.parameters = graph, inputs, parameters
        self.single = isinstance(outputs, torch.Tensor)
        self.outputs = [outputs] if self.single else list(outputs)


class _TrainingGraph:
    """One captured forward under autograd (its outputs, and the tensors its backward reads, in
    the graph's buffers), and its backward's graph, captured on the first backward.

    ``lease``: a weak reference to the replay whose tensors the buffers hold while its backward
    is still to come (dead once autograd drops that replay's ctx). Nothing here refers back to
    the CudaGraphs but weakly: a module's graphs are freed with it, never by the cycle collector
    (which could run during some other capture, where freeing a graph is not allowed)."""

    def __init__(self, graphs, graph, inputs, outputs, saved, parameters):
        self.owner = weakref.ref(graphs)
        self.module, self.lock, self.inputs_count = graphs.module, graphs._lock, graphs.inputs
        self.graph, self.inputs, self.parameters = graph, inputs, parameters
        self.single = isinstance(outputs, torch.Tensor)
        self.outputs = [outputs] if self.single else list(outputs)
        self.saved = saved
        self.lease = None
        self.replays = 0  # forward replays so far: a backward checks its forward's are still there
        # (graph, grad-output buffers, returned grads, weight-GEMM operands, the parameters it
        # reads: (position in saved, address))
        self.backward = None

    def leased(self):
        return self.lease is not None and self.lease() is not None


class _Replay:
    """A replayed forward's hold on its graph's buffers, kept by its autograd ctx: released at the
    end of its backward (backward_done), or when autograd drops the ctx without one."""

    __slots__ = ("entry", "replay", "saved", "__weakref__")

    def __init__(self, entry, args):
        self.entry, self.replay = entry, entry.replays
        # the buffers, and this call's own parameters where the capture's were
        self.saved = tuple(args[s] if isinstance(s, int) else s for s in entry.saved)

    def release(self):
        if self.entry.lease is not None and self.entry.lease() is self:
            self.entry.lease = None


def replay_forward(graph, ctx, stages, args):
    """The outputs of ``stages(*args)`` (a generated forward_stages: the outputs, then what the
    backward reads, which go to ``ctx.save_for_backward``), or of its replay from ``graph``
    (CudaGraphs.training; None: as usual), whose buffers the backward reads instead (no autograd
    bookkeeping for them); ``ctx`` records which for replay_backward."""
    ctx.replayed = None
    if graph is not None:
        with graph.lock:
            if not graph.leased():  # else its buffers hold a pending backward's tensors
                for static, a in zip(graph.inputs, args[:graph.inputs_count]):
                    static.copy_(a)
                graph.graph.replay()
                graph.replays += 1
                ctx.replayed = _Replay(graph, args)
                graph.lease = weakref.ref(ctx.replayed)
                outputs = [out.clone() for out in graph.outputs]
                return outputs[0] if graph.single else tuple(outputs)
    outputs, saved = stages(*args)
    ctx.save_for_backward(*saved)
    return outputs


def saved_tensors(ctx):
    """What the forward saved for the backward: ``ctx.saved_tensors``, or after a replayed forward
    the graph's buffers (and the call's parameters). (A Function of a module without graphs
    records no ``replayed``.)"""
    replayed = getattr(ctx, "replayed", None)
    return ctx.saved_tensors if replayed is None else replayed.saved


def replay_backward(ctx, stages, args):
    """``stages(*args)`` (a generated backward_stages on the output grads, then the saved tensors:
    the grads, then the operands of the weight-grad GEMMs run after it), or, after a replayed
    forward, its replay from a graph: the grads cloned out, the operands in the graph's buffers
    (which no other forward replaces until backward_done)."""
    replayed = ctx.replayed
    if replayed is None or _capturing():  # (a caller capturing the backward: its launches)
        return stages(*args)
    graph = replayed.entry
    if graph.replays != replayed.replay:
        raise RuntimeError(
            f"{graph.module}: a second backward (retain_graph=True) through a forward replayed "
            f"from a CUDA graph, after a later forward of the same shape reused the graph's "
            f"buffers; set module.cuda_graphs.max_rows = 0 to keep each forward's tensors apart")
    grad_outputs = len(graph.outputs)
    with graph.lock:
        if graph.backward is None:
            static = [d.clone(memory_format=torch.contiguous_format) for d in args[:grad_outputs]]
            rest = args[grad_outputs:]
            with torch.inference_mode(False), torch.no_grad():
                captured = _capture(lambda: stages(*static, *rest))
            if isinstance(captured, Exception):  # graphs off from now on; this backward as usual
                owner = graph.owner()
                if owner is not None:
                    owner._failed("its backward", captured)
                return stages(*args)
            backward, (grads, operands) = captured
            # the parameters it reads, where it reads them
            parameters = [(i, s.data_ptr()) for i, s in enumerate(replayed.saved)
                          if isinstance(graph.saved[i], int)]
            graph.backward = (backward, static, grads, operands, parameters)
        backward, static, grads, operands, parameters = graph.backward
        if any(replayed.saved[i].data_ptr() != at for i, at in parameters):
            # a parameter moved since the forward (regathered by a wrapper): the stages as usual,
            # on the forward's tensors in the graph's buffers
            return stages(*args)
        for buffer, d in zip(static, args[:grad_outputs]):
            buffer.copy_(d)
        backward.replay()
        grads = tuple(None if g is None else g.clone() for g in grads)
    return grads, operands


def backward_done(ctx):
    """The end of a backward (after replay_backward and the weight-grad GEMMs that read its
    operands): a replayed forward's graph buffers may take the next forward's tensors."""
    if ctx.replayed is not None:
        ctx.replayed.release()


_CAPTURE_STREAMS = {}  # device index -> the stream captures run on (never the legacy default)


def _capture_stream(index):
    with _LOCK:
        if index not in _CAPTURE_STREAMS:
            _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
        return _CAPTURE_STREAMS[index]


def _end_failed_capture(side):
    """Leave PyTorch as a successful capture would. When a capture fails, CUDAGraph.capture_end
    raises before it takes the random-number generator out of capture mode, and every later
    random op then fails ("Offset increment outside graph capture"); a small capture that
    succeeds ends that mode."""
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            torch.empty(1, device=side.device).zero_()
        finally:
            graph.capture_end()


def _capturing():
    """Whether the current stream is being captured by a caller (its graph then holds our
    launches; a graph cannot be captured inside another)."""
    return torch._C._cuda_isCurrentStreamCapturing()
