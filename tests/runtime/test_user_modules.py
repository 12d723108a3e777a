"""Modules of the user's code between fusible ops (ops/module.py, stages/module.py): the generated
module constructs the user's class with the spec's literal arguments, owns its parameters under the
Sequential's index (as the eager Sequential), runs it as it is on the tensor with its leading dims,
and fuses the groups around it. Output, input grad and every parameter grad (the user module's
included) against float64 references; clear errors for a module that changes the shape, a class
that cannot be imported, and arguments fusegen cannot read. On CPU and, marked cuda, on a GPU.
Then (issue 36), against the eager model in float64: calls whose text holds quotes, backslashes
and characters the generated code must escape; in-place modules; a module anywhere in a pipeline;
retain_graph, torch.autograd.grad, gradcheck and torch.compile(fullgraph=True) in training."""

import json
import re
import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from references import assert_close_to_reference, randomize_
from spec_packages import imported_package

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
    with imported_package(tmp_path_factory.mktemp("user_modules"), "spec.py", SPEC, "user_pkg",
                          dtypes=("bfloat16", "float32"), files={"user_layers.py": LAYERS}) as pkg:
        yield pkg


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


# --- a spec's own text in the generated code; in-place modules; autograd as eager supports it -----

TAGGED_LAYERS = textwrap.dedent('''\
    import torch


    class Tagged(torch.nn.Module):
        """A learned per-feature scale after tanh that keeps the label it was built with."""

        def __init__(self, features, label=""):
            super().__init__()
            self.label = label
            self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, features))

        def forward(self, x):
            return torch.tanh(x) * self.scale


    class Doubler(torch.nn.Module):
        """Writes its input in place, as in-place modules do."""

        def forward(self, x):
            return x.mul_(2.0).sub_(0.25)


    class Constant(torch.nn.Module):
        """Ignores its input; one of its parameters is unused."""

        def __init__(self, features):
            super().__init__()
            self.value = torch.nn.Parameter(torch.linspace(-1, 1, features))
            self.unused = torch.nn.Parameter(torch.ones(features))

        def forward(self, x):
            return self.value.expand_as(x).clone()


    class Shrink(torch.nn.Module):
        def __init__(self, label=""):
            super().__init__()

        def forward(self, x):
            return x[..., :1]
''')
# Quotes of both kinds, backslashes, a pipe (a plan's table cell), non-ASCII, a triple-quoted
# string with a line break, a call over several lines with a comment inside: each lands in the
# generated code's strings, comments and docstrings, and the plan's table.
LABEL = 'say "hi"\\n|\'é\'\u00e9\nline two'
TAGGED_SPEC = textwrap.dedent('''\
    import torch
    import transformer_engine.pytorch as te
    from tagged_layers import Constant, Doubler, Shrink, Tagged

    tagged_block = te.ops.Sequential(
        te.ops.Linear(8, 8),
        Tagged(
            8,  # features
            label="""say "hi"\\\\n|'é'\\u00e9
    line two""",
        ),
        te.ops.Linear(8, 8), torch.nn.LeakyReLU(0.1, inplace=True),
        te.ops.Linear(8, 8), Doubler(), te.ops.SReLU(), te.ops.Linear(8, 8),
    )
    shrunk = te.ops.Sequential(te.ops.Linear(8, 8), Shrink(label="a \\"b\\" \\\\ c"))
    constant = te.ops.Sequential(te.ops.Linear(8, 8), Constant(8), te.ops.Linear(8, 8))
    modules_only = te.ops.Sequential(Tagged(8), torch.nn.LeakyReLU(0.1, inplace=True))
    module_first = te.ops.Sequential(Tagged(8), te.ops.Linear(8, 8))
    module_last = te.ops.Sequential(te.ops.Linear(8, 8), Tagged(8))
    modules_adjacent = te.ops.Sequential(
        te.ops.Linear(8, 8), Tagged(8), torch.nn.LeakyReLU(0.1, inplace=True), te.ops.Linear(8, 8))
    residual_around = te.ops.Sequential(
        te.ops.MakeExtraOutput(), te.ops.LayerNorm(8), Tagged(8), te.ops.Linear(8, 8), te.ops.AddExtraInput(),
        te.ops.MakeExtraOutput(), te.ops.RMSNorm(8))
    in_place_residual = te.ops.Sequential(
        te.ops.Linear(8, 8), Tagged(8), te.ops.AddExtraInput(in_place=True), te.ops.SReLU(), te.ops.Dropout(0.25))
    size_generic = te.ops.Sequential(
        te.ops.SReLU(), torch.nn.LeakyReLU(0.1), te.ops.Reshape((-1, 4)), te.ops.SReLU())
    add_then_module = te.ops.Sequential(te.ops.AddExtraInput(), Tagged(8))
''')
# The call as messages and comments quote it: on one line, cut at 60 characters (frontend/source.py).
SHOWN_CALL = 'Tagged( 8, # features label="""say "hi"\\\\n|\'é\'\\u00e9 line...'


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """The package of TAGGED_SPEC and its eager model (fusegen.eager, the oracle) in float64, with
    the same parameters."""
    folder = tmp_path_factory.mktemp("tagged")
    with imported_package(folder, "spec.py", TAGGED_SPEC, "tagged_pkg",
                          files={"tagged_layers.py": TAGGED_LAYERS}) as pkg:
        yield pkg, folder


def tagged_models(pkg):
    from fusegen.eager import Linear, Sequential, SReLU
    from tagged_layers import Doubler, Tagged

    module = pkg.TaggedBlock(dtype=torch.float64)
    randomize_(module, torch.Generator().manual_seed(3))
    eager = Sequential(Linear(8, 8), Tagged(8, label=LABEL), Linear(8, 8), torch.nn.LeakyReLU(0.1, inplace=True),
                       Linear(8, 8), Doubler(), SReLU(), Linear(8, 8)).double()
    eager.load_state_dict(module.state_dict())
    return module, eager


def signed_input(seed=4):
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_a_spec_text_with_quotes_backslashes_and_line_breaks_generates_a_package_that_imports(tagged):
    pkg, folder = tagged
    assert pkg.TaggedBlock()._modules["1"].label == LABEL  # the module built with the spec's literal
    assert f"\n        {SHOWN_CALL},  # op 1\n" in pkg.tagged_block.__doc__
    source = (folder / "tagged_pkg" / "tagged_block.py").read_text(encoding="utf-8")
    compile(source, "tagged_block.py", "exec")
    assert all("\u2028" not in line for line in source.splitlines())


def test_messages_name_the_call_exactly_as_the_spec_writes_it(tagged, monkeypatch):
    pkg, _ = tagged
    with pytest.raises(ValueError) as info:
        pkg.Shrunk()(torch.randn(3, 8))
    assert str(info.value).startswith('Shrunk: Shrink(label="a \\"b\\" \\\\ c") (op 1 at spec.py:15:')
    monkeypatch.setitem(sys.modules, "tagged_layers", None)
    with pytest.raises(ImportError) as info:
        pkg.TaggedBlock()
    assert str(info.value).startswith(f"TaggedBlock: cannot import tagged_layers.Tagged for {SHOWN_CALL} (op 1 at spec.py:7:")


def test_the_plan_table_keeps_a_call_with_a_pipe_in_one_cell(tagged):
    _, folder = tagged
    plan = (folder / "tagged_pkg" / "tagged_block.plan.md").read_text(encoding="utf-8")
    row = next(line for line in plan.splitlines() if "Tagged(" in line and line.startswith("| 1 |"))
    cells = re.split(r"(?<!\\)\|", row)[1:-1]  # a table splits at pipes that are not escaped
    assert len(cells) == 4, row
    assert cells[1].strip().startswith('`Tagged( 8, # features label="""say "hi"') and "\\|" in cells[1]


def test_in_place_modules_between_fused_ops_match_eager(tagged):
    """nn.LeakyReLU(inplace=True) and a module that writes its input: output, input grad and
    every parameter grad as the eager model's, with the values the fused stages keep unchanged."""
    module, eager = tagged_models(tagged[0])
    x = signed_input().requires_grad_()
    x_eager = x.detach().clone().requires_grad_()
    y, y_eager = module(x), eager(x_eager)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y.backward(gy)
    y_eager.backward(gy)
    torch.testing.assert_close(y, y_eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-12, atol=1e-12)
    eager_grads = dict(eager.named_parameters())
    for key, p in module.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[key].grad, rtol=1e-12, atol=1e-12, msg=key)
    with torch.no_grad():  # and without autograd
        torch.testing.assert_close(module(x), eager(x.detach().clone()), rtol=1e-12, atol=1e-12)


def test_retain_graph_runs_the_backward_twice_as_eager(tagged):
    module, eager = tagged_models(tagged[0])
    grads = []
    for model in (module, eager):
        x = signed_input().requires_grad_()
        y = model(x)
        y.square().sum().backward(retain_graph=True)
        y.square().sum().backward()
        grads.append([x.grad, *(p.grad for _, p in sorted(model.named_parameters()))])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_autograd_grad_with_respect_to_a_user_modules_parameters_matches_eager(tagged):
    """The user module's parameters are the Function's inputs: torch.autograd.grad reaches them
    and leaves every .grad alone, and a frozen one gets no grad, as in eager."""
    module, eager = tagged_models(tagged[0])
    results = []
    for model in (module, eager):
        x = signed_input().requires_grad_()
        y = model(x)
        scale = model[1].scale if model is eager else model._modules["1"].scale
        results.append(torch.autograd.grad(y.sum(), [x, scale, model[0].weight if model is eager
                                                              else model._modules["0"].weight]))
        assert all(p.grad is None for p in model.parameters())
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    module._modules["1"].scale.requires_grad_(False)
    module(signed_input().requires_grad_()).sum().backward()
    assert module._modules["1"].scale.grad is None and module._modules["0"].weight.grad is not None


def test_a_module_whose_output_ignores_its_input_cuts_the_grad_path_as_in_eager(tagged):
    """Autograd never reaches the ops before it: their grads stay None, as does its unused
    parameter's, as in eager."""
    from fusegen.eager import Linear, Sequential
    from tagged_layers import Constant

    module = tagged[0].Constant(dtype=torch.float64)
    randomize_(module, torch.Generator().manual_seed(6))
    eager = Sequential(Linear(8, 8), Constant(8), Linear(8, 8)).double()
    eager.load_state_dict(module.state_dict())
    grads = []
    for model in (module, eager):
        x = signed_input().requires_grad_()
        model(x).square().sum().backward()
        grads.append({"x": x.grad, **{key: p.grad for key, p in model.named_parameters()}})
    fused, unfused = grads
    for key in ("x", "0.weight", "0.bias", "1.unused"):
        assert fused[key] is None and unfused[key] is None, key
    for key in ("1.value", "2.weight", "2.bias"):
        torch.testing.assert_close(fused[key], unfused[key], rtol=1e-12, atol=1e-12)


def _eager(name):
    """The eager model (fusegen.eager) of a pipeline of TAGGED_SPEC."""
    from fusegen.eager import AddExtraInput, LayerNorm, Linear, MakeExtraOutput, RMSNorm, Sequential, SReLU
    from tagged_layers import Tagged

    return {
        "ModulesOnly": lambda: Sequential(Tagged(8), torch.nn.LeakyReLU(0.1, inplace=True)),
        "ModuleFirst": lambda: Sequential(Tagged(8), Linear(8, 8)),
        "ModuleLast": lambda: Sequential(Linear(8, 8), Tagged(8)),
        "ModulesAdjacent": lambda: Sequential(Linear(8, 8), Tagged(8), torch.nn.LeakyReLU(0.1, inplace=True),
                                              Linear(8, 8)),
        "ResidualAround": lambda: Sequential(MakeExtraOutput(), LayerNorm(8), Tagged(8), Linear(8, 8),
                                             AddExtraInput(), MakeExtraOutput(), RMSNorm(8)),
        "InPlaceResidual": lambda: Sequential(Linear(8, 8), Tagged(8), AddExtraInput(in_place=True), SReLU()),
        "AddThenModule": lambda: Sequential(AddExtraInput(), Tagged(8)),
    }[name]().double()


@pytest.mark.parametrize("name", ["ModulesOnly", "ModuleFirst", "ModuleLast", "ModulesAdjacent", "ResidualAround",
                                  "InPlaceResidual"])
def test_pipelines_with_user_modules_anywhere_match_eager(tagged, name):
    """Modules alone (no fused op), a module first, last, next to another, inside a residual
    (extra outputs and inputs across it), before an in-place residual add: outputs, the input's
    and extra inputs' grads and every parameter grad as the eager model's, in float64;
    evaluation mode (Dropout: the identity)."""
    module = getattr(tagged[0], name)(dtype=torch.float64).eval()
    randomize_(module, torch.Generator().manual_seed(7))
    eager = _eager(name).eval()
    eager.load_state_dict(module.state_dict())
    gen = torch.Generator().manual_seed(8)
    inputs = [torch.randn(2, 5, 8, generator=gen, dtype=torch.float64)
              for _ in range(1 + len(module.extra_input_features))]
    results = []
    for model in (module, eager):
        leaves = [t.clone().requires_grad_() for t in inputs]
        args = [leaves[0]] + [t.clone() for t in leaves[1:]]  # an in-place add writes its extra input
        outputs = model(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        torch.autograd.backward(outputs, [torch.full_like(o, 0.5) + o.detach() for o in outputs])
        results.append(([o.detach() for o in outputs], [t.detach() for t in args[1:]], [t.grad for t in leaves],
                        {key: p.grad for key, p in model.named_parameters()}))
    (outs, written, grads, params), (want_outs, want_written, want_grads, want_params) = results
    for got, want in zip([*outs, *written, *grads], [*want_outs, *want_written, *want_grads], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert params.keys() == want_params.keys()
    for key, grad in params.items():
        torch.testing.assert_close(grad, want_params[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", ["AddThenModule", "ResidualAround", "InPlaceResidual"])
def test_grads_accumulate_over_micro_batches_through_user_modules_as_in_eager(tagged, name):
    """Two micro-batches into the same leaves, reached through .clone(): a residual add before or
    after a user module runs in a Function of its own, whose grads for its input and for the
    residual must each be their own memory (autograd accumulates a leaf's .grad in place), as the
    eager model's are."""
    module = getattr(tagged[0], name)(dtype=torch.float64).eval()
    randomize_(module, torch.Generator().manual_seed(9))
    eager = _eager(name).eval()
    eager.load_state_dict(module.state_dict())
    gen = torch.Generator().manual_seed(10)
    batches = [[torch.randn(3, 8, generator=gen, dtype=torch.float64) for _ in range(2)] for _ in range(2)]
    grads = []
    for model in (module, eager):
        leaves = [torch.zeros(3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        for x, r in batches:
            outputs = model(leaves[0].clone() + x, leaves[1].clone() + r)
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            torch.autograd.backward(outputs, [o.detach().cos() for o in outputs])
        grads.append([leaf.grad for leaf in leaves])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_size_generic_pipeline_with_a_user_module_and_a_reshape(tagged):
    """The backward's reshapes take the input width (n) from grad_forward: against a float64
    reference written out."""
    module = tagged[0].SizeGeneric(dtype=torch.float64)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(9), dtype=torch.float64).requires_grad_()
    y = module(x)
    x64 = x.detach().clone().requires_grad_()
    h = F.leaky_relu(F.relu(x64).square(), 0.1).reshape(-1, 4)  # TE's Reshape: the whole tensor
    want = F.relu(h).square()
    gy = torch.randn(want.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    y.backward(gy)
    want.backward(gy)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x64.grad, rtol=1e-12, atol=1e-12)


def test_gradcheck_through_user_modules(tagged):
    module, _ = tagged_models(tagged[0])
    scale = module._modules["1"].scale

    def with_scale(x, new_scale):
        return torch.func.functional_call(module, {"1.scale": new_scale}, (x,))

    x = signed_input().requires_grad_()
    assert torch.autograd.gradcheck(with_scale, (x, scale.detach().clone().requires_grad_()))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph_in_training_matches_eager(tagged, backend):
    """torch.compile(fullgraph=True) of a module with user modules, in training (fullgraph raises
    on a graph break): eager's output and grads."""
    module, eager = tagged_models(tagged[0])
    x = signed_input().requires_grad_()
    x_eager = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    y = torch.compile(module, fullgraph=True, backend=backend)(x)
    y_eager = eager(x_eager)
    y.sum().backward()
    y_eager.sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-12, atol=1e-12)
    eager_grads = dict(eager.named_parameters())
    for key, p in module.named_parameters():
        torch.testing.assert_close(p.grad, eager_grads[key].grad, rtol=1e-12, atol=1e-12, msg=key)


def test_the_plan_says_what_a_user_module_keeps_for_the_backward(tagged):
    _, folder = tagged
    plan = (folder / "tagged_pkg" / "tagged_block.plan.md").read_text(encoding="utf-8")
    saved = plan[plan.index("## Saved for backward"):]
    assert "what each keeps for its\nown backward hangs on autograd's graph, as in eager PyTorch" in saved
    for index, target in ((1, "tagged_layers.Tagged"), (3, "torch.nn.LeakyReLU"), (5, "tagged_layers.Doubler")):
        assert re.search(rf"^- op {index}, `.+`: what `{re.escape(target)}`'s backward needs$", saved, re.M), saved
