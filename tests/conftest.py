import importlib.util
import os
import sys
from pathlib import Path

import pytest

# Before torch allocates anything: torch's CPU allocator asks for transparent huge pages for
# buffers of 2 MB and more (read once, at its first allocation). The float64 references of the
# large pipelines allocate and free tens of GB over the run; in 4 KB pages that was 17M page
# faults and a third of the suite's time in the kernel (`make test` 211 -> 187 s, same machine).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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


def _a_share_of_the_cores() -> None:
    """Under pytest-xdist (`make test` runs a worker per core) each worker's torch takes its share
    of the cores, not all of them: two workers on two cores would otherwise run four intra-op
    threads through the float64 references of the large pipelines."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_a_share_of_the_cores()


@pytest.fixture(autouse=True)
def _compile_each_job_once(request, monkeypatch):
    """NVRTC jobs repeated across tests come from this session's memo (compile_memo.py), except in
    tests marked real_nvrtc."""
    jobs = sys.modules.get("fusegen.toolchain.jobs")  # imported by every test that builds (not on a GPU-only run)
    if jobs is not None and request.node.get_closest_marker("real_nvrtc") is None:
        import compile_memo

        monkeypatch.setattr(jobs, "run_compiles", compile_memo.remembering(jobs.run_compiles))


def pytest_collection_finish(session):
    """What is alive once the tests are collected (torch, libcst, every test module) lives for the
    whole run: moved out of the garbage collector's reach, so its full collections scan only what
    the tests allocate (its time in a run's two workers: 7.9 -> 6.8 s)."""
    import gc

    gc.collect()
    gc.freeze()
