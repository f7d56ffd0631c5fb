# difrl: `make demo` trains the bundled digits world, `make test` runs the suite, `make docs` builds the site into site/.
# Each creates .venv (and installs difrl into it, editable, with the dev and docs extras) when it is missing or stale.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.difrl-installed

.PHONY: venv demo test test-fast bench docs clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[dev,docs]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/difrl train configs/digits.yaml --overwrite

# the suite on JOBS pytest-xdist workers (one thread each), every file's tests on one worker so a module's trained
# runs are made once (tests/conftest.py); JOBS=0 runs it in this one process
JOBS ?= 2
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile --durations=15

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(JOBS) --dist loadfile -m "not slow"

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_rollout.py

# the documentation site (mkdocs.yml): strict, so a broken link, a page left out of the navigation or a docstring
# reference that does not resolve fails it; NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf runs .pytest_cache site
