"""Issue 37's one shape of generated autograd.Function, priced: the pipelines that ran their stages
inline in the Function now run forward_stages / backward_stages through the runtime's
replay_forward / replay_backward (with no CUDA graph). Each module of the package before that
change (a copy of its generated/, loaded as ``generated_before``) and of the tree as it is take
turns in one process on the same parameters and inputs.

- a training step: forward + backward, steps run back to back, CUDA events around ``steps`` of
  them, µs per step; the median over ``rounds`` turns of each package; at 16 rows (the host's
  time: the device waits on it) and at 8192 rows (the device's);
- the host's µs per training step at 16 rows, the steps queued behind a sleep kernel (so the host
  never waits on the device): what the generated Python costs, without the device's noise.

    python3 bench/bench_function_shape.py --before bench/build/generated_before [--out FILE]
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import generated  # noqa: E402

# (class, the input width of a size-generic pipeline) of the pipelines whose Function changed shape
MODULES = [("GeluAny", 4096), ("SwigluAny", 4096), ("ResidualAny", 4096), ("DropoutAny", 4096),
           ("LinearResidual", None), ("InPlaceMid", None), ("ScaledProjection", None), ("MoeSwiglu", 4096),
           ("PrenormInPlace", None), ("ScaledResidual", None)]


def load_before(path: Path):
    """The package before the change, imported as ``generated_before`` (its own modules, kernels
    and runtime)."""
    spec = importlib.util.spec_from_file_location("generated_before", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["generated_before"] = module
    spec.loader.exec_module(module)
    return module


def inputs(module, rows: int, n: int | None):
    """x and the extra inputs of ``module`` at ``rows`` rows (bf16, CUDA), x requiring its grad."""
    width = module.in_features or n
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    extra = []
    for features in module.extra_input_features:
        shape = (rows,) if features == "rows" else (rows, width if features == "n" else features)
        extra.append(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    return x, extra


def step_us(module, x, extra, steps: int) -> float:
    """µs per training step, ``steps`` of them back to back under CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        out = module(x, *[e.clone() for e in extra])  # an in-place pipeline writes its extra input
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / steps


CYCLES_PER_US = 2000  # torch.cuda._sleep spins about this many cycles per µs (~2 GHz)


def host_us(module, x, extra, steps: int) -> float:
    """The host's µs per training step, ``steps`` of them queued behind a sleep kernel long enough
    that the host never waits for the device."""
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000 * CYCLES_PER_US)  # 100 ms
    start = time.perf_counter()
    for _ in range(steps):
        out = module(x, *[e.clone() for e in extra])
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed * 1e6 / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    before_package = load_before(args.before)
    torch.manual_seed(0)
    lines = [f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · bf16 · µs per training step "
             f"(forward + backward), steps back to back under CUDA events, median of {args.rounds} turns", "",
             "| pipeline | rows | before (inline Function) | after (one shape) | difference |", "|---|---|---|---|---|"]
    for cls, n in MODULES:
        after = getattr(generated, cls)(device="cuda", dtype=torch.bfloat16)
        before = getattr(before_package, cls)(device="cuda", dtype=torch.bfloat16)
        before.load_state_dict(after.state_dict())
        for rows, steps in ((16, 100), (8192, 20)):
            x, extra = inputs(after, rows, n)
            times = {"before": [], "after": []}
            for module in (before, after):  # warm: kernels loaded, allocator settled
                step_us(module, x, extra, 5)
            for _ in range(args.rounds):
                for name, module in (("before", before), ("after", after)):
                    times[name].append(step_us(module, x, extra, steps))
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            lines.append(f"| {cls} | {rows} | {b:.1f} | {a:.1f} | {a - b:+.1f} ({(a / b - 1) * 100:+.1f}%) |")
            print(lines[-1], flush=True)
            if rows == 16:
                host = {"before": [], "after": []}
                for _ in range(args.rounds):
                    for name, module in (("before", before), ("after", after)):
                        host[name].append(host_us(module, x, extra, 40))
                b, a = statistics.median(host["before"]), statistics.median(host["after"])
                lines.append(f"| {cls} | 16, host only | {b:.1f} | {a:.1f} | {a - b:+.1f} ({(a / b - 1) * 100:+.1f}%) |")
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
