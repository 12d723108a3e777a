"""Device time of elementwise backwards with parameter grads (a Bias's column sums) for one
package: how far their row loop's unrolling (templates/elementwise_bwd.cu.j2, ``#pragma unroll 4``
on independent rows) pays. bench/NOTES.md (2026-11-25, seventh session) has the numbers.

Each package is the shipped specs generated with the pragma changed (sm_90 is enough on an
H100 or H200), e.g. for 2:

    sed -i 's/#pragma unroll 4  \\/\\/ independent rows/#pragma unroll 2  \\/\\/ independent rows/' \\
        templates/elementwise_bwd.cu.j2
    fusegen generate --archs sm_90 --out /tmp/u2/generated     # then restore the template

and each runs in its own process (the packages register the same op names), several times in
turn:

    PYTHONPATH=/tmp/u2 python bench/bench_row_unroll.py u2 >> row_unroll.tsv

Columns: label, kernel, rows, dtype, the fastest and the median of do_bench's runs (µs).
"""
import sys

import torch
from triton.testing import do_bench

import generated._kernels as K

CASES = [  # (launcher, dy width, x width or 0 when the launcher takes dy only)
    ("bias_gelu_bwd_n4096", 4096, 4096), ("bias_swiglu_bwd_n14336", 14336, 28672),
    ("bias_bwd_n4096", 4096, 0), ("bias_add_bwd_n4096", 4096, 0),
    ("bias_clamped_swiglu_l6p0_a1p5_o0p5_bwd_n2048", 2048, 4096), ("bias_srelu_bwd_n2048", 2048, 2048),
]


def main(label: str) -> None:
    torch.manual_seed(0)
    for name, n, n_in in CASES:
        launch = getattr(K, name)
        for rows in (16, 512, 4096, 16384, 70000):
            for dtype in (torch.bfloat16, torch.float32):
                dy = torch.randn(rows, n, device="cuda", dtype=dtype)
                args = (dy, torch.randn(rows, n_in, device="cuda", dtype=dtype)) if n_in else (dy,)
                launch(*args)
                torch.cuda.synchronize()
                fastest = do_bench(lambda: launch(*args), warmup=50, rep=200, return_mode="min")
                median = do_bench(lambda: launch(*args), warmup=10, rep=200, return_mode="median")
                print(f"{label}\t{name}\t{rows}\t{str(dtype)[6:]}\t{fastest * 1000:.2f}\t{median * 1000:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
