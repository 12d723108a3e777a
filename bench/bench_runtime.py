"""Issue 13's table: the TE docs MLP (`TeMlp`: LayerNorm, Linear 4096 -> 28672, SwiGLU, Linear
14336 -> 4096; bf16) as eager PyTorch, as torch.compile of that eager module, and as fusegen's
generated module (plain and under torch.compile(fullgraph=True)), side by side in one run.

- host µs: per call while a sleep kernel keeps the device busy (so only the host's own time
  counts), the median of 11 runs, each the mean over its calls, the modules taking turns run by
  run;
- device µs: the device's time for a batch of calls queued behind a sleep (CUDA events around
  the batch, so the host's pace does not count), per call;
- graph breaks: torch._dynamo.explain of the module's forward + backward;
- cold start: a fresh process from its start to its first forward + backward done (synchronised),
  the median of 5, the modules taking turns.

    python3 bench/bench_runtime.py [--out bench/results/runtime_h100.md]
"""

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import generated  # noqa: E402

CYCLES_PER_US = 2000  # torch.cuda._sleep spins about this many cycles per µs (~2 GHz)
HIDDEN, FFN = 4096, 14336


class EagerTeMlp(torch.nn.Module):
    """TeMlp's math in plain PyTorch ops (what a user writes without fusegen), sharing the
    generated module's parameters."""

    def __init__(self, fused):
        super().__init__()
        self.p = dict(fused.named_parameters())

    def forward(self, x):
        p = self.p
        h = F.layer_norm(x, (HIDDEN,), p["0.weight"], p["0.bias"], 1e-5)
        a, b = F.linear(h, p["1.weight"], p["1.bias"]).chunk(2, dim=-1)
        return F.linear(F.silu(a) * b, p["3.weight"], p["3.bias"])


def host_us(fns, calls, device_us_per_call, repeats=11):
    """Host µs per call of each of ``fns`` (name -> function): the median of ``repeats`` runs,
    each the mean over ``calls`` calls queued behind a sleep. The functions take turns run by
    run, so a drift in the host's speed (it moves by tens of percent here) reaches each alike."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    runs = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            torch.cuda._sleep(int(calls * device_us_per_call * CYCLES_PER_US))
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            runs[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: statistics.median(values) for name, values in runs.items()}


def device_us(fn, calls, host_us_per_call):
    """Device µs per call: the calls are queued behind a sleep long enough to cover the host's
    time to queue them, so the events see the device's own time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(calls * host_us_per_call * 2 * CYCLES_PER_US))
        begin.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(begin.elapsed_time(end) * 1000 / calls)
    return statistics.median(runs)


def copy_device_us(nbytes):
    """Device µs to copy ``nbytes`` from one buffer to another (the bandwidth a step can have)."""
    source = torch.empty(nbytes, device="cuda", dtype=torch.uint8)
    target = torch.empty_like(source)
    return device_us(lambda: target.copy_(source), 10, 50)


def graph_breaks(module, x):
    import torch._dynamo

    torch._dynamo.reset()

    def step(x):
        return module(x).sum()

    explained = torch._dynamo.explain(step)(x)
    torch._dynamo.reset()
    return explained.graph_break_count


COLD = textwrap.dedent("""\
    import sys, time
    sys.path.insert(0, {root!r})
    import torch
    {make}
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    module(x).sum().backward()
    torch.cuda.synchronize()
""")
COLD_MAKE = {
    "eager": "import torch.nn.functional as F\n"
             "class M(torch.nn.Module):\n"
             "    def __init__(self):\n"
             "        super().__init__()\n"
             "        self.norm = torch.nn.LayerNorm(4096, device='cuda', dtype=torch.bfloat16)\n"
             "        self.fc1 = torch.nn.Linear(4096, 28672, device='cuda', dtype=torch.bfloat16)\n"
             "        self.fc2 = torch.nn.Linear(14336, 4096, device='cuda', dtype=torch.bfloat16)\n"
             "    def forward(self, x):\n"
             "        a, b = self.fc1(self.norm(x)).chunk(2, dim=-1)\n"
             "        return self.fc2(F.silu(a) * b)\n"
             "module = M()",
    "torch.compile": "@@eager@@\nmodule = torch.compile(module)",
    "fusegen": "import generated\nmodule = generated.TeMlp(device='cuda', dtype=torch.bfloat16)",
    "fusegen + torch.compile": "import generated\n"
                               "module = torch.compile(generated.TeMlp(device='cuda', dtype=torch.bfloat16), fullgraph=True)",
}


def cold_start_s(columns, repeats=5):
    """Seconds from a fresh process's start to its first forward + backward done, per column:
    the median of ``repeats``, the columns taking turns (importing torch alone varies by a
    second between processes here)."""
    scripts = {what: COLD.format(root=str(ROOT), make=COLD_MAKE[what].replace("@@eager@@", COLD_MAKE["eager"]))
               for what in columns}
    times = {what: [] for what in columns}
    for _ in range(repeats):
        for what, script in scripts.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ))
            times[what].append(time.perf_counter() - start)
    return {what: statistics.median(values) for what, values in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, help="also write the table, as markdown, to this file")
    parser.add_argument("--no-cold-start", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    fused = generated.TeMlp(device="cuda", dtype=torch.bfloat16)
    eager = EagerTeMlp(fused)
    modules = {"eager": eager, "torch.compile": torch.compile(eager),
               "fusegen": fused, "fusegen + torch.compile": torch.compile(fused, fullgraph=True)}
    columns = list(modules)
    small = torch.randn(16, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    large = torch.randn(8192, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def no_grad(module, x):
        def run():
            with torch.no_grad():
                module(x)
        return run

    def train(module, x):
        def run():
            module(x).sum().backward()
        return run

    rows = {}
    # fusegen with its CUDA graphs turned off: a second module with the same parameters
    plain = generated.TeMlp(device="cuda", dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict())
    plain.cuda_graphs.max_rows = 0
    no_grad_us = host_us({**{c: no_grad(m, small) for c, m in modules.items()},
                          "plain": no_grad(plain, small)}, 100, 400)
    train_us = host_us({**{c: train(m, small) for c, m in modules.items()},
                        "plain": train(plain, small)}, 10, 4000)
    rows["host µs, no-grad forward, 16 tokens"] = {c: no_grad_us[c] for c in columns}
    rows["host µs, forward + backward, 16 tokens"] = {c: train_us[c] for c in columns}
    rows["(fusegen without CUDA graphs) host µs, no-grad forward, 16 tokens"] = {"fusegen": no_grad_us["plain"]}
    rows["(fusegen without CUDA graphs) host µs, forward + backward, 16 tokens"] = {"fusegen": train_us["plain"]}
    del plain
    rows["device µs, forward + backward, 16 tokens"] = {c: device_us(train(m, small), 10, train_us[c]) for c, m in modules.items()}
    rows["device µs, forward + backward, 8192 tokens"] = {c: device_us(train(m, large), 5, 20000) for c, m in modules.items()}
    rows["graph breaks (torch._dynamo.explain of forward + sum)"] = {
        "torch.compile": graph_breaks(eager, small), "fusegen + torch.compile": graph_breaks(fused, small)}
    if not args.no_cold_start:
        rows["cold start s, fresh process to first forward + backward"] = cold_start_s(columns)

    def cell(value):
        return "" if value is None else (str(value) if isinstance(value, int) else f"{value:.1f}" if value >= 10 else f"{value:.2f}")

    lines = [f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · bf16", "",
             "| | " + " | ".join(columns) + " | fusegen / eager | fusegen + compile / torch.compile |",
             "|---|" + "---|" * (len(columns) + 2)]
    for name, values in rows.items():
        ratio = (f"{values['fusegen'] / values['eager']:.2f}" if values.get("eager") and "fusegen" in values else "")
        ratio_compiled = (f"{values['fusegen + torch.compile'] / values['torch.compile']:.2f}"
                          if values.get("torch.compile") and "fusegen + torch.compile" in values else "")
        lines.append(f"| {name} | " + " | ".join(cell(values.get(c)) for c in columns) + f" | {ratio} | {ratio_compiled} |")
    # the floor of a step at 16 tokens: the weights' bytes, measured as a copy of them in this run
    weight_bytes = sum(p.numel() * p.element_size() for p in fused.parameters() if p.dim() == 2)
    copy_us = copy_device_us(weight_bytes)
    lines += ["", f"Weights: {weight_bytes / 1e6:.0f} MB; copying them (reading W, writing W) took "
              f"{copy_us:.1f} µs ({2 * weight_bytes / copy_us / 1e3:.0f} GB/s). A training step that "
              f"accumulates its weight grads moves at least 4 W with the add inside the wgrad GEMM "
              f"(forward and dgrad read W, the wgrad reads and writes the grad): {2 * copy_us:.0f} µs "
              f"at that speed; with autograd's separate add (a temporary written, then it and the grad "
              f"read and the grad written) 6 W: {3 * copy_us:.0f} µs."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
