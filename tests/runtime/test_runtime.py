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

