"""The output's runtime as a package of modules by subject (templates/runtime/, copied into each
output as _runtime/): no import circle, no module over ~300 lines, and its __init__ re-exports
every name a generated module imports from it."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "templates" / "runtime"
# each module may import only those before it (so no circle): the order __init__'s docstring gives
ORDER = ["loading", "launch", "te_forms", "checks", "capture", "training_graphs", "module_helpers", "row_blocks", "graphs", "custom_ops",
         "compiled_passes", "fp8_recipes", "fp8_autocast", "fp8_state", "fp8_casts", "fp8",
         "collectives", "tensor_parallel"]
MAX_LINES = 300


def _imported_siblings(path):
    """The runtime modules ``path`` imports (``from .x import ...``)."""
    tree = ast.parse(path.read_text())
    return {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}


def test_the_runtime_is_the_modules_of_its_order_and_nothing_else():
    assert sorted(p.stem for p in RUNTIME.glob("*.py")) == sorted(["__init__", *ORDER])


@pytest.mark.parametrize("name", ORDER)
def test_a_runtime_module_imports_only_those_before_it(name):
    earlier = set(ORDER[:ORDER.index(name)])
    assert _imported_siblings(RUNTIME / f"{name}.py") <= earlier


@pytest.mark.parametrize("name", ["__init__", *ORDER])
def test_a_runtime_module_stays_small(name):
    assert len((RUNTIME / f"{name}.py").read_text().splitlines()) <= MAX_LINES


def test_init_exports_every_name_the_generated_modules_import():
    """Every ``from ._runtime import ...`` of the shipped and the fixture packages is in
    ``__all__``, and ``__all__`` names only what the package defines."""
    imported = set()
    sources = [*ROOT.glob("generated/*.py"), *ROOT.glob("tests/fixtures/*/*/*.py")]
    assert len(sources) > 40
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "_runtime" and node.level == 1:
                imported.update(alias.name for alias in node.names)
    assert {"Kernel", "pointer", "CudaGraphs", "check_input", "replay_forward", "register_op"} <= imported
    from fusegen.templates import runtime

    assert imported <= set(runtime.__all__)
    assert all(hasattr(runtime, name) for name in runtime.__all__)
