"""A long elementwise run through the whole generator (CPU path, no kernels compiled): a GLU
halving the width mid-run, extra outputs and inputs in the middle of the run, a bias the GEMM
does not take (so backward recomputes from before it), against the eager Sequential in float64."""

import importlib
import sys
import textwrap

import torch

from fusegen import build, eager, output

SPEC = textwrap.dedent("""\
    from fusegen.eager import (AddExtraInput, Bias, ConstantScale, GELU, GEGLU, LayerNorm,
                                 MakeExtraOutput, Sequential, SiLU, ReLU)
    H = 64
    chain = Sequential(
        AddExtraInput(), MakeExtraOutput(), LayerNorm(H, eps=1e-6, zero_centered_gamma=True),
        Bias(H), ConstantScale(0.5), GELU(), MakeExtraOutput(), AddExtraInput(), SiLU(),
        Bias(H), GEGLU(), AddExtraInput(), ReLU(),
    )
""")


def test_long_chain_matches_eager_in_float64(tmp_path):
    spec = tmp_path / "chain_spec.py"
    spec.write_text(SPEC)
    config = build.Config((spec,), tmp_path / "chain_pkg", archs=(), dtypes=("float32",), root=tmp_path)
    output.write_package(build.build_package(config), config.out)
    sys.path.insert(0, str(tmp_path))
    try:
        pkg = importlib.import_module("chain_pkg")
    finally:
        sys.path.remove(str(tmp_path))
    source = (config.out / "_kernels.py").read_text()
    # bias_scale0p5_gelu_tee_add_silu_bias_geglu_add_relu_bwd_n32_from_bias, cut to 48 characters
    assert "def bias_scale0p5_gelu_x9d66e55d_bwd_n32_from_bias(" in source

    torch.manual_seed(0)
    generated = pkg.Chain(dtype=torch.float64)
    E = eager
    reference = E.Sequential(
        E.AddExtraInput(), E.MakeExtraOutput(), E.LayerNorm(64, eps=1e-6, zero_centered_gamma=True),
        E.Bias(64), E.ConstantScale(0.5), E.GELU(), E.MakeExtraOutput(), E.AddExtraInput(), E.SiLU(),
        E.Bias(64), E.GEGLU(), E.AddExtraInput(), E.ReLU(),
    ).double()
    assert list(reference.state_dict()) == list(generated.state_dict())
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))
    generated.load_state_dict(reference.state_dict())
    shapes = [(5, 64), (5, 64), (5, 64), (5, 32)]
    inputs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    got, want = generated(*inputs), reference(*inputs)
    assert len(got) == len(want) == 3
    grads = [torch.randn_like(o) for o in got]
    d_got = torch.autograd.grad(got, [*inputs, *generated.parameters()], grads)
    d_want = torch.autograd.grad(want, [*inputs, *reference.parameters()], grads)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for i, (a, b) in enumerate(zip(d_got, d_want)):
        torch.testing.assert_close(a, b, msg=lambda m: f"grad {i}: {m}")
