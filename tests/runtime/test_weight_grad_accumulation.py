"""A Linear's weight grad added into ``weight.grad`` by its own GEMM (``ref.weight_grad``): where
autograd would add the new grad into one already there, the wgrad GEMM does it (beta = 1) and
autograd takes the sum back as it is. What a user sees must be what autograd's own accumulation
gives: the float64 reference's sum, in the grad's memory, and the plain increment wherever
something looks at it (a hook on the weight, torch.autograd.grad, backward(inputs=...))."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import generated
from references import assert_close_to_reference, gpt2_mlp, randomize_


def _module(device="cpu", dtype=torch.float32):
    module = generated.Gpt2Mlp(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    return module


def _inputs(count, rows=5, device="cpu", dtype=torch.float32, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 1024, generator=gen, dtype=torch.float64).to(device, dtype),
             torch.randn(rows, 1024, generator=gen, dtype=torch.float64).to(device, dtype))
            for _ in range(count)]


def _reference_grads(module, batches):
    """float64 grads of the sum over ``batches`` of <module(x), gy>, from the independent
    reference (torch.nn.functional and autograd)."""
    p = {k: v.detach().to("cpu", torch.float64).requires_grad_() for k, v in module.state_dict().items()}
    for x, gy in batches:
        y, = gpt2_mlp(p, x.detach().to("cpu", torch.float64))
        y.backward(gy.to("cpu", torch.float64))
    return {k: v.grad for k, v in p.items()}


def _weights(module):
    return module.get_submodule("1").weight, module.get_submodule("3").weight


def test_grads_of_several_backward_passes_add_up_in_the_same_memory():
    module = _module()
    batches = _inputs(3)
    x, gy = batches[0]
    module(x).backward(gy)  # the first pass: autograd takes the grads as they are
    memory = {k: p.grad.data_ptr() for k, p in module.named_parameters()}
    for x, gy in batches[1:]:  # later passes add into them
        module(x).backward(gy)
    ref = _reference_grads(module, batches)
    for key, p in module.named_parameters():
        assert_close_to_reference(key, p.grad, ref[key], torch.float32)
        assert p.grad.data_ptr() == memory[key], f"{key}: the grad moved to new memory"


class _WeightSizedOps(TorchDispatchMode):
    """Records the ops that write a tensor of a Linear weight's shape."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.ops = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.ops.append(str(func.overloadpacket.__name__))
        return out


def test_the_gemm_adds_into_the_grad_with_no_separate_add():
    module = _module()
    (x0, g0), (x1, g1) = _inputs(2)
    module(x0).backward(g0)
    shapes = {tuple(w.shape) for w in _weights(module)}
    with _WeightSizedOps(shapes) as ops:
        module(x1).backward(g1)
    computed = [op for op in ops.ops if op not in ("t", "view", "detach", "alias")]
    assert computed == ["addmm_", "addmm_"], ops.ops  # no mm into a temporary, no add_ after it


def test_two_calls_before_one_backward_add_both_and_the_old_grad():
    module = _module()
    (xa, ga), (xb, gb), (x0, g0) = _inputs(3)
    module(x0).backward(g0)
    (module(xa) * ga + module(xb) * gb).sum().backward()
    ref = _reference_grads(module, [(x0, g0), (xa, ga), (xb, gb)])
    for key, p in module.named_parameters():
        assert_close_to_reference(key, p.grad, ref[key], torch.float32)


def test_a_hook_on_the_weight_sees_the_increment_not_the_sum():
    module = _module()
    (x0, g0), (x1, g1) = _inputs(2)
    module(x0).backward(g0)
    seen = []
    weight = module.get_submodule("1").weight
    weight.register_hook(lambda g: seen.append(g.clone()))
    module(x1).backward(g1)
    assert len(seen) == 1
    increment = _reference_grads(module, [(x1, g1)])["1.weight"]
    assert_close_to_reference("hooked increment", seen[0], increment, torch.float32)
    assert_close_to_reference("1.weight", weight.grad, _reference_grads(module, [(x0, g0), (x1, g1)])["1.weight"],
                              torch.float32)


def test_autograd_grad_and_backward_inputs_leave_the_weight_grads_alone():
    module = _module()
    (x0, g0), (x1, g1) = _inputs(2)
    module(x0).backward(g0)
    before = {k: p.grad.clone() for k, p in module.named_parameters()}
    x = x1.clone().requires_grad_()
    dx, = torch.autograd.grad(module(x), [x], g1)
    module(x).backward(g1, inputs=[x])
    for key, p in module.named_parameters():
        assert torch.equal(p.grad, before[key]), f"{key} changed"
    assert torch.equal(x.grad, dx)
    # backward(inputs=...) naming one weight: that weight's grad accumulates, the others' do not
    w1, w3 = _weights(module)
    module(x1).backward(g1, inputs=[w3])
    assert torch.equal(w1.grad, before["1.weight"])
    assert_close_to_reference("3.weight", w3.grad, _reference_grads(module, [(x0, g0), (x1, g1)])["3.weight"],
                              torch.float32)


def test_a_grad_that_is_a_view_accumulates_in_place_in_its_buffer():
    """DDP's gradient_as_bucket_view: the grads are views into one flat buffer, which must hold
    the sum afterwards."""
    module = _module()
    (x0, g0), (x1, g1) = _inputs(2)
    params = list(module.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    start = 0
    for p in params:
        p.grad = flat[start:start + p.numel()].view_as(p)
        start += p.numel()
    module(x0).backward(g0)
    module(x1).backward(g1)
    ref = _reference_grads(module, [(x0, g0), (x1, g1)])
    start = 0
    for (key, p) in module.named_parameters():
        assert p.grad._base is flat, f"{key}: no longer a view of the buffer"
        assert_close_to_reference(key, flat[start:start + p.numel()].view_as(p), ref[key], torch.float32)
        start += p.numel()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_accumulates_the_same_values():
    module = _module()
    (x0, g0), (x1, g1) = _inputs(2)
    module(x0).backward(g0)
    module(x1).backward(g1, create_graph=True)
    for p in module.parameters():  # (the grads refer to their graph: break that cycle)
        p.grad = p.grad.detach()
    ref = _reference_grads(module, [(x0, g0), (x1, g1)])
    for key, p in module.named_parameters():
        assert_close_to_reference(key, p.grad, ref[key], torch.float32)


def test_a_frozen_weight_gets_no_grad_and_the_rest_accumulate():
    module = _module()
    w1, _ = _weights(module)
    w1.requires_grad_(False)
    batches = _inputs(2)
    for x, gy in batches:
        module(x).backward(gy)
    assert w1.grad is None
    ref = _reference_grads(module, batches)
    for key, p in module.named_parameters():
        if key != "1.weight":
            assert_close_to_reference(key, p.grad, ref[key], torch.float32)


def _step_peak(module, x, gy):
    """Bytes a forward + backward allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    module(x).backward(gy)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grads_of_several_backward_passes_add_up_on_cuda(dtype):
    """At a few rows (steps replayed from CUDA graphs) and at many: the sums are the reference's,
    in the grads' own memory, and a step allocates no weight-sized temporary, where the same module
    with hooks on its weights (autograd's own add) does."""
    for rows in (4, 300):
        folded, plain = _module("cuda", dtype), _module("cuda", dtype)
        for w in _weights(plain):
            w.register_hook(lambda g: g)
        batches = _inputs(6, rows, "cuda", dtype)
        for x, gy in batches[:4]:  # the later steps replay graphs (captured on steps 2 and 3)
            folded(x).backward(gy)
            plain(x).backward(gy)
        memory = {k: p.grad.data_ptr() for k, p in folded.named_parameters()}
        peaks = [(_step_peak(folded, x, gy), _step_peak(plain, x, gy)) for x, gy in batches[4:]]
        weight_bytes = 1024 * 4096 * dtype.itemsize
        for folded_peak, plain_peak in peaks:
            assert plain_peak - folded_peak >= weight_bytes, (rows, folded_peak, plain_peak)
        ref = _reference_grads(folded, batches)
        for key, p in folded.named_parameters():
            assert_close_to_reference(f"{key} ({rows} rows)", p.grad, ref[key], dtype)
            assert_close_to_reference(f"{key} ({rows} rows, hooked)", plain.get_parameter(key).grad,
                                      ref[key], dtype)
            assert p.grad.data_ptr() == memory[key], f"{key}: the grad moved to new memory"


def test_hooked_weights_accumulate_the_same_sums():
    """Weights with hooks (autograd's own add) and without (the GEMM's): both hold the sum."""
    plain, folded = _module(), _module()
    plain.get_submodule("1").weight.register_hook(lambda g: g)
    plain.get_submodule("3").weight.register_hook(lambda g: g)
    batches = _inputs(3)
    for x, gy in batches:
        plain(x).backward(gy)
        folded(x).backward(gy)
    ref = _reference_grads(folded, batches)
    for (key, a), b in zip(plain.named_parameters(), folded.parameters()):
        assert_close_to_reference(f"{key} hooked", a.grad, ref[key], torch.float32)
        assert_close_to_reference(key, b.grad, ref[key], torch.float32)


def test_a_plain_linear_layer_next_to_it_is_unaffected():
    """Only the generated module's own weights: a torch Linear sharing the autograd graph keeps
    autograd's own accumulation."""
    module, layer = _module(), torch.nn.Linear(1024, 1024)
    batches = _inputs(2)
    for x, gy in batches:
        module(layer(x)).backward(gy)
    p = {k: v.detach().double().requires_grad_() for k, v in module.state_dict().items()}
    w, b = (t.detach().double().requires_grad_() for t in (layer.weight, layer.bias))
    for x, gy in batches:
        gpt2_mlp(p, F.linear(x.double(), w, b))[0].backward(gy.double())
    assert_close_to_reference("layer.weight", layer.weight.grad, w.grad, torch.float32)
    for key, q in module.named_parameters():
        assert_close_to_reference(key, q.grad, p[key].grad, torch.float32)
