"""Issue 40's FP8 benchmark: the Llama-3-8B MLP block (RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU,
Linear 14336 -> 4096, the residual around them) and the whole Llama-3-8B decoder layer (issue 38's,
bench/bench_layer.py: attention over packed sequences, then that MLP block; no biases; bf16
parameters and activations) as

- eager PyTorch bf16 and torch.compile of it;
- torchao's float8 training (``convert_to_float8_training``, recipes "tensorwise" and "rowwise")
  under torch.compile, where torchao is installed;
- the generated module (``generated.LlamaMlp``, specs/fp8_mlp.py; ``generated.LlamaLayer``,
  specs/llama_layer.py) in bf16, and inside ``generated.autocast`` with each recipe it is built for
  (current, delayed, rowwise, block: TE's Float8BlockScaling),

side by side in one run, each holding the eager module's weights. A training step (forward +
backward, the backward outside the autocast as TE's users write it) and a no-grad forward, steps
run back to back under CUDA events (``steps`` of them, the median of ``rounds`` turns, the modules
taking turns, each turn starting from the next module). The MLP block at 16,384, 8,192, 2,048,
1,024 and 128 tokens (below the block's fp8_min_rows, 2,048, the FP8 modules run in bf16), the
layer at 16,384 and 8,192 tokens in documents of uneven lengths. No optimizer runs, so the generated FP8 modules' cached FP8 weights
(TE's weight cache across micro-batches) serve every step; "weights changed" steps first mark
every parameter changed (its version counter, no GPU work), so each step casts its weights again
as a step after an optimizer's does (torchao casts them every step anyway). First each FP8
module's output and x's grad are checked against the bf16 one's (FP8 rounds operands to 3 or 2
mantissa bits: the error's norm no more than torchao's with the same scaling, a check of wiring,
not of numerics, which tests/runtime/test_fp8.py holds).

    python3 bench/bench_fp8.py [--out bench/results/fp8_h100.md]
"""

import argparse
import contextlib
import copy
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_layer import (EagerLlamaLayer, fused_call, generated_layer, packed,  # noqa: E402
                         te_rotary_table, timed)

HIDDEN, FFN = 4096, 14336
MLP_TOKENS = (16384, 8192, 2048, 1024, 128)
# the layer's packed documents: bench_layer's 16,384 tokens, and 8,192 in 4 documents
LAYER_DOCUMENTS = ((498, 3778, 1900, 2650, 3120, 1638, 2800), (498, 3778, 1900, 2016))
CHANGED_FROM = 8192  # "weights changed" steps at this many tokens and more
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


def peers(eager, fused):
    """name -> (module, the context a step runs its forward in): the eager module, torch.compile
    of it, torchao's float8 training of it under torch.compile, the generated one in bf16 and, each
    a copy holding its own FP8 state, under generated.autocast with each recipe it is built for."""
    import generated

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
               "rowwise": generated.Float8RowwiseScaling(), "block": generated.Float8BlockScaling()}
    for kind in fused.fp8_recipes:
        out[f"fusegen FP8 {kind}"] = (copy.deepcopy(fused),
                                      lambda recipe=recipes[kind]: generated.autocast(recipe=recipe))
    return out


def mlp_models(device, dtype):
    import generated

    torch.manual_seed(0)
    eager = EagerMlp(device, dtype)
    with torch.no_grad():
        for p in eager.parameters():
            p.normal_(0.0, 0.02) if p.dim() == 2 else p.normal_(1.0, 0.1)
    fused = generated.LlamaMlp(device=device, dtype=dtype)
    fused.load_state_dict({KEYS[k]: v for k, v in eager.state_dict().items()})
    return peers(eager, fused)


def layer_models(device, dtype):
    torch.manual_seed(0)
    eager = EagerLlamaLayer(device, dtype)
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() > 1:  # the Linears' weights; the norms' stay ones (bench_layer's)
                p.normal_(std=1 / math.sqrt(p.shape[-1]))
    return peers(eager, generated_layer("LlamaLayer", eager, device, dtype))


def mlp_call(tokens, device, dtype):
    """(x, a call of a module on it) for the MLP block at ``tokens`` tokens."""
    x = torch.randn(tokens, HIDDEN, device=device, dtype=dtype, requires_grad=True)
    return x, lambda module, x: module(x)


def layer_call(lengths, device, dtype):
    """(x, a call of a module on it) for the layer over documents of ``lengths`` tokens: the eager
    peers take offsets and positions, the generated layer its call form (bench_layer.fused_call)."""
    cu, max_len, positions = packed(lengths, device)
    seq_lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    table = te_rotary_table(max_len, device)
    x = torch.randn(sum(lengths), HIDDEN, device=device, dtype=dtype, requires_grad=True)

    def call(module, x):
        if type(module).__name__ == "LlamaLayer":
            return fused_call(module, x, cu, max_len, seq_lens, table)
        return module(x, cu, max_len, positions)
    return x, call


# the torchao peer that scales as each fusegen recipe (delayed scaling, past its first step, casts
# with the scales current scaling computes; torchao has no 1x128 / 128x128 block scaling in its
# float8 training, and its per-row scales, over 4,096 or 14,336 values, are the coarser: block
# scaling errs less)
TORCHAO_PEER = {"current": "torchao tensorwise + compile", "delayed": "torchao tensorwise + compile",
                "rowwise": "torchao rowwise + compile", "block": "torchao rowwise + compile"}


def check(models, x, call):
    """Each module's output and x's grad against the bf16 generated module's. High precision:
    within 4 bf16 roundings of the largest value. FP8 (2 or 3 mantissa bits, a wiring check: the
    numerics are tests/runtime/test_fp8.py's): the error's norm relative to the block's own part
    (the residual's aside) at most E5M2's unit roundoff (2^-3), and at most 1.1 times that of
    torchao's float8 training with the same scaling, where torchao is installed (a correct
    quantized block errs as much as torchao's: a stale scale or a wrong format errs more). The
    second of two steps: delayed scaling's first casts with its initial scales (1, as TE's)."""
    x = x.detach()
    dy = torch.randn_like(x)
    results = {}
    for name, (module, context) in models.items():
        for _ in range(2):
            xi = x.clone().requires_grad_()
            with context():
                y = call(module, xi)
            y.backward(dy)
        results[name] = (y.detach().float(), xi.grad.float())
    want = results["fusegen bf16"]
    branches = (want[0] - x.float(), want[1] - dy.float())
    relative = {name: [((g - w).norm() / branch.norm()).item() for g, w, branch in zip(got, want, branches)]
                for name, got in results.items()}
    for name, got in results.items():
        peer = TORCHAO_PEER.get(name.removeprefix("fusegen FP8 "))
        for i, (what, g, w) in enumerate(zip(("y", "dx"), got, want)):
            if "FP8" in name or "torchao" in name:
                err, bound = relative[name][i], 2.0**-3
                if err == 0.0:  # what differs from bf16 in nothing ran in high precision
                    raise AssertionError(f"{name} {what} equals fusegen bf16's: it ran no FP8 GEMM")
                if peer in relative:
                    bound = min(bound, 1.1 * relative[peer][i])
                print(f"check {name} {what}: |err| / |branch| {err:.4f}, bound {bound:.4f}", flush=True)
            else:
                err, bound = (g - w).abs().max().item(), 4 * 2.0**-8 * w.abs().max().item()
                print(f"check {name} {what}: max |err| {err:.3e}, bound {bound:.3e}", flush=True)
            if not err <= bound:
                raise AssertionError(f"{name} {what} differs from fusegen bf16's: {err:.4e} > {bound:.4e}")


def measure(models, x, call, tokens, label_of, args):
    """The table's lines for one size: each pass's median ms per step and the speed-up over
    torch.compile bf16."""
    dy = torch.randn_like(x)
    names = list(models)
    passes = [("forward + backward", True, False), ("no-grad forward", False, False)]
    if tokens >= CHANGED_FROM:
        passes.insert(1, ("forward + backward, weights changed", True, True))
    lines = []
    for label, grad, changed in passes:
        def step_of(module, context):
            parameters = list(module.parameters())

            def step():
                if changed:  # as after an optimizer step: no cached FP8 weight serves
                    for p in parameters:
                        torch.autograd.graph.increment_version(p)
                with torch.set_grad_enabled(grad), context():
                    y = call(module, x)
                if grad:
                    y.backward(dy)
            return step
        steps = {name: step_of(*models[name]) for name in names}
        for step in steps.values():
            timed(step, 3)  # warm: compiles, graphs, FP8 weights
        times = {name: [] for name in names}
        for turn in range(args.rounds):  # each turn from another module on: none always follows the same one
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                times[name].append(timed(steps[name], args.steps))
        medians = {name: statistics.median(values) for name, values in times.items()}
        base = medians["torch.compile bf16"]
        cells = [f"{medians[name]:.3f} ({base / medians[name]:.2f}x)" for name in names]
        lines.append(f"| {label_of} | {label} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    return lines


def table(title, models, sizes, args):
    """A block's section: its title, then a line per size and pass."""
    names = list(models)
    lines = ["", f"## {title}", "", "| tokens | pass | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for x, call, label in sizes:
        lines += measure(models, x, call, x.shape[0], label, args)
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", default="mlp,layer", help="which of mlp, layer to measure")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch._dynamo.config.recompile_limit = 64  # the compiled peers see each token count once (and the check's)
    lines = [f"# FP8 on {torch.cuda.get_device_name()} (torch {torch.__version__})", "",
             f"bf16 parameters and activations; ms per step, median of {args.rounds} turns of {args.steps} steps back "
             "to back (CUDA events), the modules taking turns; in brackets: the speed-up over torch.compile bf16. "
             "No optimizer runs: the FP8 modules' cached FP8 weights serve every step but the \"weights changed\" "
             "ones', which mark every parameter changed first, as after an optimizer step."]
    blocks = args.blocks.split(",")
    if "mlp" in blocks:
        models = mlp_models(device, dtype)
        check(models, *mlp_call(2048, device, dtype))  # fp8_min_rows: the FP8 modules run in FP8
        sizes = [(*mlp_call(tokens, device, dtype), f"{tokens:,}") for tokens in MLP_TOKENS]
        lines += table("Llama-3-8B MLP block (RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU, Linear 14336 -> 4096, "
                       "residual)", models, sizes, args)
        del models, sizes
    if "layer" in blocks:
        models = layer_models(device, dtype)
        check(models, *layer_call((5, 1, 17, 40, 2001), device, dtype))  # 2,064: torchao needs multiples of 16
        sizes = [(*layer_call(lengths, device, dtype), f"{sum(lengths):,} in {len(lengths)}")
                 for lengths in LAYER_DOCUMENTS]
        lines += table("Llama-3-8B decoder layer (bench_layer.py's: GQA attention over packed documents, then the "
                       "MLP block)", models, sizes, args)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
