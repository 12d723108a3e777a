"""TE's Linear options: accumulate_into_main_grad (the weight gradient goes into weight.main_grad,
Megatron's way) and its parallelism arguments, accepted at their defaults and refused otherwise."""

import pytest
import torch
import torch.nn.functional as F

from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from fusegen.pipeline import build_pipeline
from spec_packages import imported_package

SPEC = """\
import transformer_engine.pytorch as te
main_grad_mlp = te.ops.Sequential(
    te.ops.Linear(8, 6, accumulate_into_main_grad=True, tensor_parallel_mode=None, sequence_parallel=False),
    te.ops.GELU(),
    te.ops.BasicLinear(6, 4, accumulate_into_main_grad=True),
)
"""


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    with imported_package(tmp_path_factory.mktemp("main_grad"), "main_grad_spec.py", SPEC, "main_grad_pkg") as pkg:
        yield pkg


def reference_grads(module, x, gy):
    p = {k: v.detach().clone().requires_grad_() for k, v in module.state_dict().items()}
    x = x.detach().clone().requires_grad_()
    y = F.linear(F.gelu(F.linear(x, p["0.weight"], p["0.bias"]), approximate="tanh"), p["2.weight"])
    y.backward(gy)
    return p, x.grad


def test_weight_gradients_accumulate_into_main_grad(pkg):
    module = pkg.MainGradMlp(dtype=torch.float64)
    w0, b0, w2 = module.get_submodule("0").weight, module.get_submodule("0").bias, module.get_submodule("2").weight
    for w in (w0, w2):
        w.main_grad = torch.zeros_like(w)
    w0.grad_added_to_main_grad = False  # Megatron's flag: the module sets it and hands autograd a placeholder
    x, gy = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    ref, ref_dx = reference_grads(module, x, gy)
    for step in (1, 2):  # two backward passes: main_grad holds their sum
        xi = x.clone().requires_grad_()
        module(xi).backward(gy)
        torch.testing.assert_close(xi.grad, ref_dx)
        torch.testing.assert_close(w0.main_grad, step * ref["0.weight"].grad)
        torch.testing.assert_close(w2.main_grad, step * ref["2.weight"].grad)
    assert w0.grad_added_to_main_grad is True and w0.grad is not None and w0.grad.shape == w0.shape
    assert w2.grad is None  # no flag: autograd gets no weight gradient at all
    torch.testing.assert_close(b0.grad, 2 * ref["0.bias"].grad)  # the bias is an ordinary parameter


def test_a_frozen_weight_gets_no_gradient_in_main_grad_or_grad(pkg):
    module = pkg.MainGradMlp(dtype=torch.float64)
    w0, b0, w2 = module.get_submodule("0").weight, module.get_submodule("0").bias, module.get_submodule("2").weight
    for w in (w0, w2):
        w.main_grad = torch.zeros_like(w)
    w0.grad_added_to_main_grad = False
    w0.requires_grad_(False)  # frozen (fine-tuning the rest): eager computes no grad for it
    x, gy = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    ref, ref_dx = reference_grads(module, x, gy)
    xi = x.clone().requires_grad_()
    module(xi).backward(gy)
    assert not w0.main_grad.any() and w0.grad is None and w0.grad_added_to_main_grad is False
    torch.testing.assert_close(xi.grad, ref_dx)
    torch.testing.assert_close(w2.main_grad, ref["2.weight"].grad)  # the weight still trained gets its own
    torch.testing.assert_close(b0.grad, ref["0.bias"].grad)
    # every parameter frozen, and x too: a forward under autograd with nothing to differentiate
    module.requires_grad_(False)
    assert not module(x).requires_grad
    # the last weight alone trained, x not
    w2.requires_grad_(True)
    module(x).backward(gy)
    assert not w0.main_grad.any() and w0.grad is None
    torch.testing.assert_close(w2.main_grad, 2 * ref["2.weight"].grad)


def test_a_missing_main_grad_is_a_clear_error(pkg):
    module = pkg.MainGradMlp(dtype=torch.float64)
    y = module(torch.randn(2, 8, dtype=torch.float64, requires_grad=True))
    with pytest.raises(RuntimeError, match="accumulate_into_main_grad=True adds its weight gradient into "
                                           "weight.main_grad, but the weight has no main_grad"):
        y.sum().backward()


@pytest.mark.parametrize("call, message", [
    ("Linear(8, 4, tensor_parallel_mode='diagonal')", "argument 'tensor_parallel_mode' of Linear must be None, "
                                                      '"column" (the output features split over the group) or "row"'),
    ("BasicLinear(8, 4, userbuffers_options='qkv')",
     "argument 'userbuffers_options' of BasicLinear must be left at its default"),
    ("Linear(8, 4, rng_state_tracker_function='tracker')", "must be None: fusegen initialises parameters"),
    ("AllGather(tp_group, size=2)", "argument 'size' of AllGather is the tensor-parallel size the pipeline is built for"),
])
def test_parallel_arguments_fusegen_does_not_take_are_refused(call, message):
    with pytest.raises(SpecError) as info:
        parse_spec(f"import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.{call})\n", "spec.py")
    assert message in info.value.message


def test_parallel_arguments_at_their_defaults_change_nothing():
    text = ("import transformer_engine.pytorch as te\nm = te.ops.Sequential(te.ops.Linear(8, 4, tensor_parallel_mode=None, "
            "tensor_parallel_group=None, sequence_parallel=False, userbuffers_options=None), te.ops.Bias(4, "
            "tensor_parallel=False))\n")
    (spec,) = parse_spec(text, "spec.py")
    assert [op.describe() for op in build_pipeline(spec).ops] == ["BasicLinear(8, 4)", "Bias(4)", "Bias(4)"]
