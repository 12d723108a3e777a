# fusegen: every target sets up what it needs (a virtual environment in .venv) by itself.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SETUP := $(VENV)/.setup-done

.PHONY: setup generate rebuild check check-without-torch test test-gpu bench clean

setup: $(SETUP)

# torch is reused from the system when present; otherwise the CPU build 2.13.0 is installed
# (the package itself never pins torch).
$(SETUP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(SETUP)

# The test fixtures are projects with their own packages, checked in like generated/: a user's
# project with a plugin, norms wider than the shipped specs' (for the GPU tests), and a plugin that
# adds a kernel family of its own.
FIXTURE_PROJECTS := tests/fixtures/plugin_project tests/fixtures/wide_norms tests/fixtures/family_project

generate: $(SETUP)  ## regenerate generated/ from specs/ (reuses binaries whose sources did not change)
	$(VENV)/bin/fusegen generate
	for project in $(FIXTURE_PROJECTS); do (cd $$project && $(CURDIR)/$(VENV)/bin/fusegen generate) || exit 1; done

rebuild: $(SETUP)  ## regenerate generated/, recompiling every kernel from scratch
	$(VENV)/bin/fusegen generate --rebuild
	for project in $(FIXTURE_PROJECTS); do (cd $$project && $(CURDIR)/$(VENV)/bin/fusegen generate --rebuild) || exit 1; done

check: $(SETUP)  ## fail and show a diff if generated/ (or a test fixture's package) is stale
	$(VENV)/bin/fusegen generate --check
	for project in $(FIXTURE_PROJECTS); do (cd $$project && $(CURDIR)/$(VENV)/bin/fusegen generate --check) || exit 1; done

# The compiler needs no torch: --check from a virtual environment that has none.
check-without-torch:
	$(PYTHON) -m venv .venv-notorch
	.venv-notorch/bin/python -m pip install -q -e .
	.venv-notorch/bin/python -c "import importlib.util, sys; sys.exit('torch is installed' if importlib.util.find_spec('torch') else 0)"
	.venv-notorch/bin/fusegen generate --check
	for project in $(FIXTURE_PROJECTS); do (cd $$project && $(CURDIR)/.venv-notorch/bin/fusegen generate --check) || exit 1; done

# One pytest-xdist worker per core (at most 4: each holds torch and up to 2 GB of a large
# pipeline's test); workers steal queued tests from each other, so a long test never ends a run alone.
# `make test TEST_ARGS="-n 0"` (or any pytest arguments) adds to or overrides them.
test: $(SETUP)  ## CPU tests (no GPU needed)
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist worksteal $(TEST_ARGS)

test-gpu:  ## GPU tests; needs only torch and cuda-bindings (run on a CUDA machine)
	$(PYTHON) -m pytest -q -m cuda tests

bench: $(SETUP)  ## GPU: fusegen's kernels against eager PyTorch, torch.compile and Liger-Kernel over a sweep of sizes (bench/results/<gpu>.md)
	cd bench && $(CURDIR)/$(VENV)/bin/fusegen generate
	$(PY) bench/bench_kernels.py

clean:
	rm -rf $(VENV) .venv-notorch *.egg-info .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
