"""The launch path on a GPU (templates/runtime/launch.py): work goes on PyTorch's current stream, loading
is lazy and thread-safe, launches from several threads at once get their own argument buffers,
the forward + backward of every shipped pipeline can be captured in a CUDA graph and replayed on
new inputs, and devices each get their own loaded functions. On CPU: what the launch path
rejects without a GPU."""

import inspect
import threading

import pytest
import torch

import generated
import references as R
from generated import _kernels, _runtime
from generated._runtime import launch, loading

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _module(name, dtype=torch.float32, device="cuda"):
    """A shipped module by its pipeline name (references.PIPELINES) or its class name."""
    module = getattr(generated, R.PIPELINES[name][0] if name in R.PIPELINES else name)(device=device, dtype=dtype)
    R.randomize_(module, torch.Generator().manual_seed(7))
    return module


_inputs = R.module_inputs


def _forward_backward(module, inputs, grads):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    for p in module.parameters():
        p.grad = None
    outputs = module(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grads)
    return [o.detach() for o in outputs] + [t.grad for t in inputs] + [p.grad for p in module.parameters()]


def test_an_int_that_does_not_fit_is_a_clear_error_before_anything_loads(monkeypatch):
    kernel = _runtime.Kernel("probe", "pi")
    ready = launch._Ready(("probe", torch.float32, 0), "probe_fp32", None, 0, "pi", 0)
    monkeypatch.setattr(kernel, "_ready", {(torch.float32, 0): ready})
    with pytest.raises(ValueError, match=r"kernel probe_fp32: arguments \(0, 2147483648\) do not fit its parameters"):
        kernel.launch(torch.float32, (1, 1, 1), (1, 1, 1), (0, 2**31), 0)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("name", ["prenorm_block", "gpt2_mlp"])
def test_kernels_run_on_the_current_stream(name):
    """On a side stream made to lag (a sleep), the module's kernels must wait for the op before
    them on that stream: on another stream they would read their input before it is written."""
    module = _module(name)
    gen = torch.Generator().manual_seed(1)
    inputs = _inputs(module, 64, gen)
    want = module(*[t * 2 for t in inputs])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of ms of device time before the inputs are doubled
        doubled = [t * 2 for t in inputs]
        got = module(*doubled)
    side.synchronize()
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        assert torch.equal(g, w)


@pytest.mark.cuda
@needs_gpu
def test_threads_load_and_launch_at_once():
    """Eight threads run the same module at once, on kernels no thread has loaded yet (the
    caches are emptied first): each gets the single-threaded result, bit for bit."""
    module = _module("gpt2_mlp")
    gen = torch.Generator().manual_seed(2)
    per_thread = [_inputs(module, 33, gen)[0] for _ in range(8)]
    want = [module(x) for x in per_thread]
    torch.cuda.synchronize()
    with loading._LOCK:
        loading._FUNCTIONS.clear()
        loading._LIBRARIES.clear()
    for value in vars(_kernels).values():
        if isinstance(value, _runtime.Kernel):
            value._ready.clear()
    barrier, results, errors = threading.Barrier(8), [None] * 8, []

    def run(i):
        try:
            barrier.wait()
            for _ in range(5):
                results[i] = module(per_thread[i])
            torch.cuda.current_stream().synchronize()
        except BaseException as error:  # reported below, with the thread's index
            errors.append((i, error))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    for got, expected in zip(results, want):
        assert torch.equal(got, expected)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("name", R.module_names(generated))
def test_cuda_graph_of_forward_backward_replays_on_new_inputs(name):
    """Every shipped module: capture forward + backward once, copy new inputs into the static
    ones, replay: every output and grad equals an eager run on those inputs (fp32, where cuBLAS
    under capture may pick another GEMM algorithm: within the GEMM tolerance row) and two replays
    are identical. In eval mode (a Dropout's keys advance with every replay, as they should)."""
    module = _module(name).eval()
    gen = torch.Generator().manual_seed(3)
    static = [t.requires_grad_() for t in _inputs(module, 48, gen)]
    with torch.no_grad():  # the output shapes (no autograd graph may outlive a step: its
        probe = module(*static)  # AccumulateGrad nodes would keep the stream they were made on)
    grads = [torch.randn(o.shape, generator=gen).cuda() for o in (probe if isinstance(probe, tuple) else (probe,))]
    del probe
    for p in module.parameters():
        p.grad = torch.zeros_like(p)

    def step():
        outputs = module(*static)
        torch.autograd.backward(outputs if isinstance(outputs, tuple) else (outputs,), grads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: loads every kernel outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in static:
        t.grad = None
    if "packed_sequences" in inspect.getsource(type(module)):
        # attention in fp32 runs its reference math per sequence, reading the offsets on the host:
        # a capture is refused with a message before anything is copied (bf16/fp16 run FA2)
        with pytest.raises(RuntimeError, match="which a CUDA graph cannot capture"):
            with torch.cuda.graph(graph):
                module(*static)
        return
    with torch.cuda.graph(graph):
        outputs = module(*static)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, grads)

    fresh = _inputs(module, 48, gen)

    def replay():
        with torch.no_grad():  # every replay from the same inputs (an in-place residual is overwritten)
            for s, f in zip(static, fresh):
                s.copy_(f)
        for p in module.parameters():
            p.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        return ([o.detach().clone() for o in outputs] + [t.grad.clone() for t in static]
                + [p.grad.clone() for p in module.parameters()])

    first, second = replay(), replay()
    eager = _forward_backward(module, fresh, grads)
    for i, (a, b, e) in enumerate(zip(first, second, eager)):
        assert torch.equal(a, b), f"{name}: two replays differ in tensor {i}"
        R.assert_close_to_reference(f"{name} replayed tensor {i}", a, e.double(), torch.float32)


@pytest.mark.cuda
@needs_gpu
def test_cuda_graph_in_training_mode_draws_new_dropout_masks_each_replay():
    """Dropout(0.25) (dropout_any) in training mode, forward + backward captured once: each replay
    draws a new mask (the key comes from PyTorch's generator, which a graph advances per replay),
    and within a replay the backward applies the forward's mask: y = x m / 0.75, dx = dy m / 0.75."""
    module = _module("DropoutAny").train()
    gen = torch.Generator().manual_seed(21)
    static = torch.randn(64, 256, generator=gen).cuda().requires_grad_()
    dy = torch.randn(64, 256, generator=gen).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        for _ in range(2):
            module(static).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    static.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = module(static)
        y.backward(dy)
    masks = []
    for _ in range(3):
        x = torch.randn(64, 256, generator=gen).cuda()
        with torch.no_grad():
            static.copy_(x)
        static.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        kept = y != 0
        masks.append(kept.clone())
        torch.testing.assert_close(y, torch.where(kept, x / 0.75, 0.0), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(static.grad, torch.where(kept, dy / 0.75, 0.0), rtol=1e-6, atol=1e-6)
        assert 0.15 < 1 - kept.float().mean().item() < 0.35
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_devices_each_get_their_own_functions():
    """The same module on cuda:0 and cuda:1, called alternately from one thread (whichever device
    is current): each device's kernels are loaded for it and give the same results."""
    gen = torch.Generator().manual_seed(4)
    x = _inputs(_module("prenorm_block", device="cpu"), 40, gen, device="cpu")
    results, grads = [], []
    for index in (0, 1):
        module = _module("prenorm_block", device=f"cuda:{index}")
        inputs = [t.to(f"cuda:{index}").requires_grad_() for t in x]
        with torch.cuda.device(1 - index):  # the other device current: the launch must not care
            outputs = module(*inputs)
            results.append([t.detach().cpu() for t in outputs])
            # the backward too: its grids are sized from each device's own occupancy
            got = torch.autograd.grad(sum(t.sum() for t in outputs), [*inputs, *module.parameters()])
            grads.append([g.cpu() for g in got])
    assert {index for (_, index) in loading._FUNCTIONS} >= {0, 1}
    for a, b in zip(*results):
        assert torch.equal(a, b)
    for a, b in zip(*grads):  # the same GPU model twice: the same grids, the same sums
        assert torch.equal(a, b)
    # no-grad calls: with the module's own device current they replay graphs (one per device),
    # with the other one current they run plain; every result is the same (within the GEMM row:
    # cuBLAS under capture may pick another algorithm)
    replays = []
    for index in (0, 1):
        module = _module("prenorm_block", device=f"cuda:{index}")
        inputs = [t.to(f"cuda:{index}") for t in x]
        for current in (index, 1 - index, index, index, 1 - index):
            with torch.cuda.device(current), torch.no_grad():
                replays.append([t.cpu() for t in module(*inputs)])
        assert module.cuda_graphs.captured == 1
    for k, got in enumerate(replays):
        for a, b in zip(got, results[0]):
            R.assert_close_to_reference(f"no-grad call {k}", a, b.double(), torch.float32)
    # training steps likewise: each device replays its own forward and backward graphs
    for index in (0, 1):
        module = _module("prenorm_block", device=f"cuda:{index}")
        inputs = [t.to(f"cuda:{index}").requires_grad_() for t in x]
        for current in (index, 1 - index, index, index, 1 - index):
            with torch.cuda.device(current):
                outputs = module(*inputs)
                got = torch.autograd.grad(sum(t.sum() for t in outputs), [*inputs, *module.parameters()])
            for k, (a, b) in enumerate(zip([t.detach().cpu() for t in outputs] + [g.cpu() for g in got],
                                           results[0] + grads[0])):
                R.assert_close_to_reference(f"training step on cuda:{index}, tensor {k}", a, b.double(), torch.float32)
        assert module.cuda_graphs.captured == 1 and module.cuda_graphs.failed is None
