import sys, time, importlib, gc
from pathlib import Path
import torch
ROOT = Path.cwd()
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "tests"))
import generated
from generated import te_mlp as T
bf = torch.bfloat16
gen = generated.TeMlp(device="cuda", dtype=bf)
x = torch.randn(16, 4096, device="cuda", dtype=bf, requires_grad=True)
p = [gen._modules[k].weight for k in "013"]; q = [gen._modules[k].bias for k in "013"]
args = (x, p[0], q[0], p[1], q[1], p[2], q[2])
def host_us(fn, calls=100, dev_us=2000, repeats=7):
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
    m, lo = host_us(fn, **k); print(f"{n:55s} {m:8.1f} {lo:8.1f}", flush=True)
def fwd_only(): gen(x)
row("module(x) with grad", fwd_only)
row("Function.apply(*args)", lambda: T.TeMlpFunction.apply(*args))
row("torch._C._FunctionBase.apply", lambda: torch._C._FunctionBase.apply.__func__(T.TeMlpFunction, *args) if hasattr(torch._C._FunctionBase.apply, '__func__') else None)
with torch.no_grad():
    row("no_grad_forward under no_grad", lambda: T.no_grad_forward(*args))
class Ctx:
    def save_for_backward(self, *a): self.s = a
row("Function.forward(fake ctx) grad mode off", lambda: (torch.set_grad_enabled(False), T.TeMlpFunction.forward(Ctx(), *args), torch.set_grad_enabled(True)))
out = [None]
def keep(): out[0] = gen(x)
row("module(x) keeping the output (graph freed next call)", keep)
def step(): gen(x).sum().backward()
row("fwd+bwd", step, calls=10, dev_us=5000)
gc.disable()
row("fwd+bwd gc off", step, calls=10, dev_us=5000)
gc.enable()
for prm in gen.parameters(): prm.grad = None
def step2():
    gen(x).sum().backward()
    for prm in gen.parameters(): prm.grad = None
    x.grad = None
row("fwd+bwd grads None", step2, calls=10, dev_us=5000)
y = gen(x); l = y.sum()
def bwd_only():
    l.backward(retain_graph=True)
row("backward only retain_graph", bwd_only, calls=10, dev_us=5000)
def sum_only(): y.sum()
row("y.sum()", sum_only)
