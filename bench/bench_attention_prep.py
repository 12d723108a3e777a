"""Achieved bandwidth of the attention prep kernels (stages/attention/) of the Llama-3-8B layer
(specs/llama_layer.py: 32 + 2 x 8 heads of 128, rotary base 500000) at 16,384 rows, against a
device-to-device copy of the same bytes (the ceiling) and the torch ops they replace (the split,
rotary and layout in fp32 around FlashAttention-2, as the attention stage ran them before).

Each is timed as many back-to-back launches between CUDA events (median of several runs); bytes
are what the kernel must move: the projection read once and the buffer written once (forward), dq,
dk, dv read once and the grad written once (backward). Run: python bench/bench_attention_prep.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generated import _kernels as K  # noqa: E402
from generated import _reference as ref  # noqa: E402

ROWS, HEADS, KV, D, BASE = 16384, 32, 8, 128, 500000.0
LENGTHS = [3778, 498, 2901, 1200, 3100, 2307, 2600]  # 7 documents of 498-3,778 (the bench)
WIDTH = (HEADS + 2 * KV) * D


def timed(fn, reps=50, runs=5):
    """Median µs per call of ``fn`` over ``runs`` runs of ``reps`` back-to-back calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def torch_forward(x, cu):
    q, k, v = ref.attention_inputs(x.float(), cu, HEADS, KV, BASE)
    return q.to(x.dtype).contiguous(), k.to(x.dtype).contiguous(), v.to(x.dtype).contiguous()


def torch_backward(dq, dk, dv, cu):
    return ref.attention_inputs_bwd(dq.float(), dk.float(), dv.float(), cu, BASE).to(dq.dtype)


def main():
    assert sum(LENGTHS) == ROWS
    cu = torch.zeros(len(LENGTHS) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(LENGTHS).cumsum(0)
    cu = cu.cuda()
    print(f"device: {torch.cuda.get_device_name()}; rows {ROWS}, width {WIDTH}")
    print(f"{'dtype':<6} {'what':<34} {'µs':>8} {'TB/s':>6}")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(ROWS, WIDTH, device="cuda").to(dtype)
        dq = torch.randn(ROWS, HEADS, D, device="cuda").to(dtype)
        dk, dv = torch.randn(2, ROWS, KV, D, device="cuda").to(dtype)
        moved = 2 * ROWS * WIDTH * x.element_size()  # read once, written once
        fwd = K.qkv_prep_rope500000_fwd_h32_kv8_d128
        bwd = K.qkv_prep_rope500000_bwd_h32_kv8_d128
        rows = [("copy (x.clone(), the ceiling)", lambda: x.clone()),
                ("prep forward kernel", lambda: fwd(x, cu)),
                ("prep backward kernel", lambda: bwd(dq, dk, dv, cu)),
                ("torch ops forward (before)", lambda: torch_forward(x, cu)),
                ("torch ops backward (before)", lambda: torch_backward(dq, dk, dv, cu))]
        for what, fn in rows:
            us = timed(fn)
            print(f"{str(dtype)[6:]:<6} {what:<34} {us:8.1f} {moved / us / 1e6:6.2f}")


if __name__ == "__main__":
    main()
