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

# The plugin fixture (tests/fixtures/plugin_project) is a second project with its own package.
PLUGIN_PROJECT := tests/fixtures/plugin_project

generate: $(SETUP)  ## regenerate generated/ from specs/ (reuses binaries whose sources did not change)
	$(VENV)/bin/fusegen generate
	cd $(PLUGIN_PROJECT) && $(CURDIR)/$(VENV)/bin/fusegen generate

rebuild: $(SETUP)  ## regenerate generated/, recompiling every kernel from scratch
	$(VENV)/bin/fusegen generate --rebuild
	cd $(PLUGIN_PROJECT) && $(CURDIR)/$(VENV)/bin/fusegen generate --rebuild

check: $(SETUP)  ## fail and show a diff if generated/ (or the plugin fixture's package) is stale
	$(VENV)/bin/fusegen generate --check
	cd $(PLUGIN_PROJECT) && $(CURDIR)/$(VENV)/bin/fusegen generate --check

# The compiler needs no torch: --check from a virtual environment that has none.
check-without-torch:
	$(PYTHON) -m venv .venv-notorch
	.venv-notorch/bin/python -m pip install -q -e .
	.venv-notorch/bin/python -c "import importlib.util, sys; sys.exit('torch is installed' if importlib.util.find_spec('torch') else 0)"
	.venv-notorch/bin/fusegen generate --check
	cd $(PLUGIN_PROJECT) && $(CURDIR)/.venv-notorch/bin/fusegen generate --check

test: $(SETUP)  ## CPU tests (no GPU needed)
	$(PY) -m pytest -q

test-gpu:  ## GPU tests; needs only torch and cuda-bindings (run on a CUDA machine)
	$(PYTHON) -m pytest -q -m cuda tests

bench: $(SETUP)  ## GPU: fusegen's kernels against eager PyTorch, torch.compile and Liger-Kernel over a sweep of sizes (bench/results/<gpu>.md)
	cd bench && $(CURDIR)/$(VENV)/bin/fusegen generate
	$(PY) bench/bench_kernels.py

clean:
	rm -rf $(VENV) .venv-notorch *.egg-info .pytest_cache
	find . -name __pycache__ -prune -exec rm -rf {} +
