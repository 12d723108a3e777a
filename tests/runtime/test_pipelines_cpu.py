"""Every shipped pipeline of the generated package, on CPU, against float64 references:
outputs, extra outputs, input grads and all parameter grads, in float32 and bfloat16."""

import pytest
import torch

import generated
from references import CHUNK, PIPELINES, assert_close_to_reference, randomize_, run_and_compare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_matches_float64_reference(name, dtype):
    torch.manual_seed(0)
    module = torch.nn.utils.skip_init(getattr(generated, PIPELINES[name][0]), dtype=dtype)
    randomize_(module, torch.Generator().manual_seed(1))
    run_and_compare(module, name, (2, 3, module.in_features), dtype, "cpu", seed=2)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_no_grad_forward_matches_float64_reference(name, monkeypatch):
    """With autograd off (torch.no_grad, then torch.inference_mode: one module and reference for
    both) the module runs its no-grad forward (the autograd.Function never), whose plan may fuse
    more (a GELU in the GEMM's epilogue)."""
    module = torch.nn.utils.skip_init(getattr(generated, PIPELINES[name][0]), dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(1))
    function = getattr(generated, name).__dict__[PIPELINES[name][0] + "Function"]
    monkeypatch.setattr(function, "apply", lambda *args: pytest.fail("the autograd.Function ran without grad"))
    run_and_compare(module, name, (2, 3, module.in_features), torch.float32, "cpu", seed=2,
                    no_grad=(torch.no_grad, torch.inference_mode))


def test_single_row_and_non_contiguous_input():
    module = generated.Gpt2Mlp(dtype=torch.float32)
    randomize_(module, torch.Generator().manual_seed(3))
    run_and_compare(module, "gpt2_mlp", (1, module.in_features), torch.float32, "cpu", seed=4)
    transposed = lambda t: t.t().contiguous().t()  # same values, column-major strides  # noqa: E731
    run_and_compare(module, "gpt2_mlp", (5, module.in_features), torch.float32, "cpu",
                    make_input=lambda t: transposed(t) if t.dim() == 2 else t, seed=5)


def test_wrong_inputs_get_clear_errors():
    module = torch.nn.utils.skip_init(generated.Fc2, dtype=torch.float32)  # refused before any value is read
    x, r = torch.randn(3, 14336), torch.randn(3, 4096)
    with pytest.raises(ValueError, match=r"Fc2: x must have shape \[\.\.\., 14336\], got \[3, 4096\]"):
        module(r, r)
    with pytest.raises(TypeError, match="Fc2: x has dtype torch.bfloat16 but the module's parameters are torch.float32"):
        module(x.bfloat16(), r)
    with pytest.raises(ValueError, match=r"Fc2: extra_input0 must have the same leading shape as x, \[3\], got \[2\]"):
        module(x, r[:2])
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'extra_input0'"):
        module(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_reference_check_fails_on_non_finite_values(bad):
    """assert_close_to_reference, which every numerics test relies on: a NaN or inf anywhere in the
    result fails it, in any chunk; a result within 4 units of roundoff passes, one beyond fails."""
    ref = torch.linspace(-1, 1, 3 * CHUNK + 5, dtype=torch.float64)
    assert_close_to_reference("same", ref.float(), ref, torch.float32, gemm=False)
    for where in (0, CHUNK + 1, 3 * CHUNK + 4):
        got = ref.float()
        got[where] = bad
        with pytest.raises(AssertionError, match="non-finite values"):
            assert_close_to_reference("bad", got, ref, torch.float32, gemm=False)
    off = ref.clone()
    off[CHUNK + 1] += 5 * 2.0**-24
    with pytest.raises(AssertionError, match="max \\|err\\|"):
        assert_close_to_reference("off", off, ref, torch.float32, gemm=False)


def test_the_streamed_reference_linear_is_f_linear(monkeypatch):
    """The large pipelines' references read their weights a block of rows at a time and keep the
    weight grad as its factors (references.StreamedWeight): the same values as F.linear's forward
    and autograd grads in float64, for every block, and the chunked check reads every row of it."""
    import references

    monkeypatch.setattr(references, "ROW_BLOCK_ELEMENTS", 5 * 11)  # 5 rows a block: 8 blocks of 37 rows
    monkeypatch.setattr(references, "CHUNK", 3 * 11)  # the check compares 3 rows at a time
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(37, 11, generator=gen)
    x = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    bias = torch.randn(37, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 3, 37, generator=gen, dtype=torch.float64)

    w64 = weight.double().requires_grad_()
    x1, b1 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    want = torch.nn.functional.linear(x1, w64, b1)
    want.backward(dy)

    streamed = references.StreamedWeight(weight)
    x2, b2 = x.clone().requires_grad_(), bias.clone().requires_grad_()
    got = references.linear(x2, streamed, b2)
    got.backward(dy)

    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(b2.grad, b1.grad, rtol=1e-12, atol=0)
    assert streamed.grad.shape == w64.shape
    torch.testing.assert_close(streamed.grad.rows(0, 37), w64.grad, rtol=1e-12, atol=0)

    assert_close_to_reference("streamed", w64.grad.float(), streamed.grad, torch.float32, gemm=False)
    off = w64.grad.float().clone()
    off[36, 10] += 1.0  # the last row of the last chunk
    with pytest.raises(AssertionError, match="max \\|err\\|"):
        assert_close_to_reference("streamed off", off, streamed.grad, torch.float32, gemm=False)
