"""Benchmark the generated package on a GPU, side by side with its peers, in one run.

For each generated kernel: achieved bandwidth (bytes it must move / median time) against a
device-to-device copy. For each shipped pipeline, forward + backward: generated vs eager PyTorch
(fusegen's unfused reference Sequential) vs torch.compile of that eager module.
Times are medians of CUDA-event timings after warm-up (triton.testing.do_bench when present).

    python3 bench/bench_pipelines.py [--rows 8192] [--dtype bfloat16]
"""

import argparse
import importlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

importlib.import_module("conftest")  # maps this checkout as `fusegen` where it is not installed (GPU machine)
import generated  # noqa: E402
from generated import _kernels as K  # noqa: E402
from references import PIPELINES, randomize_  # noqa: E402


def median_ms(fn, warmup=5, reps=30, batch=1):
    """Median device time of one call; ``batch`` calls back to back per measurement keep the GPU
    queue full, so host-side launch cost shows only where it exceeds the kernel's own time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6  # GB/s, read + write


def kernel_rows(rows, dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    r = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)  # noqa: E731
    x4k, x1k, h28k, d14k, d4k = r(rows, 4096), r(rows, 1024), r(rows, 28672), r(rows, 14336), r(rows, 4096)
    w4k, w1k = r(4096), r(1024)
    ln_y, ln_mean, ln_rstd = K.layernorm_fwd_h4096(x4k, w4k, w4k)
    _, rms_rstd = K.rmsnorm_fwd_h4096(x4k, w4k)
    e = rows * size
    return [  # name, callable, bytes it must move
        ("layernorm_fwd_h4096", lambda: K.layernorm_fwd_h4096(x4k, w4k, w4k), 2 * 4096 * e),
        ("layernorm_bwd_h4096", lambda: K.layernorm_bwd_h4096(d4k, x4k, ln_mean, ln_rstd, w4k), 3 * 4096 * e),
        ("rmsnorm_fwd_h4096", lambda: K.rmsnorm_fwd_h4096(x4k, w4k), 2 * 4096 * e),
        ("rmsnorm_bwd_h4096_add_dresidual", lambda: K.rmsnorm_bwd_h4096_add_dresidual(d4k, x4k, rms_rstd, w4k, d4k), 4 * 4096 * e),
        ("layernorm_fwd_h1024", lambda: K.layernorm_fwd_h1024(x1k, w1k, w1k), 2 * 1024 * e),
        ("swiglu_fwd_n14336", lambda: K.swiglu_fwd_n14336(h28k), 3 * 14336 * e),
        ("bias_swiglu_bwd_n14336", lambda: K.bias_swiglu_bwd_n14336(d14k, h28k), 5 * 14336 * e),
        ("gelu_fwd_n4096", lambda: K.gelu_fwd_n4096(x4k), 2 * 4096 * e),
        ("bias_gelu_bwd_n4096", lambda: K.bias_gelu_bwd_n4096(d4k, x4k), 3 * 4096 * e),
        ("add_fwd_n4096", lambda: K.add_fwd_n4096(x4k, d4k), 3 * 4096 * e),
        ("bias_add_bwd_n4096", lambda: K.bias_add_bwd_n4096(d4k), 4096 * e),
    ]


def pipeline_rows(rows, dtype):
    from fusegen import eager

    # the eager module equal to each spec, built from the generated module's own op list
    eager_modules = {
        "te_mlp": lambda: eager.Sequential(eager.LayerNorm(4096), eager.Linear(4096, 28672), eager.SwiGLU(), eager.Linear(14336, 4096)),
        "fc1": lambda: eager.Sequential(eager.LayerNorm(4096), eager.MakeExtraOutput(), eager.Linear(4096, 28672), eager.SwiGLU()),
        "fc2": lambda: eager.Sequential(eager.Linear(14336, 4096), eager.AddExtraInput()),
        "prenorm_block": lambda: eager.Sequential(eager.MakeExtraOutput(), eager.RMSNorm(4096), eager.Linear(4096, 4096), eager.AddExtraInput()),
        "gpt2_mlp": lambda: eager.Sequential(eager.LayerNorm(1024), eager.Linear(1024, 4096), eager.GELU(), eager.Linear(4096, 1024)),
    }
    out = []
    for name, build_eager in eager_modules.items():
        cls = PIPELINES[name][0]
        gen = getattr(generated, cls)(device="cuda", dtype=dtype)
        randomize_(gen)
        ref = build_eager().to(device="cuda", dtype=dtype)
        ref.load_state_dict(gen.state_dict())
        compiled = torch.compile(ref)
        x = torch.randn(rows, gen.in_features, device="cuda", dtype=dtype, requires_grad=True)
        extra = [torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True) for n in gen.extra_input_features]

        def step(module):
            def run():
                outs = module(x, *extra)
                outs = outs if isinstance(outs, tuple) else (outs,)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            return run

        out.append((name, [median_ms(step(m), warmup=3, reps=10) for m in (gen, ref, compiled)]))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--skip-pipelines", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · rows {args.rows} · {args.dtype}")
    copy = copy_bandwidth()
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)\n")
    print(f"{'kernel (back to back; single call)':36} {'ms':>8} {'GB/s':>8} {'% copy':>7} {'1 call ms':>10}")
    for name, fn, nbytes in kernel_rows(args.rows, dtype):
        ms, ms_single = median_ms(fn, batch=20), median_ms(fn)
        gbs = nbytes / ms / 1e6
        print(f"{name:36} {ms:8.3f} {gbs:8.0f} {100 * gbs / copy:6.1f}% {ms_single:10.3f}")
    if not args.skip_pipelines:
        print(f"\n{'pipeline fwd+bwd (ms)':24} {'fusegen':>9} {'eager':>9} {'compile':>9}")
        for name, (g, e, c) in pipeline_rows(args.rows, dtype):
            print(f"{name:24} {g:9.3f} {e:9.3f} {c:9.3f}")


if __name__ == "__main__":
    main()
