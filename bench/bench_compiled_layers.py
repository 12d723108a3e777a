"""Issue 38's compiled-model target: a model of TWO generated layers under
torch.compile(fullgraph=True) against torch.compile(fullgraph=True) of the same two layers written
in eager PyTorch, at 16 and at 16,384 tokens, a training step (forward + backward) and a no-grad
forward, side by side in one run (bf16). Also the eager model and the generated model uncompiled,
for scale.

Models: two TE docs MLPs (``generated.TeMlp``: LayerNorm, Linear 4096 -> 2 x 14336, SwiGLU,
Linear 14336 -> 4096), two GPT-OSS MLPs (``generated.GptOssMlp``: RMSNorm, Linear 1024 -> 2 x 2048,
clamped SwiGLU, Linear 2048 -> 1024), and two Llama-3-8B decoder layers (``generated.LlamaLayer``
against bench_layer.py's eager layer) where the package's LlamaLayer replays CUDA graphs (its
compiled training call is then whole-pass ops too; otherwise its row says why it is left out).

Each peer holds its own copy of the same weights. First the compiled generated model's output and
x's grad are checked against the compiled eager model's (a few bf16 roundings of the largest
value), then each pass is timed as ``steps`` steps back to back under CUDA events (grads
accumulate, as in gradient accumulation), the median of ``rounds`` turns, the peers taking turns.

    python3 bench/bench_compiled_layers.py [--rounds 5] [--out bench/results/compiled_layers_h100.md]
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import generated  # noqa: E402

TOKENS = (16, 16384)
STEPS = {16: 50, 16384: 5}


class EagerTeMlp(torch.nn.Module):
    """generated.TeMlp's math in plain PyTorch (what a user writes without fusegen)."""

    def __init__(self, device, dtype, hidden=4096, ffn=14336):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, eps=1e-5, device=device, dtype=dtype)
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x):
        a, b = self.fc1(self.norm(x)).chunk(2, dim=-1)  # TE gates the first half
        return self.fc2(F.silu(a) * b)

    # generated.TeMlp's state_dict keys for these parameters
    KEYS = {"norm.weight": "0.weight", "norm.bias": "0.bias", "fc1.weight": "1.weight", "fc1.bias": "1.bias",
            "fc2.weight": "3.weight", "fc2.bias": "3.bias"}


class EagerGptOssMlp(torch.nn.Module):
    """generated.GptOssMlp's math in plain PyTorch: RMSNorm, Linear, TE's ClampedSwiGLU (limit 6,
    alpha 1.5, linear offset 0.5, as specs/activation_mlps.py), Linear."""

    def __init__(self, device, dtype, hidden=1024, ffn=2048):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-5, device=device, dtype=dtype)
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x):
        a, b = self.fc1(self.norm(x)).chunk(2, dim=-1)
        gate = a.clamp(max=6.0)
        return self.fc2(gate * torch.sigmoid(1.5 * gate) * (b.clamp(-6.0, 6.0) + 0.5))

    KEYS = {"norm.weight": "0.weight", "fc1.weight": "1.weight", "fc1.bias": "1.bias", "fc2.weight": "3.weight",
            "fc2.bias": "3.bias"}


def replays_graphs(cls) -> bool:
    """Whether a generated class's compiled training call is whole-pass ops (its file registers them)."""
    return hasattr(sys.modules[cls.__module__], "COMPILED_PASSES")


def randomized(module):
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:  # weights; norms keep ones, biases get small signed values
                p.normal_(std=1 / math.sqrt(p.shape[-1]))
            elif p.ndim == 1 and not torch.all(p == 1):
                p.normal_(std=0.02)
    return module


def mlp_models(eager_cls, generated_cls, device, dtype):
    """Two eager layers and two generated ones holding copies of the same weights."""
    eager = torch.nn.Sequential(*(randomized(eager_cls(device, dtype)) for _ in range(2)))
    fused = torch.nn.Sequential(*(generated_cls(device=device, dtype=dtype) for _ in range(2)))
    for e, f in zip(eager, fused):
        f.load_state_dict({eager_cls.KEYS[k]: v.detach().clone() for k, v in e.state_dict().items()})
    return eager, fused, lambda model, x: model(x)


class TwoLlamaLayers(torch.nn.Module):
    """Two Llama-3-8B layers on packed sequences: the eager layer takes offsets and positions, the
    generated one the note's form (lengths and their bound)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x, cu, max_len, positions, seq_lens):
        for layer in self.layers:
            if isinstance(layer, generated.LlamaLayer):
                x = layer(x, seq_lens=seq_lens, max_seqlen=max_len)
            else:
                x = layer(x, cu, max_len, positions)
        return x


def llama_models(device, dtype):
    """Two Llama-3-8B layers (bench_layer.py's eager layer, and generated.LlamaLayer) holding copies
    of the same weights, and their call on packed sequences (16,384 tokens: bench_layer's 7
    documents; fewer: two sequences)."""
    import bench_layer

    eager = [randomized(bench_layer.EagerLlamaLayer(device, dtype)) for _ in range(2)]
    fused = [generated.LlamaLayer(device=device, dtype=dtype) for _ in range(2)]
    for e, f in zip(eager, fused):
        f.load_state_dict({bench_layer.GENERATED_KEYS[k]: v.detach().clone() for k, v in e.state_dict().items()})
    packs = {}

    def call(model, x):
        tokens = x.shape[0]
        if tokens not in packs:
            lengths = (bench_layer.DOCUMENTS if tokens == sum(bench_layer.DOCUMENTS)
                       else (tokens // 2, tokens - tokens // 2))
            cu, max_len, positions = bench_layer.packed(lengths, device)
            packs[tokens] = (cu, max_len, positions, torch.tensor(lengths, device=device, dtype=torch.int32))
        return model(x, *packs[tokens])

    return TwoLlamaLayers(eager), TwoLlamaLayers(fused), call


def check(compiled_fused, compiled_eager, call, width, device, dtype):
    """The compiled generated model computes the compiled eager model's function: output and x's
    grad at 16 and 300 tokens (few rows: replayed graphs; more: the stages as they are), within a
    few bf16 roundings of the largest value (the two round differently)."""
    for tokens in (16, 16, 16, 300):  # the third 16-token call replays the captured graphs
        x = torch.randn(tokens, width, device=device, dtype=dtype)
        dy = torch.randn_like(x)
        results = []
        for model in (compiled_eager, compiled_fused):
            xi = x.clone().requires_grad_()
            y = call(model, xi)
            y.backward(dy)
            results.append((y.detach().float(), xi.grad.float()))
        for what, want, got in zip(("y", "dx"), results[0], results[1]):
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            if not err <= 4 * 2.0**-8 * scale:
                raise AssertionError(f"{tokens} tokens: the compiled generated model's {what} differs from the "
                                     f"compiled eager model's: max |err| {err:.3e}, max |eager| {scale:.3e}")


def timed(step, steps: int) -> float:
    """ms per step, ``steps`` of them back to back under CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="te_mlp,gpt_oss_mlp,llama_layer")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    # every compiled module's call goes through one code object of torch's (OptimizedModule's), so
    # its recompile limit (8) counts the two compiled peers' graphs together: 2 peers x 2 token
    # counts x grad on and off is 8 a model, plus the check's; each is a graph of its own, not a
    # recompile that should not happen
    torch._dynamo.config.recompile_limit = 64
    builders = {
        "te_mlp": ("2 × TeMlp (4096, SwiGLU 14336)", 4096,
                   lambda: mlp_models(EagerTeMlp, generated.TeMlp, device, dtype)),
        "gpt_oss_mlp": ("2 × GptOssMlp (1024, clamped SwiGLU 2048)", 1024,
                        lambda: mlp_models(EagerGptOssMlp, generated.GptOssMlp, device, dtype)),
        "llama_layer": ("2 × LlamaLayer (Llama-3-8B)", 4096, lambda: llama_models(device, dtype)),
    }
    peers = ["eager", "torch.compile", "fusegen", "fusegen + torch.compile"]
    lines = [f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · bf16 · ms per step, steps back to "
             f"back under CUDA events, median of {args.rounds} turns; torch.compile: default mode, static shapes, "
             "fullgraph=True (the eager Llama layer's: as torch allows)",
             "", "| model | tokens | pass | " + " | ".join(peers) + " | fusegen + compile / torch.compile |",
             "|---|---|---|" + "---|" * (len(peers) + 1)]
    notes = []
    for key in args.models.split(","):
        title, width, build = builders[key]
        if key == "llama_layer" and not replays_graphs(generated.LlamaLayer):
            notes.append(f"- {title}: left out: generated.LlamaLayer replays no CUDA graphs in this package, so "
                         "its compiled training call is not whole-pass ops yet")
            continue
        eager, fused, call = build()
        torch._dynamo.reset()
        # static shapes: each token count its own graph, for both compiled peers alike; the eager
        # Llama layer's varlen_attn is compiled as torch allows (bench_layer.py: not fullgraph)
        models = {"eager": eager, "torch.compile": torch.compile(eager, fullgraph=key != "llama_layer", dynamic=False),
                  "fusegen": fused, "fusegen + torch.compile": torch.compile(fused, fullgraph=True, dynamic=False)}
        check(models["fusegen + torch.compile"], models["torch.compile"], call, width, device, dtype)
        for tokens in TOKENS:
            x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(tokens, width, device=device, dtype=dtype)

            def train(model):
                return lambda: call(model, x).backward(dy)

            def no_grad(model):
                def step():
                    with torch.no_grad():
                        call(model, x)
                return step

            for label, make in (("forward + backward", train), ("no-grad forward", no_grad)):
                times = {name: [] for name in models}
                for name, model in models.items():  # warm: compiled, kernels loaded, graphs captured
                    timed(make(model), 3)
                for _ in range(args.rounds):
                    for name, model in models.items():
                        times[name].append(timed(make(model), STEPS[tokens]))
                ms = {name: statistics.median(values) for name, values in times.items()}
                cells = " | ".join(f"{ms[name]:.3f}" for name in peers)
                ratio = ms["fusegen + torch.compile"] / ms["torch.compile"]
                lines.append(f"| {title} | {tokens:,} | {label} | {cells} | {ratio:.2f}× |")
                print(lines[-1], flush=True)
        del models, eager, fused
        torch.cuda.empty_cache()
    table = "\n".join(lines + ([""] + notes if notes else []))
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
