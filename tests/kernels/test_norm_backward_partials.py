"""Where a norm backward sums its fp32 parameter-grad partials (generator/kernels.py:
norm_bwd_shared_partials): shared memory when they fit in 96 KB a block (every GPU from sm_80 on
gives that much), registers otherwise; the block size and register cap that go with each, as the
shipped package and the wide-norms fixture (tests/fixtures/wide_norms) were generated."""

import ast
import functools
import re
from pathlib import Path

import pytest

from fusegen.stages.norm import tuning

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"generated": ROOT / "generated", "generated_wide": ROOT / "tests/fixtures/wide_norms/generated_wide"}


@pytest.mark.parametrize("grad_columns,shared", [
    (0, False),  # L2Normalization: no parameters, nothing to sum
    (98, True), (2 * 4096, True),
    (2 * 12288, True),  # LayerNorm(12288): 96 KB, the limit
    (2 * 12288 + 1, False), (16384, True), (2 * 16384, False),
])
def test_partials_go_to_shared_memory_where_they_fit(grad_columns, shared):
    assert tuning.norm_bwd_shared_partials(grad_columns) is shared


@pytest.mark.parametrize("hidden,vec,shared,threads", [
    (8192, 8, True, 512), (4096, 8, True, 256), (1024, 8, True, 64), (98, 2, True, 32),
    (12288, 8, True, 768), (12288, 4, True, 1024),  # 2 vectors a thread, at most 1024 threads
    (8192, 8, False, 1024), (16384, 8, False, 512),  # registers: one vector a thread up to 1024
])
def test_backward_threads(hidden, vec, shared, threads):
    assert tuning.norm_threads(hidden, vec, backward=True, shared_partials=shared) == threads


def _norm_backward_sources():
    for package, folder in PACKAGES.items():
        for source in sorted((folder / "kernels").glob("*norm_bwd_*.cu")):
            yield package, source


SOURCES = list(_norm_backward_sources())


@functools.cache
def _parsed(launchers):
    return ast.parse(launchers.read_text())


def _declared_shared_bytes(launchers, name):
    """The ``shared=`` a package's ``Kernel("name", ...)`` declaration gives, or None."""
    for node in _parsed(launchers).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "Kernel" and ast.literal_eval(node.value.args[0]) == name):
            return next((ast.literal_eval(k.value) for k in node.value.keywords if k.arg == "shared"), None)
    raise AssertionError(f"no Kernel declaration for {name}")


@pytest.mark.parametrize("package,source", SOURCES, ids=[f"{p}/{s.stem}" for p, s in SOURCES])
def test_generated_backwards_match_their_launchers(package, source):
    """Each generated norm backward's .cu and its launcher agree: the shared-memory ones take
    M * H * 4 bytes of dynamic shared memory (Kernel(shared=...)) and ask for two blocks an SM
    where 512 threads or fewer make a block; the register ones take none."""
    text = source.read_text()
    name = re.search(r'__launch_bounds__\([^)]*\) (\w+)_(?:bf16|fp16|fp32)\(', text).group(1)
    hidden, threads = (int(re.search(rf"constexpr int {k} = (\d+);", text).group(1)) for k in ("H", "THREADS"))
    shared_partials = "/*SHARED_PARTIALS=*/true" in text
    shared = _declared_shared_bytes(source.parent.parent / "_kernels.py", name)
    rows = 0 if "l2norm" in name else 2 if "layernorm" in name else 1
    if shared_partials:
        assert shared == 4 * rows * hidden <= tuning.NORM_BWD_SHARED_BYTES
        min_blocks = int(re.search(r"constexpr int MIN_BLOCKS = (\d+);", text).group(1))
        assert min_blocks == (2 if threads <= 512 else 1)
        assert "__launch_bounds__(THREADS, MIN_BLOCKS)" in text
    else:
        assert shared is None and "__launch_bounds__(THREADS)" in text
        assert rows == 0 or 4 * rows * hidden > tuning.NORM_BWD_SHARED_BYTES


def test_every_layout_is_generated():
    """The fixture exists for the layouts the shipped specs do not reach."""
    texts = [source.read_text() for _, source in SOURCES]
    shared = [t for t in texts if "/*SHARED_PARTIALS=*/true" in t]
    assert any("/*SHARED_PARTIALS=*/false" in t and "l2norm" not in t.split("\n")[0] for t in texts)
    # past the 48 KB a launch gets without the runtime's opt-in: the partials' M * H * 4 bytes
    assert any((2 if "layernorm" in t.split("\n")[0] else 1) * 4 * int(re.search(r"constexpr int H = (\d+);", t).group(1))
               > 48 * 1024 for t in shared)
    assert any("constexpr int VEC = 2;" in t for t in shared)
