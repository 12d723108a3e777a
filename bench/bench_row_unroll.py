"""Device time of elementwise backwards with parameter grads (a Bias's column sums) for one
package: how many rows their row loop should unroll (templates/elementwise/elementwise_bwd.cu.j2,
``#pragma unroll {{ row_unroll }}``; stages/elementwise/kernels.py: ``_row_unroll``, about 8 vectors in
flight a thread). bench/NOTES.md (2026-11-25 and 2026-11-26) has the numbers.

Each package is the shipped specs generated with the unroll fixed (sm_90 is enough on an H100 or
H200), e.g. for 2:

    sed -i 's/#pragma unroll {{ row_unroll }}/#pragma unroll 2/' templates/elementwise/elementwise_bwd.cu.j2
    fusegen generate --archs sm_90 --out /tmp/u2/generated     # then restore the template

and each runs in its own process (the packages register the same op names), several times in
turn; the checkout's own package (the rule) too:

    PYTHONPATH=/tmp/u2 python bench/bench_row_unroll.py u2 >> row_unroll.tsv
    PYTHONPATH=. python bench/bench_row_unroll.py rule >> row_unroll.tsv

Columns: label, kernel, rows, dtype, the fastest and the median of do_bench's runs (µs).
"""
import sys

import torch
from triton.testing import do_bench

import generated._kernels as K


def rows_by(*widths):
    """The launcher's arguments after dy: a [rows, width] tensor a width, a [width] one for a
    negative width (a parameter), a Dropout key for 0."""
    def make(rows, dtype):
        return tuple(torch.randint(-2**62, 2**62, (1,), dtype=torch.int64, device="cuda") if w == 0 else
                     torch.randn(-w, device="cuda", dtype=dtype) if w < 0 else
                     torch.randn(rows, w, device="cuda", dtype=dtype) for w in widths)
    return make


CASES = [  # (launcher, dy width, its other arguments); the comment: vectors a thread loads a row
    ("bias_bwd_n4096", 4096, rows_by()),  # 1
    ("bias_add_bwd_n4096", 4096, rows_by()),  # 1
    ("bias_dropout0p1_add_bwd_n256", 256, rows_by(0)),  # 1
    ("bias_gelu_bwd_n4096", 4096, rows_by(4096)),  # 2
    ("bias_srelu_bwd_n2048", 2048, rows_by(2048)),  # 2
    ("bias_gelu_dropout0p1_bwd_n512", 512, rows_by(512, 0)),  # 2
    ("bias_swiglu_bwd_n14336", 14336, rows_by(28672)),  # 3
    ("bias_clamped_swiglu_l6p0_a1p5_o0p5_bwd_n2048", 2048, rows_by(4096)),  # 3
    ("bias_situglu_b2p0_c8p0_bwd_n512", 512, rows_by(1024)),  # 3
    ("bias_glu_bwd_n512", 512, rows_by(1024)),  # 3
    ("bias_reglu_bwd_n512", 512, rows_by(1024)),  # 3
    ("bias_qgeglu_bwd_n512", 512, rows_by(1024)),  # 3
    ("bias_swiglu_i32_bwd_n512", 512, rows_by(1024)),  # 3
    ("bias_dropout0p2_swiglu_bwd_n512_from_dropout0p2", 512, rows_by(1024, 0)),  # 3
    ("bias_add_tee_gelu_bwd_n256_from_bias", 256, rows_by(256, -256, 256, 256)),  # 4
    ("bias_scale0p5_gelu_x3d12017c_bwd_n384_from_bias", 384, rows_by(768, -768, 768, 768, -768, 384)),  # 8
]


def main(label: str) -> None:
    torch.manual_seed(0)
    for name, n, rest in CASES:
        launch = getattr(K, name)
        for rows in (512, 16384, 70000):
            for dtype in (torch.bfloat16, torch.float32):
                args = (torch.randn(rows, n, device="cuda", dtype=dtype), *rest(rows, dtype))
                launch(*args)
                torch.cuda.synchronize()
                fastest = do_bench(lambda: launch(*args), warmup=25, rep=100, return_mode="min")
                median = do_bench(lambda: launch(*args), warmup=5, rep=100, return_mode="median")
                print(f"{label}\t{name}\t{rows}\t{str(dtype)[6:]}\t{fastest * 1000:.2f}\t{median * 1000:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
