# Two commands: `make demo` trains a small model under a remat policy; `make test` runs the
# tests. Each creates .venv (Python >= 3.12, from PATH or pyenv) and installs on first use.

VENV := .venv
PY := $(VENV)/bin/python
# Reinstall only when the requirements or the package metadata change.
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-long

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml scripts/find_python.sh Makefile
	@if ! $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  python=$$(scripts/find_python.sh) || exit 1; \
	  echo "creating $(VENV) with $$python"; \
	  rm -rf $(VENV) && "$$python" -m venv $(VENV) || exit 1; \
	fi
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet -e '.[tpu]' --config-settings editable_mode=compat
	@touch $(STAMP)

demo: venv
	$(PY) -m experiments.train --config=experiments/configs/demo.py --workdir=runs/demo

# The tests run in TEST_WORKERS processes (pytest-xdist), one test module per
# process at a time, so a module's shared compiled fixtures are built once.
# The second run repeats the tests marked remat_modes under JAX's newer remat
# (jax_remat3); exit code 5 means none are marked yet, which is not a failure.
# Each prints its 15 slowest tests, so drift is seen. Compiled programs are cached
# in ~/.cache/remat_kit/jax-tests (tests/conftest.py), outside the checkout: a second
# `make test`, also in a fresh clone, compiles only what changed.
# Bytecode is written even where the environment says not to: each of the four
# worker processes of a run (two a pass) collects every test module, and pytest
# rewrites the asserts of a module it has no bytecode for (collection 8.6 -> 4.0
# CPU s per process).
TEST_WORKERS ?= 2
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=15

# lint-imports keeps the parts' order (pyproject.toml's contracts) and names a broken import.
# `make test` leaves out the tests marked long (15 s or more on a machine with no compile
# cache: tests/long_tests.txt); `make test-long` runs them, and CI (.ci/run) runs both.
test: venv
	$(VENV)/bin/lint-imports --no-cache
	$(PYTEST) -m "not long"
	JAX_REMAT3=1 $(PYTEST) -m "remat_modes and not long"; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]

test-long: venv
	$(PYTEST) -m long
	JAX_REMAT3=1 $(PYTEST) -m "remat_modes and long"; rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]
