"""Issue 36's per-call checks, priced: a generated module's steps with its input and parameter checks
(`check_input`, `check_parameters`, as generated) and with them turned off (the pipeline module's
two names bound to a no-op), side by side in one process, at 16 tokens in bf16, where a step is
bound by the host.

Each figure is steps run back to back, CUDA events around `--steps` of them, so the time is what
a training or decoding loop sees per step; the two variants take turns, `--rounds` times, and the
table gives each one's median.

    python3 bench/bench_call_checks.py [--out bench/results/call_checks_<gpu>.md]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import generated  # noqa: E402

CHECKS = ("check_input", "check_parameters")


def no_check(*args, **kwargs):
    return None


def step_us(step, steps):
    """µs per step over ``steps`` steps run back to back."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1000 / steps


def compare(module, step, steps, rounds):
    """Median µs per step with the checks as generated and with them off, taking turns."""
    pipeline = sys.modules[type(module).__module__]
    generated_checks = {name: getattr(pipeline, name) for name in CHECKS}
    variants = {"checks": generated_checks, "no checks": {name: no_check for name in CHECKS}}
    times = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, functions in variants.items():
                for attr, fn in functions.items():
                    setattr(pipeline, attr, fn)
                step_us(step, 10)  # warm (the second call of a shape captures its CUDA graphs)
                times[name].append(step_us(step, steps))
    finally:
        for attr, fn in generated_checks.items():
            setattr(pipeline, attr, fn)
    return {name: statistics.median(values) for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for cls in ("TeMlp", "Gpt2Mlp", "PrenormBlock"):
        for graphs in (True, False):
            module = getattr(generated, cls)(device="cuda", dtype=torch.bfloat16)
            if not graphs:
                module.cuda_graphs.max_rows = 0
            x = torch.randn(16, module.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            extra = [torch.randn(16, f, device="cuda", dtype=torch.bfloat16) for f in module.extra_input_features]

            def no_grad(module=module, x=x, extra=extra):
                with torch.no_grad():
                    module(x, *extra)

            def train(module=module, x=x, extra=extra):
                out = module(x, *extra)
                (out[0] if isinstance(out, tuple) else out).sum().backward()

            tag = "CUDA graphs" if graphs else "no CUDA graphs"
            rows.append((f"{cls} no-grad forward ({tag})", compare(module, no_grad, 200, args.rounds)))
            rows.append((f"{cls} forward + backward ({tag})", compare(module, train, 50, args.rounds)))
            del module
    lines = [f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · bf16, 16 tokens · µs per step, "
             f"steps back to back, median of {args.rounds} turns", "",
             "| step | with the checks | without | difference |", "|---|---|---|---|"]
    for name, t in rows:
        lines.append(f"| {name} | {t['checks']:.1f} | {t['no checks']:.1f} | {t['checks'] - t['no checks']:+.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
