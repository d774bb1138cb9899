# `make demo`, `make test` (the whole suite; what CI runs) and `make check` (the fast tier: unit
# and parity tests, a few minutes). Each creates .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test check venv

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m r1jax.train --config configs/demo.yaml
	@echo "--- a sample from the model just trained (python -m r1jax.generate --model runs/demo ...):"
	$(BIN)/python -m r1jax.generate --model runs/demo --prompt "def read_config(path):" \
		--max-new-tokens 64 --temperature 0.7 --top-p 0.95 --seed 0 --speculative

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

check: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=10
