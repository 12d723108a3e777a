"""torch.nn modules with a te.ops equivalent map to the op and fuse: a generated module loads the
state_dict of the real torch.nn.Sequential and matches it, in float64, outputs and all grads."""

import importlib
import sys

import pytest
import torch

from fusegen import build, output
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec

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
    folder = tmp_path_factory.mktemp("nn")
    (folder / "nn_spec.py").write_text(SPEC)
    config = build.Config((folder / "nn_spec.py",), folder / "nn_pkg", archs=(), dtypes=("float32",), root=folder)
    output.write_package(build.build_package(config), config.out)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("nn_pkg")
    finally:
        sys.path.remove(str(folder))


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
    ("nn.RMSNorm(16)", "nn.RMSNorm() missing required argument 'eps'"),
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
