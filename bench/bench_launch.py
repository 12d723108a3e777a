"""Where the host time of a generated kernel launch goes, on a GPU, side by side with its floors.

Host µs per call: the median of 7 runs, each the mean over many calls made while the GPU is kept
busy by a long sleep kernel queued first (so the host never waits for the device and only its
own time is counted):

- the floors: the driver's cuLaunchKernel through cuda-bindings with a prepacked argument array
  (the cheapest call found for a package free of compilers, and what fusegen calls), the same
  call packing a (values, types) tuple, the same driver function through ctypes (slower: ctypes
  converts eleven arguments), and `torch.add` on a small tensor (PyTorch's own dispatch + launch,
  with and without an output allocation);
- fusegen: `Kernel.launch` (the lean path: cached handle, one struct.pack_into into a per-thread
  buffer, PyTorch's raw current stream), and a generated launcher (output allocation + launch);
- the pieces a launch is made of, each timed alone;
- whole modules: the TE docs MLP (`TeMlp`) at 16 tokens, no-grad forward and forward + backward,
  generated vs eager PyTorch (the same math in plain torch ops: F.layer_norm, F.linear, silu * up)
  and vs fusegen's unfused reference Sequential; then the generated no-grad forward's steps.

    python3 bench/bench_launch.py [--tokens 16] [--calls 400]
"""

import argparse
import ctypes
import importlib
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

importlib.import_module("conftest")  # maps this checkout as `fusegen` where it is not installed (GPU machine)
import generated  # noqa: E402
from generated import _kernels as K  # noqa: E402
from references import randomize_  # noqa: E402

SLEEP_CYCLES_PER_US = 2000  # torch.cuda._sleep spins this many cycles per µs, roughly (~2 GHz)


def host_us(fn, calls, repeats=7):
    """Host µs of one ``fn()`` while the device is busy (a sleep queued first): the median over
    ``repeats`` runs of the mean over ``calls`` calls (a shared host's timings are noisy)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        torch.cuda._sleep(int(calls * 200 * SLEEP_CYCLES_PER_US))  # ~200 µs of device time per call
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(runs)[len(runs) // 2]


def launch_rows(calls):
    from cuda.bindings import driver

    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    K.gelu_fwd_n256(x)  # loads the kernel
    kernel = K._GELU_FWD_N256
    ready = kernel._ready[torch.bfloat16, 0]
    _, params, _ = ready.buffer()
    grid, block = (K._GELU_FWD_N256_GRID_X[torch.bfloat16], 16, 1), (128, 1, 1)
    stream = torch.cuda.current_stream().cuda_stream
    function = ready.function
    args = (x.data_ptr(), y.data_ptr(), 16)
    packed = ((x.data_ptr(), y.data_ptr(), 16), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int))
    small_a, small_b = torch.randn(16, 256, device="cuda"), torch.randn(16, 256, device="cuda")
    small_out = torch.empty_like(small_a)
    layout = struct.Struct("<QQi4x")
    data, _, _ = ready.buffer()
    libcuda = ctypes.CDLL("libcuda.so.1")
    by_ctypes = libcuda.cuLaunchKernel
    by_ctypes.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    by_ctypes.restype = ctypes.c_int
    address = int(function)
    static = torch._C._StaticCudaLauncher._launch_kernel  # inductor's launcher of its cubins
    return [
        ("floor: cuda-bindings cuLaunchKernel, prepacked", lambda: driver.cuLaunchKernel(function, *grid, *block, 0, stream, params, 0)),
        ("cuda-bindings cuLaunchKernel, packs a tuple", lambda: driver.cuLaunchKernel(function, *grid, *block, 0, stream, packed, 0)),
        ("ctypes libcuda cuLaunchKernel, prepacked", lambda: by_ctypes(address, *grid, *block, 0, stream, params, None)),
        ("torch's C++ launcher (_StaticCudaLauncher), a tuple", lambda: static(address, *grid, 4, 0, "KKi", args, stream)),
        ("torch.add(a, b, out=c), 16x256 fp32", lambda: torch.add(small_a, small_b, out=small_out)),
        ("torch.add(a, b) (allocates), 16x256 fp32", lambda: torch.add(small_a, small_b)),
        ("fusegen Kernel.launch (lean path)", lambda: kernel.launch(torch.bfloat16, grid, block, args, 0)),
        ("fusegen launcher gelu_fwd_n256(x) (allocates)", lambda: K.gelu_fwd_n256(x)),
        ("  piece: torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("  piece: 3 x tensor.data_ptr()", lambda: (x.data_ptr(), y.data_ptr(), x.data_ptr())),
        ("  piece: struct pack_into (3 arguments)", lambda: layout.pack_into(data, 0, *args)),
        ("  piece: torch raw current stream", lambda: torch._C._cuda_getCurrentRawStream(0)),
        ("  piece: torch current device", lambda: torch._C._cuda_getDevice()),
        ("  piece: thread-local argument buffer", lambda: ready.buffer()),
        ("  piece: x.get_device()", lambda: x.get_device()),
    ]


class PlainTeMlp(torch.nn.Module):
    """TeMlp's math in plain PyTorch ops, holding the generated module's parameters."""

    def __init__(self, gen):
        super().__init__()
        self.p = dict(gen.named_parameters())

    def forward(self, x):
        p = self.p
        h = torch.nn.functional.layer_norm(x, (4096,), p["0.weight"], p["0.bias"], 1e-5)
        a, b = torch.nn.functional.linear(h, p["1.weight"], p["1.bias"]).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(a) * b, p["3.weight"], p["3.bias"])


def module_rows(tokens, calls):
    from fusegen import eager

    gen = generated.TeMlp(device="cuda", dtype=torch.bfloat16)
    randomize_(gen)
    ref = eager.Sequential(eager.LayerNorm(4096), eager.Linear(4096, 28672), eager.SwiGLU(), eager.Linear(14336, 4096))
    ref = ref.to(device="cuda", dtype=torch.bfloat16)
    ref.load_state_dict(gen.state_dict())
    plain = PlainTeMlp(gen)
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def no_grad(module):
        def run():
            with torch.no_grad():
                module(x)
        return run

    def train(module):
        def run():
            module(x).sum().backward()
        return run

    calls = max(1, calls // 20)  # ~20 launches each: keep the queue below its limit
    rows = [(what, [host_us(fn(m), calls) for m in (gen, plain, ref)])
            for what, fn in (("no-grad forward", no_grad), ("forward + backward", train))]
    # the generated no-grad forward, step by step
    from generated import te_mlp
    p = dict(gen.named_parameters())
    flat = x.detach()
    h = K.layernorm_fwd_h4096(flat, p["0.weight"], p["0.bias"])[0]
    u = torch.addmm(p["1.bias"], h, p["1.weight"].t())
    s = K.swiglu_fwd_n14336(u)
    steps = [
        ("module call, whole", no_grad(gen)),
        ("check_input", lambda: te_mlp.check_input("TeMlp", "x", flat, 4096, p["0.weight"])),
        ("torch.no_grad() enter + exit", no_grad(lambda _: None)),
        ("x.reshape(-1, 4096).contiguous()", lambda: flat.reshape(-1, 4096).contiguous()),
        ("layernorm_fwd_h4096 (3 allocations + launch)", lambda: K.layernorm_fwd_h4096(flat, p["0.weight"], p["0.bias"])),
        ("torch.addmm 4096 -> 28672", lambda: torch.addmm(p["1.bias"], h, p["1.weight"].t())),
        ("swiglu_fwd_n14336 (allocation + launch)", lambda: K.swiglu_fwd_n14336(u)),
        ("torch.addmm 14336 -> 4096", lambda: torch.addmm(p["3.bias"], s, p["3.weight"].t())),
    ]
    return rows, [(what, host_us(fn, calls)) for what, fn in steps]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · host µs per call: median of 7 "
          f"runs of {args.calls} calls (modules: {max(1, args.calls // 20)}) with the device kept busy")
    print(f"\n{'launch':52} {'host µs':>8}")
    for name, fn in launch_rows(args.calls):
        print(f"{name:52} {host_us(fn, args.calls):8.2f}")
    rows, steps = module_rows(args.tokens, args.calls)
    print(f"\n{'TeMlp, %d tokens, bf16 (host µs)' % args.tokens:36} {'fusegen':>9} {'PyTorch':>9} {'ratio':>7} "
          f"{'unfused':>9}")
    for what, (g, plain, unfused) in rows:
        print(f"{what:36} {g:9.1f} {plain:9.1f} {g / plain:7.2f} {unfused:9.1f}")
    print(f"\n{'the generated no-grad forward, by step':46} {'host µs':>8}")
    for what, us in steps:
        print(f"{what:46} {us:8.2f}")


if __name__ == "__main__":
    main()
