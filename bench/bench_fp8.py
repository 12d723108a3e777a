"""Issue 40's FP8 benchmark: the Llama-3-8B MLP block (RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU,
Linear 14336 -> 4096, the residual around them; no biases; bf16 parameters and activations) as

- eager PyTorch bf16 and torch.compile of it;
- torchao's float8 training (``convert_to_float8_training``, recipes "tensorwise" and "rowwise")
  under torch.compile, where torchao is installed;
- the generated block (``generated.LlamaMlp``, specs/fp8_mlp.py) in bf16, and inside
  ``generated.autocast`` with each recipe it is built for (current, delayed, rowwise),

side by side in one run, each holding the eager module's weights. A training step (forward +
backward, the backward outside the autocast as TE's users write it) and a no-grad forward, steps
run back to back under CUDA events (``steps`` of them, the median of ``rounds`` turns, the modules
taking turns), at 16,384, 8,192, 2,048, 1,024 and 128 tokens (below the block's fp8_min_rows, 2,048,
the FP8 modules run in bf16). First each FP8 module's output and x's grad
are checked against the bf16 block's (FP8 rounds operands to 3 or 2 mantissa bits: within 10% of
the largest value, a check of wiring, not of numerics, which tests/runtime/test_fp8.py holds).

    python3 bench/bench_fp8.py [--out bench/results/fp8_h100.md]
"""

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_layer import timed  # noqa: E402  (steps back to back under CUDA events)

HIDDEN, FFN = 4096, 14336
TOKENS = (16384, 8192, 2048, 1024, 128)
KEYS = {"norm.weight": "0.0.weight", "fc1.weight": "0.1.weight", "fc2.weight": "0.3.weight"}


class EagerMlp(torch.nn.Module):
    """The block in plain PyTorch, as a user writes it without fusegen."""

    def __init__(self, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm = torch.nn.RMSNorm(HIDDEN, eps=1e-5, **kw)
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False, **kw)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False, **kw)

    def forward(self, x):
        a, b = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * b)


def modules(device, dtype):
    """name -> (module, the context a step runs its forward in)."""
    import contextlib

    import generated

    torch.manual_seed(0)
    eager = EagerMlp(device, dtype)
    with torch.no_grad():
        for p in eager.parameters():
            p.normal_(0.0, 0.02) if p.dim() == 2 else p.normal_(1.0, 0.1)
    fused = generated.LlamaMlp(device=device, dtype=dtype)
    fused.load_state_dict({KEYS[k]: v for k, v in eager.state_dict().items()})
    none = contextlib.nullcontext
    out = {"eager bf16": (eager, none), "torch.compile bf16": (torch.compile(eager), none)}
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        for recipe in ("tensorwise", "rowwise"):
            model = convert_to_float8_training(copy.deepcopy(eager),
                                               config=Float8LinearConfig.from_recipe_name(recipe))
            out[f"torchao {recipe} + compile"] = (torch.compile(model), none)
    except ImportError as error:
        print(f"torchao not installed ({error}): its columns are left out", flush=True)
    out["fusegen bf16"] = (fused, none)
    recipes = {"current": generated.Float8CurrentScaling(), "delayed": generated.DelayedScaling(),
               "rowwise": generated.Float8RowwiseScaling()}
    for kind in fused.fp8_recipes:
        # each recipe its own module (delayed scaling's state is the module's), the same weights
        module = copy.deepcopy(fused)
        out[f"fusegen FP8 {kind}"] = (module, lambda recipe=recipes[kind]: generated.autocast(recipe=recipe))
    return out


def check(models, device, dtype):
    """Each module's output and x's grad against the bf16 block's: within 4 bf16 roundings of the
    largest value, and for FP8 (3 mantissa bits) 10% of the largest branch value more."""
    x = torch.randn(512, HIDDEN, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    results = {}
    for name, (module, context) in models.items():
        xi = x.clone().requires_grad_()
        with context():
            y = module(xi)
        y.backward(dy)
        results[name] = (y.detach().float(), xi.grad.float())
    want = results["fusegen bf16"]
    branches = (want[0] - x.float(), want[1] - dy.float())  # the MLP's own part (the residual's aside)
    for name, got in results.items():
        fp8 = "FP8" in name or "torchao" in name
        for what, g, w, branch in zip(("y", "dx"), got, want, branches):
            err = (g - w).abs().max().item()
            bound = 4 * 2.0**-8 * w.abs().max().item() + (0.1 * branch.abs().max().item() if fp8 else 0.0)
            print(f"check {name} {what}: max |err| {err:.3e}, bound {bound:.3e}", flush=True)
            if not err <= bound:
                raise AssertionError(f"{name} {what} differs from fusegen bf16's: {err:.3e} > {bound:.3e}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch._dynamo.config.recompile_limit = 64  # the compiled peers see each token count once (and the check's)
    models = modules(device, dtype)
    check(models, device, dtype)
    lines = [f"# FP8 MLP block on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
             "Llama-3-8B MLP block (RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU, Linear 14336 -> 4096, residual), "
             f"bf16; ms per step, median of {args.rounds} turns of {args.steps} steps back to back (CUDA events), "
             "the modules taking turns; in brackets: the speed-up over torch.compile bf16.", ""]
    names = list(models)
    lines += ["| tokens | pass | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)
        for label, grad in (("forward + backward", True), ("no-grad forward", False)):
            def step_of(module, context):
                def step():
                    with torch.set_grad_enabled(grad), context():
                        y = module(x)
                    if grad:
                        y.backward(dy)
                return step
            steps = {name: step_of(*models[name]) for name in names}
            for step in steps.values():
                timed(step, 3)  # warm: compiles, graphs, FP8 weights
            times = {name: [] for name in names}
            for _ in range(args.rounds):
                for name in names:
                    times[name].append(timed(steps[name], args.steps))
            medians = {name: statistics.median(values) for name, values in times.items()}
            base = medians["torch.compile bf16"]
            cells = [f"{medians[name]:.3f} ({base / medians[name]:.2f}x)" for name in names]
            lines.append(f"| {tokens:,} | {label} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
