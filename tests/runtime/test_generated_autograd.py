"""Autograd contracts of generated modules: a double backward raises instead of returning wrong
second derivatives, and a pipeline that saves nothing for backward still imports and runs."""

import textwrap
from pathlib import Path

import pytest
import torch

import generated
from spec_packages import imported_package
from references import module_names


TINY_SPEC = textwrap.dedent("""\
    from fusegen.eager import Sequential, Bias, LayerNorm, Linear, GELU
    bias_only = Sequential(Bias(7))
    tiny_mlp = Sequential(LayerNorm(4), Linear(4, 6), GELU())
""")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A CPU-only package of small pipelines (no binaries), imported once."""
    with imported_package(tmp_path_factory.mktemp("tiny"), "tiny_spec.py", TINY_SPEC, "tiny_pkg") as pkg:
        yield pkg


def test_double_backward_raises_instead_of_being_wrong(tiny):
    module = tiny.TinyMlp(dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    message = "TinyMlp: second derivatives .* are not supported"
    (grad,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        grad.sum().backward()
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(grad.sum(), x)
    # x also reaching the loss another way must not hide the module's part of the second derivative
    # (torch's once_differentiable alone returns only the x**3 part here: silently wrong).
    (grad,) = torch.autograd.grad(module(x).square().sum() + x.pow(3).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(grad.sum(), x)
    # With respect to a parameter too.
    weight = module.get_submodule("1").weight
    (grad,) = torch.autograd.grad(module(x).square().sum(), weight, create_graph=True)
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(grad.sum(), weight)
    # And gradgradcheck, the check the issue named, fails loudly rather than passing wrong values.
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.gradgradcheck(lambda t: module(t).sum(), (x,))


def test_shipped_modules_guard_their_backward_too():
    module = generated.Gpt2Mlp(dtype=torch.float64)
    x = torch.randn(2, module.in_features, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="Gpt2Mlp: second derivatives"):
        grad.sum().backward()


def test_first_derivatives_stay_available_with_create_graph():
    module = generated.Gpt2Mlp(dtype=torch.float64)
    x = torch.randn(2, module.in_features, dtype=torch.float64, requires_grad=True)
    (with_graph,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    (plain,) = torch.autograd.grad(module(x).sum(), x)
    torch.testing.assert_close(with_graph, plain, rtol=0, atol=0)


def test_pipeline_that_saves_nothing_imports_and_runs(tiny):
    source = Path(tiny.__file__).with_name("bias_only.py").read_text()
    assert "ctx.saved_tensors" not in source and "save_for_backward" not in source
    module = tiny.BiasOnly(dtype=torch.float64)
    with torch.no_grad():
        module.get_submodule("0").bias.copy_(torch.randn(7, dtype=torch.float64))
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 7, dtype=torch.float64)
    y = module(x)
    y.backward(dy)
    torch.testing.assert_close(y, x.detach() + module.get_submodule("0").bias.detach())
    torch.testing.assert_close(x.grad, dy)
    torch.testing.assert_close(module.get_submodule("0").bias.grad, dy.sum(0))
    # create_graph with a constant upstream grad: the grads depend on nothing differentiable, exactly
    # as for PyTorch's own (x + b).sum(); with a differentiable upstream grad the guard raises.
    (grad,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    assert not grad.requires_grad and torch.equal(grad, torch.ones_like(x))
    (grad,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="BiasOnly: second derivatives"):
        torch.autograd.grad(grad.sum(), x)


def test_make_extra_output_in_place_gives_the_values_and_grads_of_out_of_place(tmp_path):
    """TE's MakeExtraOutput(in_place=True) only changes how the grad buffer is accumulated."""
    spec = ("from transformer_engine.pytorch.ops import Bias, GELU, MakeExtraOutput, Sequential\n"
            "a = Sequential(Bias(8), MakeExtraOutput(in_place=True), GELU())\n"
            "b = Sequential(Bias(8), MakeExtraOutput(), GELU())\n")
    with imported_package(tmp_path, "tee_spec.py", spec, "tee_pkg") as pkg:
        x = torch.randn(5, 8, dtype=torch.float64)
        results = []
        for cls in (pkg.A, pkg.B):
            module = cls(dtype=torch.float64)
            with torch.no_grad():
                module.get_submodule("0").bias.copy_(torch.linspace(-1, 1, 8))
            xi = x.clone().requires_grad_()
            y, extra = module(xi)
            (y.sum() + 2 * extra.sum()).backward()
            results.append((y, extra, xi.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


# Pipelines whose backward hands one grad to two inputs: an addend's grad is the sum's, as it is
# (the incoming grad), a kernel's result, or a view of either.
ADDEND_SPEC = textwrap.dedent("""\
    from fusegen.eager import Sequential, AddExtraInput, ConstantScale, GELU, Reshape, RMSNorm
    add_only = Sequential(AddExtraInput())
    add_then_scale = Sequential(AddExtraInput(), ConstantScale(2.0))
    gelu_then_add = Sequential(GELU(), AddExtraInput())
    add_then_norm = Sequential(AddExtraInput(), RMSNorm(8))
    reshape_then_add = Sequential(Reshape((-1, 4)), AddExtraInput(), GELU(), Reshape((-1, 8)))
""")


@pytest.fixture(scope="module")
def addends(tmp_path_factory):
    with imported_package(tmp_path_factory.mktemp("addends"), "addend_spec.py", ADDEND_SPEC, "addend_pkg") as pkg:
        yield pkg


def small_shipped_modules():
    """The shipped modules small enough to run on CPU in a test (TeMlp's weights are 1.4 GB)."""
    names = []
    for name in module_names(generated):  # (one process: not those built for a tensor-parallel group)
        if sum(p.numel() for p in getattr(generated, name)(device="meta").parameters()) < 1 << 22:
            names.append(name)
    return names


def grads_have_their_own_memory(module, inputs):
    """Runs the module's forward and backward on inputs reached from their leaves through
    ``.clone()`` and a view (autograd may keep a view of a returned grad as the leaf's .grad, and
    a later backward accumulates into it in place), and asserts that no two leaves' grads (inputs
    and parameters) share memory: no byte of one is a byte of another. TE's row blocks
    (query_weight, key_weight, value_weight) get disjoint slices of their joined weight's one grad,
    as TE's noop_cat hands them (module/_common.py): one storage, no byte shared, so each
    accumulates into its own."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    outputs = module(*(leaf.clone().view(leaf.shape) for leaf in leaves))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    # a loss whose grads reach the module as tensors nothing else holds (autograd may keep those)
    sum((o * torch.randn_like(o)).sum() for o in outputs).backward()
    grads = [(f"input {i}", leaf.grad) for i, leaf in enumerate(leaves)]
    grads += [(name, p.grad) for name, p in module.named_parameters()]
    assert all(grad is not None for _, grad in grads)
    assert all(g.is_contiguous() for _, g in grads)  # then its bytes are one span from data_ptr
    spans = sorted((g.data_ptr(), g.numel() * g.element_size(), name) for name, g in grads)
    for (start, size, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        assert start + size <= next_start, f"{type(module).__name__}: the grads of {name} and {next_name} share memory"


@pytest.mark.parametrize("name", ["AddOnly", "AddThenScale", "GeluThenAdd", "AddThenNorm", "ReshapeThenAdd"])
def test_an_addends_grad_is_its_own_memory(addends, name):
    module = getattr(addends, name)()
    gen = torch.Generator().manual_seed(0)
    addend = (12, 4) if name == "ReshapeThenAdd" else (6, 8)  # the residual joins after the Reshape
    grads_have_their_own_memory(module, [torch.randn(6, 8, generator=gen), torch.randn(addend, generator=gen)])


@pytest.mark.parametrize("name", small_shipped_modules())
def test_every_shipped_backward_returns_grads_of_their_own_memory(name):
    from references import module_inputs

    module = getattr(generated, name)()
    grads_have_their_own_memory(module, module_inputs(module, 5, torch.Generator().manual_seed(1), device="cpu"))
