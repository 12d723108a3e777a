import sys, math, torch
sys.argv = [sys.argv[0]]
sys.path.insert(0, "bench")
from bench_layer import *
from torch.profiler import ProfilerActivity, profile as tp
torch.manual_seed(0)
device, dtype = "cuda", torch.bfloat16
eager = EagerLlamaLayer(device, dtype)
with torch.no_grad():
    for p in eager.parameters():
        if p.dim() > 1: p.normal_(std=1 / math.sqrt(p.shape[-1]))
fused = generated_layer(eager, device, dtype)
cu, max_len, positions = packed(DOCUMENTS, device)
seq_lens = torch.tensor(DOCUMENTS, device=device, dtype=torch.int32)
x = torch.randn(sum(DOCUMENTS), HIDDEN, device=device, dtype=dtype, requires_grad=True)
dy = torch.randn_like(x)
step = lambda: fused(x, seq_lens=seq_lens, max_seqlen=max_len).backward(dy)
for _ in range(3): step()
torch.cuda.synchronize()
with tp(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(4): step()
    torch.cuda.synchronize()
for e in prof.key_averages():
    k = e.key
    if any(w in k for w in ("ynchron", "local_scalar", "item", "Memcpy", "cudaMalloc", "cudaFree", "tolist", "nonzero", "EventSynchron", "cudaMemcpy")):
        print(k[:80], e.count, f"{e.cpu_time_total/1000:.2f}ms cpu")
# device busy vs wall over the 4 steps
evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
start = min(e.time_range.start for e in evs); end = max(e.time_range.end for e in evs)
busy = sum(e.time_range.end - e.time_range.start for e in evs)
print(f"device span {(end-start)/4000:.2f} ms/step, busy {busy/4000:.2f} ms/step")
ivs = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs)
gaps = []
for (s0, e0, n0), (s1, e1, n1) in zip(ivs, ivs[1:]):
    if s1 - e0 > 100: gaps.append((s1 - e0, n0[:50], n1[:50]))
gaps.sort(reverse=True)
for g in gaps[:12]: print(f"gap {g[0]/1000:.2f} ms after {g[1]} before {g[2]}")
