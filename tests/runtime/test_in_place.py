"""TE's AddExtraInput(in_place=True) (specs/te_in_place.py): the output, every grad and the
caller's residual tensor, which becomes the sum (catalog 2.10), against float64 references from
the residual's values before the call; on CPU and, marked cuda, on a GPU."""

import pytest
import torch
import torch.nn.functional as F

import generated
from references import as64, assert_close_to_reference, randomize_, rms_norm

H = 256


def residual_in_place(p, x, r):
    s = F.linear(x, p["0.weight"], p["0.bias"]) + r
    return s, s


def prenorm_in_place(p, x, r):
    s = x + r
    return rms_norm(s, p["1.weight"]), s


def in_place_mid(p, x, r):
    s = x + p["0.bias"] + r
    return F.gelu(s, approximate="tanh"), s


# class -> (reference returning (y, the residual's new value), whether a GEMM runs)
CASES = {"ResidualInPlace": (residual_in_place, True), "PrenormInPlace": (prenorm_in_place, False),
         "InPlaceMid": (in_place_mid, False)}


def check(cls, dtype, device, lead):
    reference, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    x, r, gy = (torch.randn((*lead, H), generator=gen).to(device, dtype) for _ in range(3))
    r_before = r.clone()
    x.requires_grad_()
    r.requires_grad_()  # a leaf the module changes in place, as TE's op does (it detaches it)
    y = module(x, r)
    assert y.shape == (*lead, H)
    y.backward(gy)

    params = {k: as64(v, device, True) for k, v in module.state_dict().items()}
    x64, r64 = as64(x, device, True), as64(r_before, device, True)
    y64, new_r64 = reference(params, x64, r64)
    y64.backward(gy.to(torch.float64))
    assert_close_to_reference(f"{cls} output", y, y64, dtype, gemm)
    assert_close_to_reference(f"{cls} residual after the call", r, new_r64, dtype, gemm)
    assert not torch.equal(r, r_before)
    assert_close_to_reference(f"{cls} input grad", x.grad, x64.grad, dtype, gemm)
    assert_close_to_reference(f"{cls} residual grad", r.grad, r64.grad, dtype, gemm)
    for key, p in module.named_parameters():
        assert_close_to_reference(f"{cls} grad {key}", p.grad, params[key].grad, dtype, gemm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_cpu(cls, dtype):
    check(cls, dtype, "cpu", (2, 3))


def test_a_non_contiguous_residual_is_updated_through_its_own_strides():
    module = generated.PrenormInPlace(dtype=torch.float64)
    x = torch.randn(4, H, dtype=torch.float64)
    r = torch.randn(H, 4, dtype=torch.float64).t()  # column-major
    want = x + r
    module(x, r)
    assert torch.equal(r, want) and r.stride() == (1, 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", [(1,), (4, 37)], ids=["1 row", "148 rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_gpu(cls, dtype, lead):
    check(cls, dtype, "cuda", lead)


# How the caller's tensors reach the module from their leaves: autograd hands a grad to a leaf
# through these nodes, and may keep it as the leaf's .grad, accumulating the next grad into it in
# place; a grad the module returned for both x and the residual then sums into both leaves.
ROUTES = {
    "clone": lambda x_leaf, r_leaf: (x_leaf.clone(), r_leaf.clone()),
    # leaves one row longer: x a view of its leaf, the residual a slice of a copy (the module
    # writes into it, and a leaf's view may not be written in place)
    "slice": lambda x_leaf, r_leaf: (x_leaf[1:], r_leaf.clone()[1:]),
    "view": lambda x_leaf, r_leaf: (x_leaf.view(-1, H), r_leaf.clone().view(-1, H)),
}


def leaves(route, gen, rows, device="cpu"):
    extra = 1 if route == "slice" else 0
    shape = (rows + extra, H) if route != "view" else (rows * H,)
    return [torch.randn(shape, generator=gen).to(device).requires_grad_() for _ in range(2)]


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def reference_grads(cls, module, calls):
    """float64 grads of x, the residual and each parameter summed over ``calls``, each a
    (x, residual, output grad) of float32 CPU tensors, from the catalog's math alone."""
    reference, _ = CASES[cls]
    params = {k: as64(v, "cpu", True) for k, v in module.state_dict().items()}
    xs, rs = [], []
    for x, r, gy in calls:
        x64, r64 = as64(x, "cpu", True), as64(r, "cpu", True)
        gy = gy.cpu()
        y64, _ = reference(params, x64, r64)
        y64.backward(gy.to(torch.float64))
        xs.append(x64.grad)
        rs.append(r64.grad)
    return sum(xs), sum(rs), {k: p.grad for k, p in params.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("cls", sorted(CASES))
def test_grads_accumulate_over_micro_batches(cls, route, device):
    reference, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device)
    randomize_(module, torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(5)
    x_leaf, r_leaf = leaves(route, gen, 6, device)
    calls = []
    for _ in range(2):  # two micro-batches into the same leaves' .grad
        x, r = ROUTES[route](x_leaf, r_leaf)
        gy = torch.randn(6, H, generator=gen).to(device)
        calls.append((x.detach().reshape(6, H), r.detach().reshape(6, H).clone(), gy))
        module(x, r).backward(gy)
    assert x_leaf.grad.data_ptr() != r_leaf.grad.data_ptr()
    x_grad, r_grad, param_grads = reference_grads(cls, module, calls)
    rows = slice(1, None) if route == "slice" else slice(None)
    assert_close_to_reference(f"{cls} x grad, two micro-batches", x_leaf.grad.reshape(-1, H)[rows], x_grad,
                              torch.float32, gemm)
    assert_close_to_reference(f"{cls} residual grad, two micro-batches", r_leaf.grad.reshape(-1, H)[rows], r_grad,
                              torch.float32, gemm)
    if route == "slice":  # the rows the module never saw get no grad
        assert not x_leaf.grad[0].any() and not r_leaf.grad[0].any()
    for key, p in module.named_parameters():
        assert_close_to_reference(f"{cls} grad {key}, two micro-batches", p.grad, param_grads[key], torch.float32, gemm)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route", ["clone", "view"])
@pytest.mark.parametrize("cls", sorted(CASES))
def test_a_retained_graph_run_backward_twice_gives_twice_the_grads(cls, route, device):
    reference, gemm = CASES[cls]
    module = getattr(generated, cls)(device=device)
    randomize_(module, torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(6)
    x_leaf, r_leaf = leaves(route, gen, 5, device)
    x, r = ROUTES[route](x_leaf, r_leaf)
    gy = torch.randn(5, H, generator=gen).to(device)
    call = (x.detach().reshape(5, H), r.detach().reshape(5, H).clone(), gy)
    y = module(x, r)
    y.backward(gy, retain_graph=True)
    y.backward(gy)
    x_grad, r_grad, param_grads = reference_grads(cls, module, [call, call])
    assert_close_to_reference(f"{cls} x grad, backward twice", x_leaf.grad.reshape(-1, H), x_grad, torch.float32, gemm)
    assert_close_to_reference(f"{cls} residual grad, backward twice", r_leaf.grad.reshape(-1, H), r_grad,
                              torch.float32, gemm)
    for key, p in module.named_parameters():
        assert_close_to_reference(f"{cls} grad {key}, backward twice", p.grad, param_grads[key], torch.float32, gemm)
