"""Activations (ClampedSwiGLU, SReLU, ConstantScale, QGELU and the GLU family) on the CPU
path of a generated package, against independent float64 autograd references (references.py),
with clamps active on part of the inputs. The same kernels run on the GPU in test_gpu.py."""

import importlib
import sys
import textwrap

import pytest
import torch

import references as R
from fusegen import build, eager, output

SPEC = textwrap.dedent("""\
    from fusegen.eager import (Sequential, Bias, ClampedSwiGLU, SReLU, ConstantScale, QGELU, GLU, QGEGLU, ReGLU,
                               SReGLU, SiTUGLU)
    clamped = Sequential(Bias(32), ClampedSwiGLU(limit=1.5, alpha=1.25, glu_linear_offset=0.5))
    clamped_default = Sequential(Bias(32), ClampedSwiGLU())
    squared = Sequential(Bias(16), ConstantScale(-0.75), SReLU(), ConstantScale(2.0))
    quick = Sequential(Bias(16), QGELU())
    glu = Sequential(Bias(32), GLU())
    qgeglu = Sequential(Bias(32), QGEGLU())
    reglu = Sequential(Bias(32), ReGLU())
    sreglu = Sequential(Bias(32), SReGLU())
    situglu = Sequential(Bias(32), SiTUGLU(beta1=2.0, beta2=8.0))
    situglu_default = Sequential(Bias(32), SiTUGLU())
""")


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    folder = tmp_path_factory.mktemp("activations")
    (folder / "act_spec.py").write_text(SPEC)
    config = build.Config((folder / "act_spec.py",), folder / "act_pkg", archs=(), dtypes=("float32",), root=folder)
    files = build.build_package(config)
    output.write_package(files, config.out)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("act_pkg")
    finally:
        sys.path.remove(str(folder))


TOLS = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}  # TE's single-op rtol, atol
ACTIVATIONS = {  # what follows the Bias, as a float64 function of its output
    "Clamped": lambda h: R.clamped_swiglu(h, limit=1.5, alpha=1.25, offset=0.5),
    "ClampedDefault": lambda h: R.clamped_swiglu(h),
    "Squared": lambda h: 2.0 * R.srelu(-0.75 * h),
    "Quick": R.qgelu,
    **{name.capitalize(): (lambda h, g=gate: R.gated(h, g)) for name, gate in R.GLU_GATES.items()},
    "Situglu": lambda h: R.situglu(h, beta1=2.0, beta2=8.0),
    "SitugluDefault": R.situglu,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_against_float64_autograd(pkg, name, dtype):
    module = getattr(pkg, name)(dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(module.in_features, generator=gen).to(dtype)
    x = (torch.randn(257, module.in_features, generator=gen) * 4).to(dtype)  # wide: clamps are active
    x[:, ::5] = -bias[::5]  # h = x + b is exactly 0 there: ReLU kinks hit exactly
    dy = torch.randn(257, module.out_features, generator=gen).to(dtype)
    with torch.no_grad():
        module.get_submodule("0").bias.copy_(bias)
    xd = x.clone().requires_grad_()
    y = module(xd)
    y.backward(dy)
    # The reference starts from the bias add as the kernels compute it, one fp32 add, so what is
    # compared is the activation alone (the clamped GLU's derivatives are steep, |d dx / dh| ~ 20
    # at |h| ~ 16: a float64 sum would hand it an input the kernel never had). A single op: TE's
    # per-dtype tolerances. dbias sums the kernel's own dx (checked elementwise just before): in
    # fp32 against the exact sum of those terms within fp32's summation bound, in bf16 against the
    # float64 grads with TE's tolerance.
    h64 = (x.float() + bias.float()).double().requires_grad_()
    ref = ACTIVATIONS[name](h64)
    ref.backward(dy.double())
    rtol, atol = TOLS[dtype]
    torch.testing.assert_close(y.double(), ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(xd.grad.double(), h64.grad, rtol=rtol, atol=atol)
    dbias = module.get_submodule("0").bias.grad.double()
    if dtype == torch.float32:
        # An fp32 column sum of the kernel's own dx terms (checked just above). Where the terms cancel
        # (SReGLU's reach ~100 and sum to ~1) no rtol on the result holds; the bound every fp32 sum of
        # n terms meets does: |sum - exact| <= n * 2**-24 * sum(|terms|).
        terms = xd.grad.double()
        bound = terms.shape[0] * 2.0**-24 * terms.abs().sum(0)
        assert ((dbias - terms.sum(0)).abs() <= bound).all(), (dbias - terms.sum(0)).abs().max()
    else:
        torch.testing.assert_close(dbias, h64.grad.sum(0), rtol=rtol, atol=atol)
    if name.startswith("Clamped"):  # both clamps are active somewhere: their zero grads are tested
        a, b = h64.detach().chunk(2, dim=-1)
        limit = 1.5 if name == "Clamped" else 7.0
        assert (a > limit).any() and (b.abs() > limit).any() and (b.abs() < limit).any()


def test_kernel_names_spell_non_default_constants(pkg):
    source = (sys.modules["act_pkg"].__file__)
    kernels = open(source.replace("__init__.py", "_kernels.py")).read()
    assert "def bias_clamped_swiglu_l1p5_a1p25_o0p5_fwd_n16(" in kernels
    assert "def bias_clamped_swiglu_fwd_n16(" in kernels  # defaults are not spelled
    assert "def bias_scalem0p75_srelu_scale2p0_bwd_n16_from_bias(" in kernels


def test_cuda_source_builds_each_functor_from_its_constants(pkg):
    folder = sys.modules["act_pkg"].__file__.replace("__init__.py", "kernels/")
    fwd = open(folder + "bias_clamped_swiglu_l1p5_a1p25_o0p5_fwd_n16.cu").read()
    assert "const fg::ClampedSwiGLU<Math> step1{1.5f, 1.25f, 0.5f};" in fwd
    bwd = open(folder + "bias_scalem0p75_srelu_scale2p0_bwd_n16_from_bias.cu").read()
    assert "const fg::Scale step1{-0.75f};" in bwd and "const fg::Srelu step2{};" in bwd
    # the precision of exp and division follows the dtype; a kernel whose functors need none has no Math
    assert "using Math = fg::ExactMath;" in fwd and "Math" not in bwd


def test_eager_modules_exist_for_every_op_and_match():
    torch.manual_seed(0)
    seq = eager.Sequential(eager.Bias(8), eager.ClampedSwiGLU(limit=0.5), eager.ConstantScale(3.0))
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        seq[0].bias.copy_(torch.randn(8, dtype=torch.float64))
    torch.testing.assert_close(seq(x), 3.0 * R.clamped_swiglu(x + seq[0].bias, limit=0.5))
    assert set(eager.__all__) >= {"ClampedSwiGLU", "SReLU", "GELU", "Sequential"}
