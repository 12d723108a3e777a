"""Launching a loaded kernel (part of a fusegen output's runtime: templates/runtime/, copied
verbatim; do not edit).

Launches go on PyTorch's current stream; this module never synchronises the host
and never allocates, so whole forward and backward passes can be captured in a CUDA graph (after
one eager warm-up step, as usual, so that the loading happens outside the capture).
"""

import ctypes
import struct
import threading

import torch

from .loading import _FUNCTIONS, _check, _driver, _ensure_context, _load

DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
