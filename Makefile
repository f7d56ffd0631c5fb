# difrl: `make demo` trains the bundled digits world, `make test` runs the suite.
# Both create .venv (and install difrl into it, editable) when it is missing or stale.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.difrl-installed

.PHONY: venv demo test test-fast bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/difrl train configs/digits.yaml --overwrite

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/bench_rollout.py

clean:
	rm -rf runs .pytest_cache
