"""Generated modules inside the usual training machinery, on CPU (CI): torch.autocast (the module
computes in autocast's dtype, as TE does; grads reach the parameters in their own dtype),
activation checkpointing, torch.save / torch.load of whole modules, and DistributedDataParallel
and FSDP2's fully_shard over gloo with two processes (gradients equal to one process's on the
whole batch)."""

import contextlib
import copy
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint

import generated
from references import randomize_


def _module(cls="Gpt2Mlp", dtype=torch.float32):
    module = getattr(generated, cls)(dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    return module


def _grads(module):
    return {k: p.grad.clone() for k, p in module.named_parameters()}


def test_autocast_computes_in_its_dtype_and_grads_reach_the_parameters():
    module = _module()
    half = copy.deepcopy(module).to(torch.bfloat16)  # what autocast must amount to
    x = torch.randn(2, 5, 1024, generator=torch.Generator().manual_seed(2))
    gy = torch.randn(2, 5, 1024, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x.requires_grad_())
    assert y.dtype == torch.bfloat16
    y.backward(gy)
    x_half = x.detach().bfloat16().requires_grad_()
    y_half = half(x_half)
    y_half.backward(gy)
    assert torch.equal(y, y_half)
    assert torch.equal(x.grad, x_half.grad.float())
    for key, grad in _grads(module).items():
        assert grad.dtype == torch.float32
        assert torch.equal(grad, half.get_parameter(key).grad.float())


def test_autocast_with_an_in_place_residual_writes_into_the_callers_tensor():
    module = _module("ResidualInPlace")
    x, r = torch.randn(3, 256), torch.randn(3, 256)
    with torch.no_grad():
        expected = copy.deepcopy(module).to(torch.bfloat16)(x.bfloat16(), r.bfloat16().clone())
    residual = r.clone()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = module(x, residual)
    assert residual.dtype == torch.float32 and not torch.equal(residual, r)  # written through
    assert torch.equal(y, expected)


def test_activation_checkpointing_gives_the_same_grads():
    module = _module()
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(4), requires_grad=True)
    module(x).square().sum().backward()
    plain, plain_x = _grads(module), x.grad.clone()
    module.zero_grad()
    x.grad = None
    torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False).square().sum().backward()
    assert torch.equal(x.grad, plain_x)
    for key, grad in _grads(module).items():
        assert torch.equal(grad, plain[key])


def test_whole_modules_survive_torch_save_and_load(tmp_path):
    module = _module("PostAttention")
    path = tmp_path / "module.pt"
    torch.save(module, path)
    loaded = torch.load(path, weights_only=False)
    assert type(loaded) is type(module)
    x, r = torch.randn(3, 256), torch.randn(3, 256)
    loaded.eval()
    module.eval()
    for a, b in zip(module(x, r), loaded(x, r)):
        assert torch.equal(a, b)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _process_group(rank, world, port):
    """This process as rank ``rank`` of a gloo group on this host, for the block."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        # Both ranks done with every collective before either tears gloo down: a rank destroying
        # the group while the other's last work is still in flight aborted once in CI ("terminate
        # called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _on_two_ranks(worker, batch):
    """What rank 0 of ``worker(rank, world, port, batch, result)`` put in ``result``, run as two
    processes with this process's intra-op thread count (a spawned rank would otherwise take one
    thread a core, and a float reduction split over other threads rounds differently)."""
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(_rank, args=(worker, torch.get_num_threads(), 2, _free_port(), batch, result), nprocs=2,
                 join=True)
        return dict(result)


def _rank(rank, worker, threads, *args):
    """One rank: ``worker`` on ``threads`` intra-op threads, then an exit that skips the
    interpreter's teardown. Its work is done and its group destroyed by then, but a rank's
    finalisation aborted twice in CI ("terminate called without an active exception": a C++ thread
    object of torch.distributed still joinable when static destructors ran), failing the spawn. A
    worker that raises exits as usual, with its error."""
    torch.set_num_threads(threads)
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ddp(rank, world, batch, result):
    module = _module()
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    shard = batch.chunk(world)[rank]
    ddp(shard).square().sum().backward()  # DDP averages the ranks' grads
    if rank == 0:
        result.update({f"ddp {k}": p.grad.clone() for k, p in module.named_parameters()})


def _ddp_compiled(rank, world, batch, result):
    """DDP around a generated module under torch.compile(fullgraph=True) (DDP's own forward is not
    traced whole: it logs and syncs on the host): the module's forward and backward are the
    compiled training ops, and DDP's reducer still sees every parameter's grad."""
    module = _module()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(module, fullgraph=True, backend="aot_eager"))
    shard = batch.chunk(world)[rank]
    ddp(shard).square().sum().backward()
    if rank == 0:
        result.update({f"compiled ddp {k}": p.grad.clone() for k, p in module.named_parameters()})


def _fsdp2(rank, world, batch, result):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = _module()
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)))  # each rank keeps half of every parameter
    shard = batch.chunk(world)[rank]
    for step in range(2):  # the second step reshards, unshards and accumulates again
        out = module(shard)
        out.square().sum().backward()  # FSDP averages the ranks' grads
        if rank == 0 and step == 0:
            result["fsdp output"] = out.detach().clone()
    grads = {k: p.grad.full_tensor() for k, p in module.named_parameters()}  # gathers the shards
    if rank == 0:
        result.update({f"fsdp {k}": g for k, g in grads.items()})


def _has_fsdp2():
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


FSDP2 = _has_fsdp2()  # torch's FSDP2 (torch.distributed.fsdp.fully_shard), where this torch has it


def _data_parallel_worker(rank, world, port, batch, result):
    """DDP, then FSDP2 where this torch has it, in one group of two ranks: one pair of processes
    (each imports torch and the package, most of what such a test costs) serves both."""
    with _process_group(rank, world, port):
        _ddp(rank, world, batch, result)
        _ddp_compiled(rank, world, batch, result)
        if FSDP2:
            _fsdp2(rank, world, batch, result)


def _shard_grads(batch, world):
    """Each rank's own grads, computed here one shard at a time: what DDP and FSDP2 reduce."""
    grads = []
    for shard in batch.chunk(world):
        module = _module()
        module(shard).square().sum().backward()
        grads.append(_grads(module))
    return grads


def test_ddp_and_fsdp2_over_gloo_match_one_process():
    """DDP: one forward + backward, also under torch.compile; FSDP2's fully_shard: two steps (the grads accumulate). The
    output of rank 0's shard and the grads equal, bit for bit, one process that runs each rank's
    shard itself on the same thread count: a shard's grads are the same fp32 computation either
    way, and averaging two ranks (each halves its grad, then the halves are summed, or the sum is
    halved) is exact in float, whatever the order. Comparing with one process on the whole batch
    instead would compare different summation orders of the rows, which differ in roundoff by an
    amount that depends on the thread count."""
    batch = torch.randn(8, 1024, generator=torch.Generator().manual_seed(5))
    result = _on_two_ranks(_data_parallel_worker, batch)
    first, second = _shard_grads(batch, 2)
    averaged = {key: first[key] / 2 + second[key] / 2 for key in first}
    assert {k[4:] for k in result if k.startswith("ddp ")} == set(averaged)
    for key, grad in averaged.items():
        torch.testing.assert_close(result[f"ddp {key}"], grad, rtol=0, atol=0, msg=f"DDP grad {key}")
        # under torch.compile (the training ops, their CPU path the same math): the same bits
        torch.testing.assert_close(result[f"compiled ddp {key}"], grad, rtol=0, atol=0,
                                   msg=f"compiled DDP grad {key}")
    if not FSDP2:
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard): DDP checked only")
    torch.testing.assert_close(result["fsdp output"], _module()(batch.chunk(2)[0]).detach(), rtol=0, atol=0)
    assert {k[5:] for k in result if k.startswith("fsdp ") and k != "fsdp output"} == set(averaged)
    for key, grad in averaged.items():  # two steps of the same averaged grad, accumulated
        torch.testing.assert_close(result[f"fsdp {key}"], grad + grad, rtol=0, atol=0, msg=f"FSDP2 grad {key}")
