import sys, time
from pathlib import Path
import torch
import torch.nn.functional as F
sys.path.insert(0, str(Path.cwd()))
import generated
from generated import te_mlp as T
bf = torch.bfloat16
gen = generated.TeMlp(device="cuda", dtype=bf)
P = dict(gen.named_parameters())
def eager(x):
    h = F.layer_norm(x, (4096,), P["0.weight"], P["0.bias"], 1e-5)
    a, b = F.linear(h, P["1.weight"], P["1.bias"]).chunk(2, dim=-1)
    return F.linear(F.silu(a) * b, P["3.weight"], P["3.bias"])
x = torch.randn(16, 4096, device="cuda", dtype=bf, requires_grad=True)
dense = torch.randn(16, 4096, device="cuda", dtype=bf)
def host_us(fn, calls=10, dev_us=5000, repeats=9):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        torch.cuda._sleep(int(calls * dev_us * 2000))
        s = time.perf_counter()
        for _ in range(calls): fn()
        runs.append((time.perf_counter() - s) / calls * 1e6)
        torch.cuda.synchronize()
    runs.sort(); return runs[len(runs)//2], runs[0]
def row(n, fn, **k):
    m, lo = host_us(fn, **k); print(f"{n:60s} {m:8.1f} {lo:8.1f}", flush=True)
for rnd in range(2):
    row("eager fwd+bwd (sum)", lambda: eager(x).sum().backward())
    row("fusegen fwd+bwd (sum)", lambda: gen(x).sum().backward())
    row("eager fwd+bwd (dense grad)", lambda: eager(x).backward(dense))
    row("fusegen fwd+bwd (dense grad)", lambda: gen(x).backward(dense))
    ye = eager(x); yf = gen(x)
    row("eager backward only (dense, retain)", lambda: ye.backward(dense, retain_graph=True))
    row("fusegen backward only (dense, retain)", lambda: yf.backward(dense, retain_graph=True))
    row("eager fwd with grad", lambda: eager(x), calls=50, dev_us=1000)
    row("fusegen fwd with grad", lambda: gen(x), calls=50, dev_us=1000)
    args = (x.detach(), P["0.weight"], P["0.bias"], P["1.weight"], P["1.bias"], P["3.weight"], P["3.bias"])
    class Ctx:
        def save_for_backward(self, *t): self.saved_tensors = t
    ctx = Ctx()
    with torch.no_grad():
        T.TeMlpFunction.forward(ctx, *args)
        row("Function.backward on the main thread (dense)", lambda: T.TeMlpFunction.backward(ctx, dense), calls=20, dev_us=3000)
    class Null(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *a): return a[0].clone()
        @staticmethod
        def backward(ctx, g): return (g,) + (None,) * 6
    row("Null Function fwd+bwd (7 inputs, 1 grad)", lambda: Null.apply(*( (x,) + args[1:])).backward(dense), calls=20, dev_us=500)
    class Null7(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *a): return a[0].clone()
        @staticmethod
        def backward(ctx, g): return tuple(torch.zeros_like(t) for t in args)
    row("Null Function fwd+bwd (7 grads → AccumulateGrad)", lambda: Null7.apply(*((x,) + args[1:])).backward(dense), calls=20, dev_us=3000)
