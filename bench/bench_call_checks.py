"""Issue 36's run-time checks, priced: the host µs of a generated module's call with them (this tree's
`generated/`) and without them (the package of the tree before, b1c8acd, in another folder), at
16 tokens in bf16, where a call is bound by the host.

Each package runs in processes of its own (two packages named `generated` cannot share one, and
their custom ops share names), the processes taking turns, `--rounds` of each; a process reports,
per case, the median over 11 runs of the mean host µs per call, calls queued behind a sleep so
the device never makes the host wait (bench_runtime.host_us). The table gives each case's
median over the rounds.

    python3 bench/bench_call_checks.py --before /path/holding/the/old/generated [--out FILE]
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import json, sys
sys.path.insert(0, {bench!r})
sys.path.insert(0, {root!r})
import torch
import generated
from bench_runtime import host_us

torch.manual_seed(0)
cases = {{}}
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

        tag = "graphs" if graphs else "no graphs"
        cases[f"{{cls}} no-grad forward ({{tag}})"] = host_us({{"f": no_grad}}, 100, 400)["f"]
        cases[f"{{cls}} forward + backward ({{tag}})"] = host_us({{"f": train}}, 10, 4000)["f"]
        del module
print(json.dumps(cases))
"""


def measure(root: Path) -> dict:
    script = MEASURE.format(bench=str(ROOT / "bench"), root=str(root))
    result = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    return json.loads(result.stdout.splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True, help="a folder holding the old `generated` package")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = {"before": [], "now": []}
    for _ in range(args.rounds):
        runs["before"].append(measure(args.before.resolve()))
        runs["now"].append(measure(ROOT))
    import torch

    lines = [f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · bf16, 16 tokens · "
             f"median over {args.rounds} rounds of alternating processes", "",
             "| host µs per call | before (b1c8acd) | now | now / before |", "|---|---|---|---|"]
    for case in runs["now"][0]:
        before = statistics.median(r[case] for r in runs["before"])
        now = statistics.median(r[case] for r in runs["now"])
        lines.append(f"| {case} | {before:.1f} | {now:.1f} | {now / before:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
