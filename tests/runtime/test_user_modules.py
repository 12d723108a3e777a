"""Modules of the user's code between fusible ops (ops/module.py, stages/module.py): the generated
module constructs the user's class with the spec's literal arguments, owns its parameters under the
Sequential's index (as the eager Sequential), runs it as it is on the tensor with its leading dims,
and fuses the groups around it. Output, input grad and every parameter grad (the user module's
included) against float64 references; clear errors for a module that changes the shape, a class
that cannot be imported, and arguments fusegen cannot read. On CPU and, marked cuda, on a GPU."""

import importlib
import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusegen import build, output
from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from references import assert_close_to_reference, randomize_

LAYERS = textwrap.dedent('''\
    import torch


    class Mixer(torch.nn.Module):
        """Mixes tokens along the sequence dim (it needs the leading dims), with a learned gate."""

        def __init__(self, features, scale=0.5):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.linspace(-1, 1, features))
            self.scale = scale

        def forward(self, x):
            return x + torch.tanh(x.cumsum(dim=-2) * self.scale) * self.gate


    class Pool(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=-1, keepdim=True)
''')
# The kernels around the module are ones the shipped package has (specs/te_gemm_epilogues.py), so
# the GPU test can run them.
SPEC = textwrap.dedent('''\
    import torch
    import transformer_engine.pytorch as te
    from user_layers import Mixer, Pool

    mixer_block = te.ops.Sequential(
        te.ops.Linear(256, 256), te.ops.ConstantScale(2.0), te.ops.GELU(),
        Mixer(256, scale=0.25),
        te.ops.Linear(256, 256), te.ops.ConstantScale(2.0), te.ops.GELU(),
    )
    pooled = te.ops.Sequential(te.ops.Linear(256, 256), Pool())
    missing = te.ops.Sequential(te.ops.Linear(256, 256), Pool())
    softmax_head = te.ops.Sequential(te.ops.Linear(256, 256), torch.nn.Softmax(dim=-1))
''')


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_modules")
    (folder / "user_layers.py").write_text(LAYERS)
    (folder / "spec.py").write_text(SPEC)
    config = build.Config((folder / "spec.py",), folder / "user_pkg", archs=(), dtypes=("bfloat16", "float32"),
                          root=folder)
    output.write_package(build.build_package(config), config.out)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("user_pkg")
    finally:
        sys.path.remove(str(folder))


def reference(p, x):
    h = F.gelu(F.linear(x, p["0.weight"], p["0.bias"]) * 2.0, approximate="tanh")
    h = h + torch.tanh(h.cumsum(dim=-2) * 0.25) * p["3.gate"]  # Mixer(256, scale=0.25), along the sequence
    return F.gelu(F.linear(h, p["4.weight"], p["4.bias"]) * 2.0, approximate="tanh")


def check(pkg, dtype, device):
    module = pkg.MixerBlock(device=device, dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    assert sorted(module.state_dict()) == ["0.bias", "0.weight", "3.gate", "4.bias", "4.weight"]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 256, generator=gen).to(device, dtype).requires_grad_()
    y = module(x)
    gy = torch.randn(y.shape, generator=gen).to(device, dtype)
    y.backward(gy)
    params = {k: v.detach().double().requires_grad_() for k, v in module.state_dict().items()}
    x64 = x.detach().double().requires_grad_()
    y64 = reference(params, x64)
    y64.backward(gy.double())
    assert_close_to_reference("output", y, y64, dtype)
    assert_close_to_reference("input grad", x.grad, x64.grad, dtype)
    for key, p in module.named_parameters():
        assert_close_to_reference(f"grad {key}", p.grad, params[key].grad, dtype)
    with torch.no_grad():  # the no-grad forward runs the module as it is
        y_no_grad = module(x)
    assert y_no_grad.grad_fn is None
    assert_close_to_reference("no-grad output", y_no_grad, y64, dtype)
    with pytest.raises(ValueError, match="returned"), torch.no_grad():  # its output is checked there too
        pkg.Pooled(device=device, dtype=dtype)(torch.randn(3, 256, device=device, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu(pkg, dtype):
    check(pkg, dtype, "cpu")


def test_a_pipeline_with_a_user_module_never_replays_cuda_graphs(pkg):
    """A graph could not capture whatever the user's module does (host syncs, Python state)."""
    assert not hasattr(pkg.MixerBlock(), "cuda_graphs")


def test_a_torch_nn_module_without_a_te_ops_equivalent_runs_as_it_is(pkg):
    module = pkg.SoftmaxHead(dtype=torch.float64)
    x = torch.randn(3, 256, dtype=torch.float64, requires_grad=True)
    y = module(x)
    p = {k: v.detach().requires_grad_() for k, v in module.state_dict().items()}
    x64 = x.detach().requires_grad_()
    want = torch.softmax(F.linear(x64, p["0.weight"], p["0.bias"]), dim=-1)
    torch.testing.assert_close(y, want)
    gy = torch.randn_like(y)
    y.backward(gy)
    want.backward(gy)
    torch.testing.assert_close(x.grad, x64.grad)
    torch.testing.assert_close(module.get_submodule("0").weight.grad, p["0.weight"].grad)


def test_a_module_that_changes_the_shape_is_a_clear_error(pkg):
    with pytest.raises(ValueError, match=r"Pooled: Pool\(\) \(op 1 at spec.py:10:\d+\) returned \[3, 1\] for an input of shape "
                                         r"\[3, 256\]; fusegen runs a module between fused ops only when it keeps"):
        pkg.Pooled()(torch.randn(3, 256))


def test_a_class_that_cannot_be_imported_is_a_clear_error(pkg, monkeypatch):
    monkeypatch.setitem(sys.modules, "user_layers", None)  # as if not installed where the package runs
    with pytest.raises(ImportError, match=r"Missing: cannot import user_layers.Pool for Pool\(\) \(op 1 at spec.py:11:\d+\): "
                                          r".*make it importable where the generated package runs"):
        pkg.Missing()


@pytest.mark.parametrize("call, message", [
    ("Mixer(*sizes)", "Mixer() arguments cannot be unpacked with *"),
    ("Mixer(features)", "'features' is not a module-level constant defined before this line"),
])
def test_arguments_fusegen_cannot_read_are_spec_errors(call, message):
    with pytest.raises(SpecError) as info:
        parse_spec(f"import transformer_engine.pytorch as te\nfrom user_layers import Mixer\n"
                   f"m = te.ops.Sequential(te.ops.Linear(4, 4), {call})\n", "spec.py")
    assert message in info.value.message


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu(pkg, dtype):
    """The package was built without binaries (no NVRTC here): its kernels are the shipped
    package's, copied beside it with their MANIFEST.json records (the runtime checks each
    binary's sha256 against them)."""
    import generated

    shipped, own = Path(generated.__path__[0]), Path(pkg.__path__[0])
    needed = re.findall(r'Kernel\("(\w+)", "[pi]*"', (own / "_kernels.py").read_text())
    assert needed
    shipped_manifest = json.loads((shipped / "MANIFEST.json").read_text())
    manifest = json.loads((own / "MANIFEST.json").read_text())
    for name in needed:
        binaries = [f for f in (shipped / "kernels").glob(f"{name}.*") if f.suffix in (".cubin", ".ptx")]
        assert binaries, f"the shipped package has no {name}: pick ops whose kernels it has"
        for file in binaries:
            shutil.copy(file, own / "kernels")
        manifest["kernels"][name]["binaries"] = shipped_manifest["kernels"][name]["binaries"]
    (own / "MANIFEST.json").write_text(json.dumps(manifest))
    check(pkg, dtype, "cuda")
