"""torch.nn modules with a te.ops equivalent map to the op and fuse: a generated module loads the
state_dict of the real torch.nn.Sequential and matches it, in float64, outputs and all grads."""

import pytest
import torch

from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from spec_packages import imported_package

SPEC = """\
import torch
from torch import nn
import transformer_engine.pytorch as te

te_style = te.ops.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16, False))
torch_style = nn.Sequential(nn.RMSNorm((16,), eps=1e-6), nn.Linear(16, 16), nn.SiLU(), nn.Identity(), nn.ReLU(inplace=True))
"""


def torch_modules():
    nn = torch.nn
    return {
        "TeStyle": nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(approximate="tanh"),
                                 nn.Linear(32, 16, False)),
        "TorchStyle": nn.Sequential(nn.RMSNorm((16,), eps=1e-6), nn.Linear(16, 16), nn.SiLU(), nn.Identity(),
                                    nn.ReLU()),
    }


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    with imported_package(tmp_path_factory.mktemp("nn"), "nn_spec.py", SPEC, "nn_pkg") as pkg:
        yield pkg


@pytest.mark.parametrize("name", sorted(torch_modules()))
def test_generated_module_matches_torch_nn_with_its_state_dict(pkg, name):
    torch.manual_seed(0)
    reference = torch_modules()[name].double()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))
    generated = getattr(pkg, name)(dtype=torch.float64)
    assert list(generated.state_dict()) == list(reference.state_dict())
    generated.load_state_dict(reference.state_dict())
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, want = generated(xg), reference(xr)
    torch.testing.assert_close(y, want)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(xg.grad, xr.grad)
    for (key, p), q in zip(generated.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=key)


@pytest.mark.parametrize("call, message", [
    ("nn.GELU()", "nn.GELU(): approximate='none' is the exact GELU; fusegen's GELU is TE's tanh approximation"),
    ("nn.RMSNorm(16)", "nn.RMSNorm(): eps=None, torch's default, is the input dtype's machine epsilon"),
    ("nn.RMSNorm(16, None)", "nn.RMSNorm(): eps=None, torch's default, is the input dtype's machine epsilon"),
    ("nn.LayerNorm(16, elementwise_affine=False)", "a LayerNorm without its affine parameters has no te.ops"),
    ("nn.LayerNorm(16, bias=False)", "a LayerNorm without its affine parameters has no te.ops"),
])
def test_torch_nn_modules_without_an_equivalent_say_why(call, message):
    with pytest.raises(SpecError) as info:
        parse_spec(f"from torch import nn\nm = nn.Sequential(nn.Linear(16, 16), {call})\n", "spec.py")
    assert message in info.value.message and info.value.location.line == 2


def test_other_torch_nn_modules_run_as_they_are():
    """As TE's Sequential runs a module it cannot fuse (stages/module.py)."""
    (spec,) = parse_spec("from torch import nn\nm = nn.Sequential(nn.Linear(16, 16), nn.Softmax(dim=-1))\n", "spec.py")
    assert spec.calls[1].op == "Module"
    assert spec.calls[1].args["target"] == "torch.nn.Softmax" and spec.calls[1].args["keywords"] == (("dim", -1),)


@pytest.mark.parametrize("call, value", [("nn.Dropout(-0.5)", "-0.5"), ("nn.Dropout(1.5)", "1.5"),
                                         ("nn.Dropout(p=1.0000001)", "1.0000001"),
                                         ("nn.Dropout(inplace=True, p=-1e-9)", "-1e-9")])
def test_torch_nn_dropout_takes_only_a_probability(call, value):
    """torch.nn.Dropout refuses p outside [0, 1] as te.ops' Dropout does; accepted, it scaled the
    kept values by 1 / (1 - p) (negative for p > 1) or dropped everything (issue 36)."""
    line = f"m = nn.Sequential(nn.Linear(16, 16), {call})"
    with pytest.raises(SpecError) as info:
        parse_spec(f"from torch import nn\n{line}\n", "spec.py")
    assert info.value.message == f"argument 'p' of nn.Dropout must be a probability, from 0 to 1, got {float(value)!r}"
    assert (info.value.location.line, info.value.location.col) == (2, line.index(value) + 1)  # at the value of p


@pytest.mark.parametrize("p", ["0.0", "0.5", "1.0", "1"])
def test_torch_nn_dropout_takes_the_probabilities_torch_takes(p):
    (spec,) = parse_spec(f"from torch import nn\nm = nn.Sequential(nn.Linear(16, 16), nn.Dropout({p}))\n", "spec.py")
    assert spec.calls[1].op == "nn.Dropout" and spec.calls[1].args["p"] == float(p)


def test_a_containers_basic_ops_check_their_own_arguments(monkeypatch):
    """Where a torch.nn spelling's signature leaves a check out, the op it expands to still holds
    its own: nn.Dropout without its check on p fails as Dropout does, at the argument."""
    from dataclasses import replace

    from fusegen.ops import OPS

    unchecked = OPS["nn.Dropout"]
    unchecked = replace(unchecked, args=tuple(replace(a, check=None) for a in unchecked.args))
    monkeypatch.setitem(OPS, "nn.Dropout", unchecked)
    line = "m = nn.Sequential(nn.Linear(16, 16), nn.Dropout(1.5))"
    with pytest.raises(SpecError) as info:
        parse_spec(f"from torch import nn\n{line}\n", "spec.py")
    assert info.value.message == "nn.Dropout(): argument 'p' of Dropout must be a probability, from 0 to 1, got 1.5"
    assert (info.value.location.line, info.value.location.col) == (2, line.index("1.5") + 1)
