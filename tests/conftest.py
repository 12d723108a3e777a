import importlib.util
import sys
from pathlib import Path

# The repository root (for `generated`) and tests/ (for helpers).
ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _map_checkout_as_fusegen() -> None:
    """In a checkout that is not pip-installed (the GPU machine has no setuptools step), import
    the folders under the names pyproject.toml maps them to: generator/ as fusegen, fusion_rules/
    and templates/ as its subpackages. An installed fusegen is used as it is."""
    if importlib.util.find_spec("fusegen") is not None:
        return
    for name, folder in (("fusegen", "generator"), ("fusegen.templates", "templates"),
                         ("fusegen.fusion_rules", "fusion_rules")):
        init = ROOT / folder / "__init__.py"
        spec = importlib.util.spec_from_file_location(name, init if init.is_file() else None,
                                                      submodule_search_locations=[str(ROOT / folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        if spec.loader is not None:
            spec.loader.exec_module(module)


_map_checkout_as_fusegen()
