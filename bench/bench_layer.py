"""Issue 38's layer benchmark: a Llama-3-8B decoder layer (RMSNorm, fused QKV Linear 4096 -> 6144,
GQA self-attention of 32 query and 8 key/value heads of 128 with rotary base 500000 over packed
sequences, output Linear, residual; RMSNorm, Linear 4096 -> 2 x 14336, SwiGLU, Linear 14336 -> 4096,
residual; no biases; bf16) as eager PyTorch (attention through torch.nn.attention.varlen.varlen_attn,
FlashAttention-2 varlen) and as torch.compile of that module, and the generated layer
(``generated.LlamaLayer``, specs/llama_layer.py) with the eager module's weights, called as the note
calls it: ``module(x, seq_lens=..., max_seqlen=...)`` (lengths on the GPU and the bound given: no
sync), and the same layer as a Transformer Engine user writes it (``generated.LlamaLayerTe``:
te.TransformerLayer, its q/k/v weights under TE's names, called with TE's forward keywords:
``cu_seqlens_q/kv``, ``max_seqlen_q/kv`` and ``rotary_pos_emb``, TE's RotaryPositionEmbedding
table) and with TE's one fused QKV weight (``generated.LlamaLayerTeFused``: fuse_qkv_params=True,
the hand-written layer's parameters under TE's names), side by side in one run; first each
generated layer's output is checked against the eager one.

- a training step (forward + backward) and a no-grad forward, steps run back to back under CUDA
  events (``steps`` of them, the median of ``rounds`` turns, the modules taking turns);
- 16,384 tokens in 7 documents of uneven lengths (498 to 3,778), and 8 sequences of 1 token
  (decode-like, where the host's time is the step's);
- a per-kernel profile of one training step of each (torch.profiler): GEMMs, attention, the rest;
- ``--ab TURNS``: then the generated layers alone at 8 tokens, taking turns for TURNS turns of 100
  steps each (host-bound steps vary from turn to turn with the machine: many short turns side by
  side rank them better than a few long ones), their quartiles.

    python3 bench/bench_layer.py [--ab 40] [--out bench/results/layer_te_h100.md]
"""

import argparse
import inspect
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HIDDEN, HEADS, KV_HEADS, FFN, ROTARY_BASE = 4096, 32, 8, 14336, 500000.0
HEAD_DIM = HIDDEN // HEADS
DOCUMENTS = (498, 3778, 1900, 2650, 3120, 1638, 2800)  # 16,384 tokens
DECODE = (1,) * 8


def varlen_attention(q, k, v, cu, max_len):
    """FlashAttention-2 varlen, causal, through torch.nn.attention.varlen. Its signature moved
    between releases: causal is ``is_causal=True`` in some, ``window_size=(-1, 0)`` (no limit to
    the left, none to the right) in others, torch 2.11's among them."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    if "is_causal" in parameters:
        causal = {"is_causal": True}
    elif "window_size" in parameters:
        causal = {"window_size": (-1, 0)}
    else:
        raise RuntimeError(f"torch {torch.__version__}: varlen_attn takes no causal mask here")
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal)


def rotary(t, cos, sin):
    """Rotate-half rotary embedding (Llama, GPT-NeoX) of [tokens, heads, head_dim]."""
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


class EagerLlamaLayer(torch.nn.Module):
    """The layer in plain PyTorch, as a user writes it without fusegen."""

    def __init__(self, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1 = torch.nn.RMSNorm(HIDDEN, eps=1e-5, **kw)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False, **kw)
        self.proj = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False, **kw)
        self.norm2 = torch.nn.RMSNorm(HIDDEN, eps=1e-5, **kw)
        self.fc1 = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False, **kw)
        self.fc2 = torch.nn.Linear(FFN, HIDDEN, bias=False, **kw)

    def forward(self, x, cu, max_len, positions):
        tokens = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        inv_freq = ROTARY_BASE ** (-torch.arange(0, HEAD_DIM, 2, device=x.device, dtype=torch.float32) / HEAD_DIM)
        angles = positions[:, None].float() * inv_freq[None, :]
        cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :].to(x.dtype)
        sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :].to(x.dtype)
        q = rotary(q.reshape(tokens, HEADS, HEAD_DIM), cos, sin)
        k = rotary(k.reshape(tokens, KV_HEADS, HEAD_DIM), cos, sin)
        o = varlen_attention(q, k, v.reshape(tokens, KV_HEADS, HEAD_DIM), cu, max_len)
        x = x + self.proj(o.reshape(tokens, HEADS * HEAD_DIM))
        a, b = self.fc1(self.norm2(x)).chunk(2, dim=-1)
        return x + self.fc2(F.silu(a) * b)


def packed(lengths, device):
    """x's sequence offsets (int32 [batch + 1]), the longest length and each token's position."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])
    return cu, max(lengths), positions


def check_attention(device, dtype):
    """The peer's attention is causal within each sequence: against scaled_dot_product_attention
    per sequence (GQA's k/v heads repeated), on a small packed batch."""
    lengths = (5, 1, 17)
    cu, max_len, _ = packed(lengths, device)
    q = torch.randn(sum(lengths), HEADS, HEAD_DIM, device=device, dtype=dtype)
    k, v = (torch.randn(sum(lengths), KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
    got = varlen_attention(q, k, v, cu, max_len)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = (t.repeat_interleave(HEADS // KV_HEADS, 0) for t in (ks, vs))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        torch.testing.assert_close(got[start:end].float(), want, atol=2e-2, rtol=2e-2)


# the eager peer's parameters → the generated module's state_dict keys, which follow the spec's
# nesting "<Sequential index>.<Residual index>.<name>"
GENERATED_KEYS = {"norm1.weight": "0.0.weight", "qkv.weight": "0.1.weight", "proj.weight": "0.3.weight",
                  "norm2.weight": "1.0.weight", "fc1.weight": "1.1.weight", "fc2.weight": "1.3.weight"}


# the eager peer's parameters → te.TransformerLayer's state_dict keys (the QKV weight split in TE's
# query, key and value blocks: fuse_qkv_params=False)
TE_KEYS = {"norm1.weight": "0.self_attention.layernorm_qkv.layer_norm_weight",
           "proj.weight": "0.self_attention.proj.weight", "norm2.weight": "0.layernorm_mlp.layer_norm_weight",
           "fc1.weight": "0.layernorm_mlp.fc1_weight", "fc2.weight": "0.layernorm_mlp.fc2_weight"}


def generated_layer(name, eager, device, dtype):
    """generated.<name> holding the eager peer's weights, or None where the package lacks it."""
    try:
        import generated
    except ImportError:
        return None
    if not hasattr(generated, name):
        return None
    module = getattr(generated, name)(device=device, dtype=dtype)
    weights = eager.state_dict()
    if name == "LlamaLayer":
        module.load_state_dict({GENERATED_KEYS[k]: v for k, v in weights.items()})
        return module
    state = {TE_KEYS[k]: v for k, v in weights.items() if k in TE_KEYS}
    if name == "LlamaLayerTeFused":  # TE's one QKV weight, [q | k | v] rows as the eager peer's
        state["0.self_attention.layernorm_qkv.weight"] = weights["qkv.weight"]
    else:
        q, k, v = weights["qkv.weight"].split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM])
        state.update({"0.self_attention.layernorm_qkv.query_weight": q,
                      "0.self_attention.layernorm_qkv.key_weight": k,
                      "0.self_attention.layernorm_qkv.value_weight": v})
    extra = {key: value for key, value in module.state_dict().items() if key.endswith("_extra_state")}
    module.load_state_dict({**state, **extra})
    return module


def te_rotary_table(max_len, device):
    """TE's RotaryPositionEmbedding(HEAD_DIM, rotary_base=ROTARY_BASE)(max_len) (attention/rope.py):
    float32 angles [max_len, 1, 1, HEAD_DIM], cat(freqs, freqs)."""
    inv_freq = 1.0 / (ROTARY_BASE ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=device) / HEAD_DIM))
    freqs = torch.einsum("i , j -> i j", torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).reshape(max_len, 1, 1, HEAD_DIM)


def fused_call(module, x, cu, max_len, seq_lens, table):
    """The generated layer's call: the note's form for LlamaLayer, TE's forward keywords for
    te.TransformerLayer's (the offsets and bound as TE takes them, the rotary table)."""
    if type(module).__name__ == "LlamaLayer":
        return module(x, seq_lens=seq_lens, max_seqlen=max_len)
    return module(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len,
                  rotary_pos_emb=table)


def check_generated(module, eager, device, dtype):
    """The generated layer computes the eager one's function: output and x's grad on a small packed
    batch, within a few bf16 roundings of the largest value (the two round differently)."""
    lengths = (5, 1, 17, 40)
    cu, max_len, positions = packed(lengths, device)
    seq_lens = torch.tensor(lengths, device=device, dtype=torch.int32)
    table = te_rotary_table(max_len, device)
    x = torch.randn(sum(lengths), HIDDEN, device=device, dtype=dtype)
    dy = torch.randn_like(x)
    results = []
    calls = (lambda x: eager(x, cu, max_len, positions), lambda x: fused_call(module, x, cu, max_len, seq_lens, table))
    for call in calls:
        xi = x.clone().requires_grad_()
        y = call(xi)
        y.backward(dy)
        results.append((y.detach().float(), xi.grad.float()))
    for what, want, got in zip(("y", "dx"), results[0], results[1]):
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        if not err <= 4 * 2.0**-8 * scale:
            raise AssertionError(f"generated {type(module).__name__} {what} differs from the eager layer's: max |err| "
                                 f"{err:.3e}, max |eager| {scale:.3e}")


def timed(step, steps: int) -> float:
    """ms per step, ``steps`` of them back to back under CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def profile(step) -> dict[str, float]:
    """ms of one step's kernels by kind: GEMMs, attention, everything else."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kinds = {"GEMMs": 0.0, "attention": 0.0, "the rest": 0.0}
    for event in prof.key_averages():
        name = event.key.lower()
        ms = getattr(event, "device_time_total", None)
        ms = (event.cuda_time_total if ms is None else ms) / 1000
        if "flash" in name or "fmha" in name:  # first: FA2's kernels name cutlass types too
            kinds["attention"] += ms
        elif any(word in name for word in ("gemm", "nvjet", "xmma", "cutlass", "sm90_")):
            kinds["GEMMs"] += ms
        else:
            kinds["the rest"] += ms
    return kinds


def ab_turns(fused_modules: dict, turns: int, device, dtype) -> list[str]:
    """The generated layers at 8 tokens taking turns (A/B/C/A/B/C...): ``turns`` turns of 100 steps
    each, a training step and a no-grad forward; the lines of a table of their quartiles (ms per
    step)."""
    cu, max_len, _ = packed(DECODE, device)
    seq_lens = torch.tensor(DECODE, device=device, dtype=torch.int32)
    table = te_rotary_table(max_len, device)
    x = torch.randn(sum(DECODE), HIDDEN, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(sum(DECODE), HIDDEN, device=device, dtype=dtype)
    lines = ["", f"The generated layers alone at 8 tokens, taking turns: {turns} turns of 100 steps each "
                 "(ms per step; quartiles over the turns):", "",
             "| pass | layer | 25% | median | 75% | fastest turn |", "|---|---|---|---|---|---|"]
    for label, grad in (("forward + backward", True), ("no-grad forward", False)):
        def step(module):
            def run():
                with torch.set_grad_enabled(grad):
                    y = fused_call(module, x, cu, max_len, seq_lens, table)
                if grad:
                    y.backward(dy)
            return run
        times = {name: [] for name in fused_modules}
        for module in fused_modules.values():
            timed(step(module), 20)
        for _ in range(turns):
            for name, module in fused_modules.items():
                times[name].append(timed(step(module), 100))
        for name, values in times.items():
            q1, q2, q3 = statistics.quantiles(values, n=4)
            lines.append(f"| {label} | {name} | {q1:.3f} | {q2:.3f} | {q3:.3f} | {min(values):.3f} |")
            print(lines[-1], flush=True)
    return lines


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ab", type=int, default=0, help="turns of the generated layers' A/B at 8 tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    check_attention(device, dtype)
    eager = EagerLlamaLayer(device, dtype)
    with torch.no_grad():
        for p in eager.parameters():
            if p.dim() > 1:  # the Linears' weights; the norms' stay ones
                p.normal_(std=1 / math.sqrt(p.shape[-1]))
    modules = {"eager": eager, "torch.compile": torch.compile(eager)}
    fused_modules = {"fusegen": generated_layer("LlamaLayer", eager, device, dtype),
                     "fusegen te.TransformerLayer": generated_layer("LlamaLayerTe", eager, device, dtype),
                     "fusegen te.TransformerLayer, one QKV weight": generated_layer("LlamaLayerTeFused", eager,
                                                                                    device, dtype)}
    for name, fused in fused_modules.items():
        if fused is not None:
            check_generated(fused, eager, device, dtype)
            modules[name] = fused
    lines = [f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__} · bf16 · ms per step, steps back to "
             f"back under CUDA events, median of {args.rounds} turns", "",
             "| tokens | pass | " + " | ".join(modules) + " |", "|---|---|" + "---|" * len(modules)]
    profiles = []
    for lengths, steps in ((DOCUMENTS, 10), (DECODE, 50)):
        cu, max_len, positions = packed(lengths, device)
        seq_lens = torch.tensor(lengths, device=device, dtype=torch.int32)
        table = te_rotary_table(max_len, device)  # a TE user builds it once for the longest length
        tokens = sum(lengths)
        x = torch.randn(tokens, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, HIDDEN, device=device, dtype=dtype)

        def call(module):
            """The module's call: the eager peers take offsets and positions, the generated layers
            theirs (fused_call)."""
            if module in fused_modules.values():
                return lambda: fused_call(module, x, cu, max_len, seq_lens, table)
            return lambda: module(x, cu, max_len, positions)

        def train(module):
            forward = call(module)
            return lambda: forward().backward(dy)

        def no_grad(module):
            forward = call(module)

            def step():
                with torch.no_grad():
                    forward()
            return step

        for label, make in (("forward + backward", train), ("no-grad forward", no_grad)):
            times = {name: [] for name in modules}
            for name, module in modules.items():  # warm: compiled, kernels loaded
                timed(make(module), 3)
            for _ in range(args.rounds):
                for name, module in modules.items():
                    times[name].append(timed(make(module), steps))
            cells = " | ".join(f"{statistics.median(times[name]):.3f}" for name in modules)
            lines.append(f"| {tokens:,} in {len(lengths)} | {label} | {cells} |")
            print(lines[-1], flush=True)
        if tokens > 1000:
            for name, module in modules.items():
                kinds = profile(train(module))
                profiles.append(f"| {name} | " + " | ".join(f"{ms:.2f}" for ms in kinds.values()) + " |")
    lines += ["", f"Kernels of one training step at {sum(DOCUMENTS):,} tokens (ms, torch.profiler):", "",
              "| module | GEMMs | attention | the rest |", "|---|---|---|---|", *profiles]
    if args.ab:
        lines += ab_turns({name: m for name, m in fused_modules.items() if m is not None}, args.ab, device, dtype)
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
