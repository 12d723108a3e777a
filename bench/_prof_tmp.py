import sys, torch
sys.argv = [sys.argv[0]]
sys.path.insert(0, "bench")
import bench_compiled_layers as b
from torch.profiler import ProfilerActivity, profile as tp
torch._dynamo.config.recompile_limit = 64
device, dtype = "cuda", torch.bfloat16
eager, fused, call = b.mlp_models(b.EagerTeMlp, b.generated.TeMlp, device, dtype)
models = {"compile": torch.compile(eager, fullgraph=True, dynamic=False), "fusegen": fused,
          "fusegen+compile": torch.compile(fused, fullgraph=True, dynamic=False)}
x = torch.randn(16, 4096, device=device, dtype=dtype, requires_grad=True)
dy = torch.randn_like(x)
import generated.te_mlp as tm
for name, m in models.items():
    step = lambda: call(m, x).backward(dy)
    for _ in range(5): step()
    torch.cuda.synchronize()
    print("=====", name, "passes captured", tm.COMPILED_PASSES.captured, "failed", tm.COMPILED_PASSES.failed)
    with tp(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3): step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
