"""Size-generic elementwise kernels against the fixed-size kernels of the same run, in one run on
a GPU: device time and bandwidth (bytes the kernel must move / median time) for SwiGLU forward and
backward and GELU forward, at a width both exist for (the generic kernel's 16-byte vector path,
launched directly, bypassing the launcher's dispatch to the fixed kernel), at an aligned width no
fixed kernel has, and at an odd width (the scalar path). Copy bandwidth measured in the same run.

    python3 bench/bench_size_generic.py [--rows 16384] [--dtype bfloat16]
"""

import argparse
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
importlib.import_module("conftest")  # maps this checkout as `fusegen` where it is not installed
from generated import _kernels as K  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from bench_pipelines import copy_bandwidth, median_ms  # noqa: E402


def generic_launch(kernel, vec, x, *outs_and_rows_n):
    """The size-generic kernel itself, on the vector or scalar path its width and pointers pick."""
    rows, n = outs_and_rows_n[-2], outs_and_rows_n[-1]
    grid = (-(-n // (vec * 128)), min(rows, K.ELEMENTWISE_SPLITS), 1)
    return lambda: kernel.launch(x.dtype, grid, (128, 1, 1), (x, *outs_and_rows_n), x.device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype, rows = getattr(torch, args.dtype), args.rows
    size = torch.tensor([], dtype=dtype).element_size()
    vec = 16 // size
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · {args.dtype} · {rows} rows · "
          f"copy {copy:.0f} GB/s\n")
    print("| kernel | width (out) | path | µs | GB/s | % of copy |")
    print("| --- | --- | --- | --- | --- | --- |")

    def report(name, width, path, fn, nbytes):
        ms = median_ms(fn, batch=5)
        gbs = nbytes / ms / 1e6
        print(f"| `{name}` | {width} | {path} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy:.0f}% |")

    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)  # noqa: E731
    for n, path in ((4096, "fixed"), (4096, "generic, vector"), (4104, "generic, vector"), (4097, "generic, scalar")):
        x, dy = r(rows, 2 * n), r(rows, n)
        y, dx = torch.empty(rows, n, device="cuda", dtype=dtype), torch.empty_like(x)
        fwd_bytes, bwd_bytes = 3 * rows * n * size, 5 * rows * n * size
        if path == "fixed":
            report("swiglu_fwd_n4096", n, path, lambda: K.swiglu_fwd_n4096(x), fwd_bytes)
            report("swiglu_bwd_n4096", n, path, lambda: K.swiglu_bwd_n4096(dy, x), bwd_bytes)
            continue
        report("swiglu_fwd_any", n, path, generic_launch(K._SWIGLU_FWD_ANY, vec, x, y, rows, n), fwd_bytes)
        report("swiglu_bwd_any", n, path, generic_launch(K._SWIGLU_BWD_ANY, vec, dy, x, dx, rows, n), bwd_bytes)
    for n, path in ((4096, "fixed"), (4096, "generic, vector"), (4097, "generic, scalar")):
        x = r(rows, n)
        y = torch.empty_like(x)
        if path == "fixed":
            report("gelu_fwd_n4096", n, path, lambda: K.gelu_fwd_n4096(x), 2 * rows * n * size)
        else:
            report("gelu_fwd_any", n, path, generic_launch(K._GELU_FWD_ANY, vec, x, y, rows, n), 2 * rows * n * size)


if __name__ == "__main__":
    main()
