"""The attention ops' backend argument as the design note spells it (issue 38): ``te.DotProductAttention``
(an attribute of the file's ``transformer_engine.pytorch`` import, under any alias),
``DotProductAttention`` imported from transformer_engine.pytorch (under any name), or left out; any
other object a spec names there is a SpecError at it (Arg.objects, frontend/calls.py)."""

from __future__ import annotations

import pytest

from fusegen.errors import SpecError
from fusegen.frontend import parse_spec
from spec_errors import assert_points_at

LAYER = "m = te.Sequential(te.Linear(64, 128, bias=False), te.GroupedQueryAttention(64, 4, 2{backend}))\n"


def attention_args(text):
    (spec,) = parse_spec(text, "spec.py")
    (call,) = [c for c in spec.calls if c.op == "GroupedQueryAttention"]
    return call.args


@pytest.mark.parametrize("imports,backend", [
    ("import transformer_engine.pytorch as te\n", ", te.DotProductAttention"),
    ("import transformer_engine.pytorch as te\n", ", backend=te.DotProductAttention"),
    ("import transformer_engine.pytorch as te\nimport transformer_engine.pytorch as tp\n", ", tp.DotProductAttention"),
    ("import transformer_engine.pytorch as te\nfrom transformer_engine.pytorch import DotProductAttention\n",
     ", DotProductAttention"),
    ("import transformer_engine.pytorch as te\nfrom transformer_engine.pytorch import DotProductAttention as DPA\n",
     ", DPA"),
    ("import transformer_engine.pytorch as te\n", ""),
])
def test_the_notes_spellings_and_leaving_it_out_are_read(imports, backend):
    assert attention_args(imports + LAYER.format(backend=backend))["backend"] == "DotProductAttention"


def test_the_spelling_of_the_transformer_engine_pytorch_module_itself():
    text = ("import transformer_engine.pytorch\n"
            "m = transformer_engine.pytorch.Sequential(transformer_engine.pytorch.GroupedQueryAttention(\n"
            "    64, 4, 2, transformer_engine.pytorch.DotProductAttention))\n")
    assert attention_args(text)["backend"] == "DotProductAttention"


@pytest.mark.parametrize("imports,backend,named", [
    ("import transformer_engine.pytorch as te\n", "te.Linear", "transformer_engine.pytorch.Linear"),
    ("import transformer_engine.pytorch as te\n", "te.ops.DotProductAttention",
     "transformer_engine.pytorch.ops.DotProductAttention"),
    ("import transformer_engine.pytorch as te\nfrom flash_attn import DotProductAttention\n", "DotProductAttention",
     "flash_attn.DotProductAttention"),
    ("import transformer_engine.pytorch as te\nimport torch\n", "torch.nn.MultiheadAttention",
     "torch.nn.MultiheadAttention"),
    ("import transformer_engine.pytorch as te\n", "'FlashAttention'", "FlashAttention"),
])
def test_any_other_backend_is_a_spec_error_at_it(imports, backend, named):
    text = imports + LAYER.format(backend=", " + backend)
    with pytest.raises(SpecError) as info:
        parse_spec(text, "spec.py")
    line = len(imports.splitlines()) + 1
    col = text.splitlines()[line - 1].rindex(backend) + 1
    assert_points_at(info.value, text, line, col, backend)
    assert info.value.message == (
        f"argument 'backend' of GroupedQueryAttention must be te.DotProductAttention (the one attention backend "
        f"fusegen runs: FlashAttention-2 on CUDA), got {named!r}; leave it out or pass te.DotProductAttention")


def test_an_unimported_name_is_a_spec_error_at_it():
    text = "import transformer_engine.pytorch as te\n" + LAYER.format(backend=", DotProductAttention")
    with pytest.raises(SpecError, match="'DotProductAttention' is not a module-level constant") as info:
        parse_spec(text, "spec.py")
    assert_points_at(info.value, text, 2, text.splitlines()[1].index("DotProductAttention") + 1, "DotProductAttention")


def test_other_arguments_do_not_read_objects():
    """Only an argument with Arg.objects reads names as objects: hidden=te.DotProductAttention is
    the folder's error, as before."""
    text = ("import transformer_engine.pytorch as te\n"
            "m = te.Sequential(te.GroupedQueryAttention(te.DotProductAttention, 4, 2))\n")
    with pytest.raises(SpecError, match="unsupported expression in argument 'hidden'"):
        parse_spec(text, "spec.py")
