"""Tensor and sequence parallelism (issue 41): specs/tensor_parallel.py's pipelines, one process a
rank (gloo on CPU in CI, 2 and 4 ranks; NCCL on 2 GPUs where there are), against float64
references of the unsharded model on the full tensors, written here from TE's semantics (catalog
2.1-2.3, 2.13): each rank's output and input grad are its share of the reference's, and its
parameter grads, put together as the shards split (independently of the runtime's helpers), are
the reference's.
"""

import faulthandler
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from tests.references import attention64, rms_norm, swiglu

# seconds a rank's check may take before it is taken as hung (every check here takes well under a
# minute on CPU or GPU); lower it to see a hang's stacks sooner
RANK_TIMEOUT_S = float(os.environ.get("FUSEGEN_TEST_RANK_TIMEOUT_S", 300))
ROWS = 8  # tokens a rank holds where the sequence is split (x is [ROWS, 3, 256] there)


def _mlp(p, x):
    return F.linear(swiglu(F.linear(rms_norm(x, p["0.weight"]), p["1.weight"])), p["3.weight"], p["3.bias"])


def _glu_rows(w, rank, ranks):
    """A column-parallel weight before a SwiGLU: this rank's share of the gates, then of the linears."""
    return torch.cat([half.chunk(ranks)[rank] for half in w.chunk(2)])


def _qkv_rows(w, rank, ranks):
    """The fused q, k, v projection of 8 query and 4 key/value heads of 64: this rank's share of the
    q heads, then of the k heads, then of the v heads (each rank attends with its own heads)."""
    return torch.cat([part.chunk(ranks)[rank] for part in w.split([8 * 64, 4 * 64, 4 * 64])])


def _layer(p, x, lengths=None):
    """specs/tensor_parallel.py's tp_layer, unsharded: x [tokens, 512] of packed sequences of
    ``lengths``, or [batch, seq, 512] (batch sequences of seq tokens)."""
    rows = x.reshape(-1, x.shape[-1])
    lengths = lengths or [x.shape[1]] * x.shape[0]
    h = attention64(F.linear(rms_norm(rows, p["0.0.weight"]), p["0.1.weight"]), lengths, 8, 4, True, 10000.0)
    rows = rows + F.linear(h, p["0.3.weight"])
    rows = rows + F.linear(swiglu(F.linear(rms_norm(rows, p["1.0.weight"]), p["1.1.weight"])), p["1.3.weight"])
    return rows.reshape(x.shape)


# Each pipeline: its size, full parameter shapes, how x and y are split over the ranks ("rows": dim 0
# of the tokens, "features": the last dim, "none": every rank has it whole), and how each parameter
# is held: "rows"/"cols" (a slice along dim 0 / 1), "glu" (_glu_rows), "qkv" (_qkv_rows), "whole" (every rank the whole,
# each rank's grad its own share: their sum is the reference's), "bias-sum" (a row-parallel Linear's
# bias: rank 0's the bias, the others zeros; each rank's grad the reference's whole).
PIPELINES = {
    "TpMlp": (2, {"0.weight": (256,), "1.weight": (2048, 256), "3.weight": (256, 1024), "3.bias": (256,)},
              "rows", "rows", {"0.weight": "whole", "1.weight": "glu", "3.weight": "cols", "3.bias": "bias-sum"}, _mlp),
    "TpMlp4": (4, {"0.weight": (256,), "1.weight": (4096, 256), "3.weight": (256, 2048), "3.bias": (256,)},
               "rows", "rows", {"0.weight": "whole", "1.weight": "glu", "3.weight": "cols", "3.bias": "bias-sum"},
               _mlp),
    "TpResidualMlp": (2, {"0.0.weight": (256,), "0.1.weight": (2048, 256), "0.3.weight": (256, 1024), "0.3.bias": (256,)},
                      "rows", "rows", {"0.0.weight": "whole", "0.1.weight": "glu", "0.3.weight": "cols",
                                       "0.3.bias": "bias-sum"},
                      lambda p, x: x + _mlp({key[2:]: value for key, value in p.items()}, x)),
    "TpColumn": (2, {"0.weight": (512, 256), "0.bias": (512,)}, "none", "features",
                 {"0.weight": "rows", "0.bias": "rows"}, lambda p, x: F.linear(x, p["0.weight"], p["0.bias"])),
    "TpRow": (2, {"0.weight": (256, 512), "0.bias": (256,)}, "features", "none",
              {"0.weight": "cols", "0.bias": "bias-sum"}, lambda p, x: F.linear(x, p["0.weight"], p["0.bias"])),
    # the same pipeline over 4 ranks: TpRow is built for 1, 2 and 4 (tensor_parallel_size = [1, 2, 4])
    "TpRow4": (4, {"0.weight": (256, 512), "0.bias": (256,)}, "features", "none",
               {"0.weight": "cols", "0.bias": "bias-sum"}, lambda p, x: F.linear(x, p["0.weight"], p["0.bias"])),
    "TpLayer": (2, {"0.0.weight": (512,), "0.1.weight": (1024, 512), "0.3.weight": (512, 512), "1.0.weight": (512,),
                    "1.1.weight": (2048, 512), "1.3.weight": (512, 1024)}, "rows", "rows",
                {"0.0.weight": "whole", "0.1.weight": "qkv", "0.3.weight": "cols", "1.0.weight": "whole",
                 "1.1.weight": "glu", "1.3.weight": "cols"}, _layer),
}


def _te_modules(p, x):
    """specs/tensor_parallel.py's tp_te_modules, unsharded (TE's modules: biases added once)."""
    h = F.linear(rms_norm(x, p["0.layer_norm_weight"]), p["0.fc1_weight"], p["0.fc1_bias"])
    h = F.linear(swiglu(h), p["0.fc2_weight"], p["0.fc2_bias"])
    return F.linear(F.linear(h, p["1.weight"], p["1.bias"]), p["2.weight"], p["2.bias"])


PIPELINES["TpTeModules"] = (
    2, {"0.layer_norm_weight": (256,), "0.fc1_weight": (2048, 256), "0.fc1_bias": (2048,), "0.fc2_weight": (256, 1024),
        "0.fc2_bias": (256,), "1.weight": (512, 256), "1.bias": (512,), "2.weight": (256, 512), "2.bias": (256,)},
    "rows", "rows", {"0.layer_norm_weight": "whole", "0.fc1_weight": "glu", "0.fc1_bias": "glu", "0.fc2_weight": "cols",
                     "0.fc2_bias": "whole", "1.weight": "rows", "1.bias": "rows", "2.weight": "cols", "2.bias": "whole"},
    _te_modules)


def _grouped_to_qkv(t, groups=2, per_group=2, d=64):
    """TE's fused QKV rows grouped per GQA group ([q heads of g, k_g, v_g] each) as [q | k | v]."""
    blocks = t.reshape(groups, (per_group + 2) * d, *t.shape[1:])
    return torch.cat([blocks[:, : per_group * d].reshape(-1, *t.shape[1:]),
                      blocks[:, per_group * d:(per_group + 1) * d].reshape(-1, *t.shape[1:]),
                      blocks[:, (per_group + 1) * d:].reshape(-1, *t.shape[1:])])


def _te_layers(p, x, lengths, layers=("0", "1")):
    """specs/tensor_parallel.py's tp_te_layer, unsharded: two of TE's TransformerLayers (pre-norm
    RMSNorm, 4 heads and 2 GQA groups of 64, causal, no rotary, SwiGLU, biases), the first holding
    TE's query, key and value blocks, the second one weight grouped per GQA group."""
    for layer in layers:
        qkv = f"{layer}.self_attention.layernorm_qkv."
        if layer == "0":
            w = torch.cat([p[qkv + f"{name}_weight"] for name in ("query", "key", "value")])
            b = torch.cat([p[qkv + f"{name}_bias"] for name in ("query", "key", "value")])
        else:
            w, b = _grouped_to_qkv(p[qkv + "weight"]), _grouped_to_qkv(p[qkv + "bias"])
        h = attention64(F.linear(rms_norm(x, p[qkv + "layer_norm_weight"]), w, b), lengths, 4, 2, True, None)
        x = x + F.linear(h, p[f"{layer}.self_attention.proj.weight"], p[f"{layer}.self_attention.proj.bias"])
        mlp = f"{layer}.layernorm_mlp."
        h = swiglu(F.linear(rms_norm(x, p[mlp + "layer_norm_weight"]), p[mlp + "fc1_weight"], p[mlp + "fc1_bias"]))
        x = x + F.linear(h, p[mlp + "fc2_weight"], p[mlp + "fc2_bias"])
    return x


def _te_layer_sbhd(p, x):
    """tp_te_layer_sbhd, unsharded: the first of those layers on x [seq, batch, hidden], each batch
    column a sequence."""
    seq, batch, hidden = x.shape
    rows = _te_layers(p, x.transpose(0, 1).reshape(-1, hidden), [seq] * batch, layers=("0",))
    return rows.reshape(batch, seq, hidden).transpose(0, 1)


def _te_layer_parameters(layers=("0", "1")):
    shapes, held = {}, {}
    for layer in layers:
        qkv, mlp = f"{layer}.self_attention.layernorm_qkv.", f"{layer}.layernorm_mlp."
        blocks = {"query": 256, "key": 128, "value": 128} if layer == "0" else {"": 512}
        for name, rows in blocks.items():
            for kind, shape in (("weight", (rows, 256)), ("bias", (rows,))):
                shapes[qkv + (f"{name}_{kind}" if name else kind)] = shape
                held[qkv + (f"{name}_{kind}" if name else kind)] = "rows"  # (whole GQA groups: rows in order)
        for key, shape, how in ((qkv + "layer_norm_weight", (256,), "whole"),
                                (f"{layer}.self_attention.proj.weight", (256, 256), "cols"),
                                (f"{layer}.self_attention.proj.bias", (256,), "whole"),
                                (mlp + "layer_norm_weight", (256,), "whole"), (mlp + "fc1_weight", (1024, 256), "glu"),
                                (mlp + "fc1_bias", (1024,), "glu"), (mlp + "fc2_weight", (256, 512), "cols"),
                                (mlp + "fc2_bias", (256,), "whole")):
            shapes[key], held[key] = shape, how
    return shapes, held


_TE_SHAPES, _TE_HELD = _te_layer_parameters()
PIPELINES["TpTeLayer"] = (2, _TE_SHAPES, "rows", "rows", _TE_HELD, _te_layers)
# TE's default "sbhd", sequence parallel: x [seq, batch, hidden], each rank its share of the seq dim
_SBHD_SHAPES, _SBHD_HELD = _te_layer_parameters(("0",))
PIPELINES["TpTeLayerSbhd"] = (2, _SBHD_SHAPES, "rows", "rows", _SBHD_HELD, _te_layer_sbhd)
CLASSES = {"TpRow4": "TpRow"}  # a test's module class where it is not the test's name
# packed sequences over the ranks' tokens (sequence parallel: rank r holds rows 12r..12r+11, and a
# sequence may cross ranks), empty and one-token ones among them
LENGTHS = [5, 1, 10, 0, 8]


# each collective's backward between the fused Functions, in backward order: whether it took the
# result its reader started (an all-gather before a Linear and a Linear's reduce-scatter run inside
# the Function, micro-pipelined with the GEMM: stages/collective.py's COLLECTIVE_GEMM)
EARLY = {"TpMlp": [False], "TpMlp4": [False], "TpResidualMlp": [False], "TpColumn": [True], "TpRow": [], "TpRow4": [],
         "TpLayer": [], "TpTeModules": [], "TpTeLayer": [], "TpTeLayerSbhd": []}


def _share(t, how, rank, ranks):
    if how in ("none", "whole", "bias-sum"):
        return t
    if how in ("glu", "qkv"):
        return (_glu_rows if how == "glu" else _qkv_rows)(t, rank, ranks)
    dim = {"rows": 0, "cols": 1, "features": -1}[how]
    return t.chunk(ranks, dim=dim)[rank]


def _close(got, want, what, scale=None):
    err, scale = (got.double() - want).abs().max().item(), scale or want.abs().max().item()
    assert err <= 1e-12 * max(scale, 1.0), f"{what}: max |err| {err:.3e} at scale {scale:.3e}"


def check_pipeline(rank, ranks, device, name, lengths=None):
    """``lengths``: x is [tokens, features] of packed sequences of these lengths over all the ranks'
    tokens, passed as seq_lens (else [rows, 3, features])."""
    import generated

    size, shapes, x_split, y_split, held, reference = PIPELINES[name]
    assert size == ranks
    dtype = torch.float64 if device == "cpu" else torch.float32
    gen = torch.Generator().manual_seed(7)  # the same full tensors on every rank
    full = {key: torch.randn(shape, generator=gen, dtype=torch.float64) * (0.1 if len(shape) == 2 else 1.0)
            for key, shape in shapes.items()}
    in_features = next(iter(shapes.values()))[-1]  # (the first parameter's last dim: x's width)
    x = torch.randn(ROWS * ranks if x_split == "rows" else ROWS, 3, in_features, generator=gen, dtype=torch.float64)
    if lengths is not None:
        x = torch.randn(sum(lengths), in_features, generator=gen, dtype=torch.float64)
        reference = (lambda model: lambda p, x: model(p, x, lengths))(reference)
    # the reference: the unsharded model on the full tensors, in float64, through autograd
    params = {key: value.clone().requires_grad_() for key, value in full.items()}
    xr = x.clone().requires_grad_()
    yr = reference(params, xr)
    dy = torch.randn(yr.shape, generator=gen, dtype=torch.float64)
    yr.backward(dy)

    module = getattr(generated, CLASSES.get(name, name))(device=device, dtype=dtype)
    extra = {key: value for key, value in module.state_dict().items() if key not in full}  # TE's _extra_state
    module.load_full_state_dict({key: value.to(device, dtype) for key, value in full.items()} | extra)
    xl = _share(x, x_split, rank, ranks).to(device, dtype).requires_grad_()
    pairs = _taken_early()
    y = module(xl) if lengths is None else module(xl, torch.tensor(lengths))
    y.backward(_share(dy, y_split, rank, ranks).to(device, dtype))
    # a collective whose output a fused Function with weight-grad GEMMs reads (an all-gather or the
    # copy before a column-parallel Linear) has its backward started by that Function before those
    # GEMMs, and takes that result; one whose output the module returns or a Function without
    # weight grads reads (a reduce-scatter before the residual add) runs its own; an all-reduce's
    # backward runs none
    assert pairs == EARLY[name], pairs
    check = _close if device == "cpu" else _close_f32
    check(y.cpu(), _share(yr.detach(), y_split, rank, ranks), f"{name} rank {rank} y")
    check(xl.grad.cpu(), _share(xr.grad, x_split, rank, ranks), f"{name} rank {rank} dx")
    for key, parameter in module.named_parameters():
        grad = parameter.grad.cpu()
        if held[key] == "whole":  # each rank's share of the reference's grad: their sum is it
            grad = grad.to(device)
            torch.distributed.all_reduce(grad)
            grad = grad.cpu()
        check(grad, _share(params[key].grad, held[key], rank, ranks), f"{name} rank {rank} d{key}",
              scale=_qkv_scale(key, params))
    # the shards put back together are the full parameters, on every rank
    for key, value in module.full_state_dict().items():
        if key not in extra:
            check(value.cpu(), full[key], f"{name} rank {rank} full_state_dict {key}")


def _qkv_scale(key, params):
    """The scale a grad of TE's separate query, key or value blocks is checked at: all three's.
    They are one GEMM's rows, their grads one kernel's sums, rounded at that kernel's magnitudes;
    the key bias's own grad is zero by math (softmax ignores a shift shared by every key), so its
    rounding has no scale of its own. None for any other parameter (its own max |ref|)."""
    for block in ("query_", "key_", "value_"):
        if f".{block}" in key:
            blocks = [key.replace(f".{block}", f".{other}") for other in ("query_", "key_", "value_")]
            return max(params[name].grad.abs().max().item() for name in blocks)
    return None


def _taken_early():
    """A list that each collective's backward appends to from now on in this process: whether it
    took the result its reader's Function started early (collectives.Pair)."""
    from generated._runtime import collectives

    taken, take = [], collectives.Pair.take

    def recording(pair, grad):
        taken.append(pair.work is not None and pair.grad is grad)
        return take(pair, grad)
    collectives.Pair.take = recording
    return taken


def _close_f32(got, want, what, scale=None):
    # fp32 on the GPU (TF32 off): GEMMs of up to 2,048 products, four stages; the reference is float64
    err, scale = (got.double() - want).abs().max().item(), scale or want.abs().max().item()
    assert err <= 1e-5 * max(scale, 1.0), f"{what}: max |err| {err:.3e} at scale {scale:.3e}"


def check_comm(rank, ranks, device):
    """TE's AllGather, ReduceScatter and AllReduce around a Linear every rank holds whole."""
    import generated

    dtype = torch.float64 if device == "cpu" else torch.float32
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(256, 256, generator=gen, dtype=torch.float64) * 0.1, torch.randn(256, generator=gen, dtype=torch.float64)
    x = torch.randn(ranks * 6, 256, generator=gen, dtype=torch.float64)  # each rank's 6 rows, in rank order
    # y is every rank's the same after the all-reduce, and so is its grad (TE's AllReduce passes the
    # grad on as it is: the loss every rank computes is the same, as in Megatron's replicated regions)
    dy = torch.randn(6, 256, generator=gen, dtype=torch.float64)
    wr, br, xr = w.clone().requires_grad_(), b.clone().requires_grad_(), x.clone().requires_grad_()
    # gathered: every rank computes h from all rows; reduce-scatter: the ranks' (equal) h summed,
    # rank r keeping its rows; all-reduce: those summed over the ranks
    h = F.linear(xr, wr, br) * ranks
    summed = sum(h.chunk(ranks))  # every rank's y
    (summed * dy).sum().backward()
    module = generated.TpComm(device=device, dtype=dtype)
    module.load_state_dict({"1.weight": w.to(device, dtype), "1.bias": b.to(device, dtype)})
    xl = x.chunk(ranks)[rank].to(device, dtype).requires_grad_()
    y = module(xl)
    y.backward(dy.to(device, dtype))
    check = _close if device == "cpu" else _close_f32
    check(y.cpu(), summed.detach(), f"TpComm rank {rank} y")
    check(xl.grad.cpu(), xr.grad.chunk(ranks)[rank], f"TpComm rank {rank} dx")
    for key, want in (("1.weight", wr.grad), ("1.bias", br.grad)):
        grad = dict(module.named_parameters())[key].grad.clone()
        torch.distributed.all_reduce(grad)  # each rank's copy got its share
        check(grad.cpu(), want, f"TpComm rank {rank} d{key}")


def _rank_main(rank, ranks, port, backend, device, check, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share the machine's cores
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        device = f"cuda:{rank}"
    torch.distributed.init_process_group(backend, rank=rank, world_size=ranks)
    # a rank left waiting on a failed partner's collective prints where it waits and exits: the
    # test fails with both ranks' stories instead of hanging the run
    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)
    check(rank, ranks, device, *args)
    faulthandler.cancel_dump_traceback_later()
    # (only after a pass: a failed rank's would wait on its partner under NCCL; exiting frees it)
    torch.distributed.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ranks, check, *args, backend="gloo", device="cpu"):
    """``check(rank, ranks, device, *args)`` in ``ranks`` processes of one process group; a failing
    rank's exception fails the test."""
    torch.multiprocessing.spawn(_rank_main, args=(ranks, _free_port(), backend, device, check, args), nprocs=ranks)


def _gpus(n):
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < n,
                              reason=f"needs {n} GPUs")


@pytest.mark.parametrize("name", ["TpMlp", "TpMlp4", "TpResidualMlp", "TpColumn", "TpRow", "TpRow4", "TpLayer",
                                  "TpTeModules", "TpTeLayerSbhd"])
def test_tensor_parallel_pipeline_matches_the_unsharded_model(name):
    run_ranks(PIPELINES[name][0], check_pipeline, name)


@pytest.mark.parametrize("name", ["TpLayer", "TpTeLayer"])
def test_a_tensor_parallel_layer_attends_over_packed_sequences_across_the_ranks(name):
    run_ranks(2, check_pipeline, name, LENGTHS)


def test_te_communication_ops():
    run_ranks(2, check_comm)


@pytest.mark.cuda
@pytest.mark.parametrize("name", [pytest.param(name, marks=_gpus(PIPELINES[name][0]))
                                  for name in ["TpMlp", "TpMlp4", "TpResidualMlp", "TpColumn", "TpRow", "TpLayer",
                                               "TpTeModules", "TpTeLayerSbhd"]])
def test_tensor_parallel_pipeline_on_gpus_with_nccl(name):
    run_ranks(PIPELINES[name][0], check_pipeline, name, backend="nccl", device="cuda")


@pytest.mark.cuda
@_gpus(2)
@pytest.mark.parametrize("name", ["TpLayer", "TpTeLayer"])
def test_a_tensor_parallel_layer_over_packed_sequences_on_gpus_with_nccl(name):
    run_ranks(2, check_pipeline, name, LENGTHS, backend="nccl", device="cuda")


@pytest.mark.cuda
@_gpus(2)
def test_te_communication_ops_on_gpus_with_nccl():
    run_ranks(2, check_comm, backend="nccl", device="cuda")


def _step(module, x, dy, lengths=None):
    """One training step's output, x grad and parameter grads (set anew)."""
    for parameter in module.parameters():
        parameter.grad = None
    x = x.detach().requires_grad_()
    y = module(x) if lengths is None else module(x, torch.tensor(lengths))
    y.backward(dy)
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def check_two_dimensions(rank, ranks, device, wrapper):
    """TpMlp on a 2 x 2 mesh: tensor parallel over "tp", data parallel over "dp" by DDP or FSDP2
    (fully_shard: each parameter's shard further split over dp, gathered for the forward). Each dp
    group runs its own batch; the grads are the unsharded model's averaged over the batches."""
    import generated
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.split(":")[0], (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    _, shapes, _, _, held, reference = PIPELINES["TpMlp"]
    dtype = torch.float64 if device == "cpu" else torch.float32
    gen = torch.Generator().manual_seed(7)
    full = {key: torch.randn(shape, generator=gen, dtype=torch.float64) * (0.1 if len(shape) == 2 else 1.0)
            for key, shape in shapes.items()}
    xs = [torch.randn(ROWS * 2, 3, 256, generator=gen, dtype=torch.float64) for _ in range(2)]  # a batch a dp group
    dys = [torch.randn(ROWS * 2, 3, 256, generator=gen, dtype=torch.float64) for _ in range(2)]
    params = {key: value.clone().requires_grad_() for key, value in full.items()}
    ys = []
    for x, dy in zip(xs, dys):
        y = reference(params, x)
        (y * dy).sum().backward()
        ys.append(y.detach())
    module = generated.TpMlp(device=device, dtype=dtype, tensor_parallel_group=mesh["tp"].get_group())
    module.load_full_state_dict({key: value.to(device, dtype) for key, value in full.items()})
    if wrapper == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(module, process_group=mesh["dp"].get_group())
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(module, mesh=mesh["dp"])
    x = xs[dp].chunk(2)[tp].to(device, dtype).requires_grad_()
    y = model(x)
    y.backward(dys[dp].chunk(2)[tp].to(device, dtype))
    check = _close if device == "cpu" else _close_f32
    check(y.detach().cpu(), ys[dp].chunk(2)[tp], f"{wrapper} rank {rank} y")
    for key, parameter in module.named_parameters():
        grad = parameter.grad
        grad = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
        if held[key] == "whole":  # each tp rank's share of it (see check_pipeline)
            torch.distributed.all_reduce(grad, group=mesh["tp"].get_group())
        want = _share(params[key].grad / 2, held[key], tp, 2)  # averaged over the 2 dp groups' batches
        check(grad.cpu(), want, f"{wrapper} rank {rank} d{key}")


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_tensor_parallel_composes_with_data_parallel_on_a_2d_mesh(wrapper):
    run_ranks(4, check_two_dimensions, wrapper)


@pytest.mark.cuda
@_gpus(4)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_2d_mesh_on_gpus_with_nccl(wrapper):
    run_ranks(4, check_two_dimensions, wrapper, backend="nccl", device="cuda")


def check_compiled(rank, ranks, device, name, backend, lengths=None):
    """torch.compile(fullgraph=True) of the module in training (the collectives traced as PyTorch's
    functional collectives; fullgraph raises on a graph break) gives the eager module's output and
    grads, on two calls of new values."""
    import generated

    torch.manual_seed(rank)
    module = getattr(generated, name)(device=device, dtype=torch.float64 if device == "cpu" else torch.float32)
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    rows = (sum(lengths) // ranks,) if lengths else (ROWS, 3)
    for _ in range(2):
        x = torch.randn(*rows, module.in_features, device=device, dtype=next(module.parameters()).dtype)
        dy = torch.randn(*rows, module.out_features, device=device, dtype=x.dtype)
        for got, want in zip(_step(compiled, x, dy, lengths), _step(module, x, dy, lengths)):
            torch.testing.assert_close(got, want, rtol=1e-12 if device == "cpu" else 1e-5, atol=1e-12 if device == "cpu" else 1e-5)


@pytest.mark.parametrize("name", ["TpMlp", "TpColumn", "TpRow", "TpLayer", "TpTeLayerSbhd"])
def test_compile_fullgraph_runs_the_collectives_in_the_graph(name):
    run_ranks(2, check_compiled, name, "aot_eager", LENGTHS if name == "TpLayer" else None)


def test_compile_fullgraph_runs_te_communication_ops():
    run_ranks(2, check_compiled, "TpComm", "aot_eager")


def check_graphed(rank, ranks, device, name):
    """A training step of the module captured in a CUDA graph (NCCL's collectives captured with it)
    and replayed on new values gives the eager step's output and grads (in bf16 where attention
    runs: FlashAttention-2 is what captures)."""
    import generated

    torch.manual_seed(rank)
    dtype = torch.bfloat16 if "Layer" in name else torch.float32
    module = getattr(generated, name)(device=device, dtype=dtype)
    rows = (ROWS, 3)
    static_x = torch.randn(*rows, module.in_features, device=device, dtype=dtype, requires_grad=True)
    static_dy = torch.randn(*rows, module.out_features, device=device, dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (NCCL's communicators, symmetric memory)
        for _ in range(3):
            _step(module, static_x, static_dy)
    torch.cuda.current_stream().wait_stream(side)
    for parameter in module.parameters():
        parameter.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = module(static_x)
        static_y.backward(static_dy)
    static = [static_y, static_x.grad] + [p.grad for p in module.parameters()]  # what each replay writes
    for _ in range(2):
        x, dy = torch.randn_like(static_x), torch.randn_like(static_dy)
        static_x.data.copy_(x)
        static_dy.copy_(dy)
        graph.replay()
        got = [t.clone() for t in static]
        for g, want in zip(got, _step(module, x, dy)):  # (the same kernels: bf16 at its roundoff, FA2's atomics)
            torch.testing.assert_close(g, want, **({} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}))
    torch.cuda.synchronize()
    del graph  # (before the process group goes: the graph holds NCCL's work)


@pytest.mark.cuda
@_gpus(2)
@pytest.mark.parametrize("name", ["TpMlp", "TpColumn", "TpRow", "TpComm", "TpLayer", "TpTeLayerSbhd"])
def test_compile_and_cuda_graphs_on_gpus_with_nccl(name):
    run_ranks(2, check_compiled, name, "inductor", LENGTHS if name == "TpLayer" else None, backend="nccl",
              device="cuda")
    run_ranks(2, check_graphed, name, backend="nccl", device="cuda")


def test_without_torch_distributed_a_pipeline_built_for_size_1_too_is_the_unsharded_one():
    import generated

    module = generated.TpRow(dtype=torch.float64)  # tensor_parallel_size = [1, 2, 4]
    assert type(module) is generated.TpRowTp1 and not hasattr(module, "tensor_parallel_group")
    x = torch.randn(3, 512, dtype=torch.float64)
    weight, bias = module.state_dict()["0.weight"], module.state_dict()["0.bias"]
    torch.testing.assert_close(module(x), F.linear(x, weight, bias), rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match=r"TpMlp is built for a tensor-parallel group of 2 ranks, but "):
        generated.TpMlp()


def test_construction_without_torch_distributed_says_how_to_launch():
    import generated

    with pytest.raises(RuntimeError, match=r"TpMlp is built for a tensor-parallel group of 2 ranks, but "
                                           r"torch.distributed is not initialised.*torchrun --nproc-per-node 2"):
        generated.TpMlp()


def check_errors(rank, ranks, device):
    import generated

    with pytest.raises(ValueError, match=r"TpMlp4: the tensor-parallel group has 2 ranks, but the module is built "
                                         r"for 4 \(\[tool.fusegen.pipelines.<name>\] tensor_parallel_size = 4\)"):
        generated.TpMlp4()
    with pytest.raises(TypeError, match="tensor_parallel_group must be a torch.distributed.ProcessGroup"):
        generated.TpMlp(tensor_parallel_group="tp")
    module = generated.TpMlp(dtype=torch.float64)
    with pytest.raises(ValueError, match=r"TpMlp: Linear\(256, 2048, .*\) \(op 1 at specs/tensor_parallel.py:.*\) "
                                         r"joins or splits the first dim .* but the input is 1-D"):
        module(torch.randn(256, dtype=torch.float64))
    # a pipeline built for several sizes: the module built for the group's, else an error naming them
    from generated._runtime import tensor_parallel

    assert type(generated.TpRow(dtype=torch.float64)) is generated.TpRowTp2
    with pytest.raises(ValueError, match=r"X is built for tensor-parallel groups of 1 and 4 ranks, but the group has "
                                         r"2; build it for 2 too \(\[tool.fusegen.pipelines.<name>\] "
                                         r"tensor_parallel_size = \[1, 2, 4\]\)"):
        tensor_parallel.built_size("X", None, (1, 4))
    with pytest.raises(TypeError, match="X: tensor_parallel_group must be a torch.distributed.ProcessGroup"):
        tensor_parallel.built_size("X", "tp", (1, 4))
    # a group of the same size, set later
    module.set_tensor_parallel_group(torch.distributed.new_group([0, 1]))
    y = module(torch.randn(4, 256, dtype=torch.float64))
    assert y.shape == (4, 256)


def test_bad_groups_and_inputs_get_clear_errors():
    run_ranks(2, check_errors)


TP_SPEC = """import transformer_engine.pytorch as te
mlp = te.ops.Sequential(
    te.ops.RMSNorm(64),
    te.ops.Linear(64, 256, bias=False, tensor_parallel_mode="column", tensor_parallel_group=tp, sequence_parallel=True),
    te.ops.SwiGLU(),
    te.ops.Linear(128, 64, tensor_parallel_mode="row", tensor_parallel_group=tp, sequence_parallel=True),
)
"""


def _plans(tmp_path, spec, table):
    from fusegen import build, config

    (tmp_path / "spec.py").write_text(spec)
    (tmp_path / "pyproject.toml").write_text('[tool.fusegen]\nspecs = ["spec.py"]\n' + table)
    return build.load_plans(config.load_config([], None, None, None, None, None, cwd=tmp_path))


def test_at_size_1_the_modes_are_ignored_and_the_collectives_left_out(tmp_path):
    (plan,) = _plans(tmp_path, TP_SPEC, "")
    assert [op.describe() for op in plan.pipeline.ops][1:3] == [
        "BasicLinear(64, 256, tensor_parallel_mode='column', tensor_parallel_group='tp', sequence_parallel=True)",
        "SwiGLU()"]
    assert plan.pipeline.group is None and not any(op.opdef.name in ("AllGather", "ReduceScatter") for op in plan.pipeline.ops)
    (plan,) = _plans(tmp_path, TP_SPEC, "[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = 4\n")
    assert [op.opdef.name for op in plan.pipeline.ops] == [
        "RMSNorm", "AllGather", "BasicLinear", "SwiGLU", "BasicLinear", "Bias", "ReduceScatter"]
    assert [shape for *_, shape, _ in plan.pipeline.params] == [(64,), (64, 64), (64, 32), (64,)]


@pytest.mark.parametrize("table, message", [
    ("[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = 3\n",
     r"Linear\(\): out_features=256 does not split over the 3 ranks of the tensor-parallel group"),
    ("[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = 0\n",
     r"tensor_parallel_size must be a whole number from 1 to 1024"),
    ("[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = [2, 2]\n",
     r"tensor_parallel_size must be a whole number from 1 to 1024 .*, or a list of distinct ones.*got \[2, 2\]"),
    ("[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = []\n", r"or a list of distinct ones"),
    ("[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = [2, 3]\n",
     r"Linear\(\): out_features=256 does not split over the 3 ranks"),
    ("[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = 2\nfp8 = [\"current\"]\n",
     r"built for FP8 too, and FP8 GEMMs between tensor-parallel collectives are not generated yet"),
    ("[tool.fusegen.pipelines.plain]\ntensor_parallel_size = 2\n",
     r"pipeline 'plain' .* has no op that splits over a tensor-parallel group"),
])
def test_build_errors_name_the_op_or_the_setting(tmp_path, table, message):
    from fusegen.errors import SpecError, UsageError

    spec = TP_SPEC + "plain = te.ops.Sequential(te.ops.Linear(64, 64))\n"
    with pytest.raises((SpecError, UsageError), match=message):
        _plans(tmp_path, spec, table)


def _linear(n_in, n_out, mode):
    return (f"te.ops.Linear({n_in}, {n_out}, bias=False, tensor_parallel_mode='{mode}', tensor_parallel_group=tp, "
            "sequence_parallel=True)")


@pytest.mark.parametrize("ops, message", [
    # a norm reads whole rows, which a rank does not hold between the column- and row-parallel Linears
    ([_linear(64, 128, "column"), "te.ops.RMSNorm(64)", _linear(64, 64, "row")],
     r"RMSNorm\(\): reads whole rows of features, but here each rank holds 1/4 of them"),
    ([_linear(64, 128, "column"), _linear(64, 64, "column")],
     r"Linear\(\): a column-parallel Linear reads whole rows of features, but the ops before it hold a rank's share"),
    ([_linear(64, 64, "column"), "te.ops.AllReduce(tp)"], r"AllReduce\(\): a collective between a column-parallel"),
    # attention splits its heads over the ranks: 2 kv heads do not split over 4
    ([_linear(256, 512, "column"), "te.ops.GroupedQueryAttention(256, 4, 2, te.DotProductAttention)",
      _linear(256, 256, "row")], r"GroupedQueryAttention\(\): runs on a rank's share of the features here .* its 4 "
                                 r"query heads and 2 key/value heads must each split over the 4 ranks"),
    ([_linear(256, 384, "column"), "te.ops.MultiQuerySelfAttention(256, 4, te.DotProductAttention)",
      _linear(256, 256, "row")], r"MultiQuerySelfAttention\(\): .* 1 key/value heads must each split over the 4 "
                                 r"ranks.*GroupedQueryAttention"),
    # a rank's 32 features of an interleaved GLU's blocks of 32 (gates, linears, ...) hold no linears
    ([_linear(64, 128, "column"), "te.ops.SwiGLU(glu_interleave_size=32)", _linear(64, 64, "row")],
     r"SwiGLU\(\): its blocks of 32 alternate gates and linears, but a rank's share of the features \(32\) is not"),
])
def test_ops_on_a_ranks_share_of_the_features_are_checked(tmp_path, ops, message):
    from fusegen.errors import SpecError

    spec = ("import transformer_engine.pytorch as te\nblock = te.ops.Sequential(\n"
            + "".join(f"    {op},\n" for op in ops) + ")\n")
    with pytest.raises(SpecError, match=message):
        _plans(tmp_path, spec, "[tool.fusegen.pipelines.block]\ntensor_parallel_size = 4\n")


def test_the_sharded_layer_splits_each_of_q_k_and_v_and_reads_all_ranks_tokens():
    import generated

    shards = generated.TpLayer.tensor_parallel_shards
    assert shards == {"0.1.weight": (512, 256, 256), "0.3.weight": 1, "1.1.weight": (1024, 1024), "1.3.weight": 1}
    source = open(generated.tp_layer.__file__).read()
    assert 'packed_sequences("TpLayer", x, seq_lens, max_seqlen, ranks=2)' in source


@pytest.mark.parametrize("op, table, message", [
    ("te.Linear(64, 64, parallel_mode='column', tp_size=4)", 2,
     r"Linear\(\): tp_size=4, but the pipeline is built for a tensor-parallel group of 2; set "
     r"\[tool.fusegen.pipelines.<name>\] tensor_parallel_size = 4"),
    ("te.Linear(64, 64, parallel_mode='column', tp_size=2)", 1, r"tp_size=2, but the pipeline is built for a "
                                                                r"tensor-parallel group of 1"),
    ("te.Linear(64, 64, parallel_mode='row', tensor_parallel_mode='column')", 2,
     r"parallel_mode='row' \(TE's module\) and tensor_parallel_mode='column' \(TE's op\) disagree"),
    ("te.LayerNormLinear(64, 64, parallel_mode='row')", 2, r"a norm before a row-parallel GEMM reads whole rows"),
    ("te.TransformerLayer(256, 512, 4, num_gqa_groups=1, set_parallel_mode=True, attn_input_format='thd')", 2,
     r"its 4 query heads and 1 key/value heads must each split over the 2 ranks"),
])
def test_te_modules_parallel_arguments_are_checked(tmp_path, op, table, message):
    from fusegen.errors import SpecError

    spec = f"import transformer_engine.pytorch as te\nblock = te.Sequential({op})\n"
    with pytest.raises(SpecError, match=message):
        _plans(tmp_path, spec, f"[tool.fusegen.pipelines.block]\ntensor_parallel_size = {table}\n")


def test_a_spec_fixing_two_sizes_is_refused_at_the_second(tmp_path):
    from fusegen.errors import SpecError

    spec = ("import transformer_engine.pytorch as te\nblock = te.Sequential(\n"
            "    te.Linear(64, 64, parallel_mode='column', tp_size=2),\n"
            "    te.Linear(64, 64, parallel_mode='row', tp_size=4),\n)\n")
    with pytest.raises(SpecError, match=r"Linear\(\): tp_size=4, but an op before it gives tp_size=2") as info:
        _plans(tmp_path, spec, "")
    assert info.value.location.line == 4


def test_a_several_size_pipeline_claims_its_size_names(tmp_path):
    from fusegen.errors import SpecError

    spec = TP_SPEC + "mlp_tp2 = te.ops.Sequential(te.ops.Linear(64, 64))\n"
    with pytest.raises(SpecError, match="mlp_tp2"):
        _plans(tmp_path, spec, "[tool.fusegen.pipelines.mlp]\ntensor_parallel_size = [2, 4]\n")
    names = [plan.pipeline.name for plan in _plans(tmp_path, TP_SPEC, "[tool.fusegen.pipelines.mlp]\n"
                                                                         "tensor_parallel_size = [4, 2]\n")]
    assert names == ["mlp_tp2", "mlp_tp4"]


def test_attention_ops_that_would_read_different_tokens_are_refused(tmp_path):
    from fusegen.errors import SpecError

    layer = ("    te.TransformerLayer(256, 512, 4, num_gqa_groups=2, attn_input_format='thd', set_parallel_mode=True, "
             "sequence_parallel={}),\n")
    spec = ("import transformer_engine.pytorch as te\nblock = te.Sequential(\n" + layer.format(True) + layer.format(False)
            + ")\n")
    with pytest.raises(SpecError, match=r"TransformerLayer\(\): its attention reads the tokens of 1 rank\(s\), but an "
                                        r"attention before it those of 2"):
        _plans(tmp_path, spec, "[tool.fusegen.pipelines.block]\ntensor_parallel_size = 2\n")
