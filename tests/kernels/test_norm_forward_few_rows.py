"""Which norm forwards get a second entry point for at most one wave of rows (generator/kernels.py:
norm_fwd_few_rows; templates/cuda/norm.cuh: FEW_ROWS), and that a package's sources and its
``Kernel(..., few_rows=...)`` declarations agree, as the shipped package and the wide-norms fixture
were generated."""

import ast
from pathlib import Path

import pytest

from fusegen import kernels as kn
from fusegen.stages.norm import tuning

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"generated": ROOT / "generated", "generated_wide": ROOT / "tests/fixtures/wide_norms/generated_wide"}
SUFFIX_DTYPE = {suffix: dtype for dtype, (suffix, *_) in kn.DTYPES.items()}


@pytest.mark.parametrize("hidden,vec,threads,itemsize,params,residual,writes_h,entry", [
    (1024, 8, 128, 2, 2, True, True, False),  # a vector a thread: nothing to issue earlier
    (8192, 8, 256, 2, 1, False, False, False),  # RMSNorm: gamma held already (16 KB a block)
    (8192, 8, 256, 2, 2, False, False, True),  # LayerNorm: gamma and beta not held (32 KB)
    (4096, 8, 128, 2, 2, False, False, False),  # LayerNorm(4096) in bf16: held (16 KB)
    (4096, 4, 256, 4, 2, False, False, True),  # ... in fp32: not (32 KB)
    (2048, 8, 128, 2, 1, True, True, True),  # residual add + RMSNorm: its loads before its stores
    (256, 8, 128, 2, 0, False, False, False),  # L2Normalization without a prologue: nothing
])
def test_which_forwards_have_a_few_rows_entry(hidden, vec, threads, itemsize, params, residual, writes_h, entry):
    assert tuning.norm_fwd_few_rows(hidden, vec, threads, itemsize, params, residual, writes_h) is entry


def _declared_few_rows(launchers):
    """{kernel name: the dtype names its ``Kernel(..., few_rows=(torch.<dtype>, ...))`` lists}."""
    declared = {}
    for node in ast.parse(launchers.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "Kernel"):
            few = next((k.value for k in node.value.keywords if k.arg == "few_rows"), None)
            declared[ast.literal_eval(node.value.args[0])] = {e.attr for e in few.elts} if few is not None else set()
    return declared


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_sources_and_declarations_agree(package):
    folder = PACKAGES[package]
    declared = _declared_few_rows(folder / "_kernels.py")
    entries = 0
    for source in sorted((folder / "kernels").glob("*norm*_fwd_*.cu")):
        name, text = source.stem, source.read_text()
        for suffix, dtype in SUFFIX_DTYPE.items():
            assert f" {name}_{suffix}(" in text, source.name  # the package's every dtype
            has_entry = f" {name}_{suffix}_few_rows(" in text
            assert has_entry is (dtype in declared[name]), f"{source.name}: {suffix}"
            entries += has_entry
    assert entries > 0, "the package has wide enough norms for some entry"
