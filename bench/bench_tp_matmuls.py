"""Issue 41's measurement of the column/row pairs' two schedules (``keep what wins``): on 2 and 4
GPUs, one process a GPU, the Llama MLP block's two GEMMs at 16,384 tokens (bf16, hidden 8192,
ffn 28672, sequence parallel) with their collectives as NCCL's all-gather then the GEMM, and the
GEMM then NCCL's reduce-scatter, against PyTorch's micro-pipelined
``torch.ops.symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter`` (symmetric
memory, NVLink multicast off), and each GEMM alone; ms a call, 20 back to back under CUDA events.
The fused ops won (bench/results/tp_h100.md), so fusegen's sequence-parallel Linears run them
(stages/collective.py's COLLECTIVE_GEMM).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python3 bench/bench_tp_matmuls.py
"""
import os, sys, torch, socket
import torch.distributed as dist

def timed(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize(); dist.barrier()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n

def main(rank, size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", rank))
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    name = dist.group.WORLD.group_name
    enable_symm_mem_for_group(name)
    T, H, F = 16384, 8192, 28672
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T // size, H, **kw)
    w1 = torch.randn(2 * F // size, H, **kw) * 0.01
    a = torch.randn(T, F // size, **kw)
    w2 = torch.randn(H, F // size, **kw) * 0.01
    def ag_mm():
        g = torch.empty(T, H, **kw); dist.all_gather_into_tensor(g, x); return g @ w1.t()
    def fused_ag_mm():
        return torch.ops.symm_mem.fused_all_gather_matmul(x, [w1.t()], 0, name)
    def mm_rs():
        p = a @ w2.t(); o = torch.empty(T // size, H, **kw); dist.reduce_scatter_tensor(o, p); return o
    def fused_mm_rs():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w2.t(), "sum", 0, name)
    def mm1():
        return torch.empty(T, H, **kw) @ w1.t()
    def mm2():
        return a @ w2.t()
    res = {}
    for n, f in (("mm fc1 alone", mm1), ("NCCL all-gather + mm", ag_mm), ("fused_all_gather_matmul", fused_ag_mm),
                 ("mm fc2 alone", mm2), ("mm + NCCL reduce-scatter", mm_rs), ("fused_matmul_reduce_scatter", fused_mm_rs)):
        try:
            res[n] = f"{timed(f):.3f}"
        except Exception as err:
            res[n] = f"failed: {type(err).__name__}: {str(err)[:120]}"
    if rank == 0:
        print(f"TP {size}:", res, flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    for size in (2, 4):
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        torch.multiprocessing.spawn(main, args=(size, port), nprocs=size)
