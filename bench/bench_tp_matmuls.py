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

import os
import socket

import torch
import torch.distributed as dist

TOKENS, HIDDEN, FFN = 16384, 8192, 28672  # the Llama MLP block's, bf16


def timed(f, n=20):
    """ms a call of ``f``, ``n`` calls back to back under CUDA events, every rank in step."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main(rank, size, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", rank))
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    name = dist.group.WORLD.group_name
    enable_symm_mem_for_group(name)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS // size, HIDDEN, **kw)  # a rank's share of the tokens, before fc1's all-gather
    w1 = torch.randn(2 * FFN // size, HIDDEN, **kw) * 0.01  # fc1, column-parallel (gates and linears)
    a = torch.randn(TOKENS, FFN // size, **kw)  # fc2's input: every token, a rank's share of the features
    w2 = torch.randn(HIDDEN, FFN // size, **kw) * 0.01  # fc2, row-parallel

    def all_gather_then_matmul():
        gathered = torch.empty(TOKENS, HIDDEN, **kw)
        dist.all_gather_into_tensor(gathered, x)
        return gathered @ w1.t()

    def fused_all_gather_matmul():
        return torch.ops.symm_mem.fused_all_gather_matmul(x, [w1.t()], 0, name)

    def matmul_then_reduce_scatter():
        partial = a @ w2.t()
        out = torch.empty(TOKENS // size, HIDDEN, **kw)
        dist.reduce_scatter_tensor(out, partial)
        return out

    def fused_matmul_reduce_scatter():
        return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w2.t(), "sum", 0, name)

    def fc1_alone():
        return torch.empty(TOKENS, HIDDEN, **kw) @ w1.t()

    def fc2_alone():
        return a @ w2.t()

    results = {}
    for label, f in (("mm fc1 alone", fc1_alone), ("NCCL all-gather + mm", all_gather_then_matmul),
                     ("fused_all_gather_matmul", fused_all_gather_matmul), ("mm fc2 alone", fc2_alone),
                     ("mm + NCCL reduce-scatter", matmul_then_reduce_scatter),
                     ("fused_matmul_reduce_scatter", fused_matmul_reduce_scatter)):
        try:
            results[label] = f"{timed(f):.3f}"
        except Exception as err:  # (a schedule this torch or machine does not run: said in the results)
            results[label] = f"failed: {type(err).__name__}: {str(err)[:120]}"
    if rank == 0:
        print(f"TP {size}:", results, flush=True)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    for size in (2, 4):
        torch.multiprocessing.spawn(main, args=(size, free_port()), nprocs=size)
