"""The generated modules' run-time input checks (CPU; no GPU needed)."""

import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("fusegen_runtime", Path(__file__).resolve().parents[2] / "templates" / "runtime.py")
runtime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runtime)


def test_check_input_errors_say_what_to_do():
    like = torch.zeros(4, dtype=torch.float32)
    runtime.check_input("M", "x", torch.zeros(2, 3, 4), 4, like)
    with pytest.raises(ValueError, match=r"M: x must have shape \[\.\.\., 4\], got \[2, 5\]"):
        runtime.check_input("M", "x", torch.zeros(2, 5), 4, like)
    with pytest.raises(TypeError, match="dtype torch.float16 but the module's parameters are torch.float32"):
        runtime.check_input("M", "x", torch.zeros(2, 4, dtype=torch.float16), 4, like)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        runtime.check_input("M", "x", [1, 2, 3, 4], 4, like)
    with pytest.raises(ValueError, match="same leading shape as x"):
        runtime.check_input("M", "r", torch.zeros(3, 4), 4, like, torch.Size([2]))
    with pytest.raises(ValueError, match="is on meta but the module's parameters are on cpu"):
        runtime.check_input("M", "x", torch.zeros(2, 4, device="meta"), 4, like)



def test_a_generated_modules_repr_names_each_op_as_the_spec_does():
    """Every op of the spec's Sequential, in order, as the spec writes it (the parameter-free ones
    too; Linear as Linear, not as its BasicLinear and Bias); state_dict keys stay the Sequential's.
    On the meta device: neither needs values (TeMlp's 176M parameters would take a second to fill)."""
    import generated

    te_mlp = generated.TeMlp(device="meta")
    assert repr(te_mlp) == (
        "TeMlp(\n"
        "  (0): LayerNorm(4096)\n"
        "  (1): Linear(4096, 28672)\n"
        "  (2): SwiGLU()\n"
        "  (3): Linear(14336, 4096)\n"
        ")")
    assert "(1): Dropout(0.1)" in repr(generated.PostAttention(device="meta"))
    assert sorted(te_mlp.state_dict()) == ["0.bias", "0.weight", "1.bias", "1.weight", "3.bias", "3.weight"]
