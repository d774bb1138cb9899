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

# the onnx extra and jax2onnx without its dependencies (pyproject.toml says why)
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test,onnx]'
	$(BIN)/pip install -q --no-deps jax2onnx==0.17.1
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m r1jax.train --config configs/demo.yaml
	@echo "--- a sample from the model just trained (python -m r1jax.generate --model runs/demo ...):"
	$(BIN)/python -m r1jax.generate --model runs/demo --prompt "def read_config(path):" \
		--max-new-tokens 64 --temperature 0.7 --top-p 0.95 --seed 0 --speculative

# One pytest run over two workers, each taking whole files. Files start longest first (durations
# measured in `make test`; a file not listed starts after them; `make check` keeps the order), so
# that no worker is left running a long file alone at the end. tests/conftest.py sets which
# files compile with XLA's backend at -O0.
LONGEST_FIRST := tests/test_mesh.py tests/test_multiprocess.py tests/test_grpo.py tests/test_storage_faults.py \
	tests/test_step.py tests/test_train.py tests/test_pipeline_outside.py tests/test_lora.py tests/test_moe_alltoall.py tests/test_slurm.py \
	tests/test_bench.py tests/test_plan.py tests/test_guard.py tests/test_zero1.py tests/test_run_records.py \
	tests/test_checkpoint.py tests/test_generator.py tests/test_faults.py tests/test_generate.py tests/test_kd.py \
	tests/test_generate_cli.py tests/test_attention.py tests/test_serve.py tests/test_export.py tests/test_quant.py \
	tests/test_convert.py tests/test_mtp.py tests/test_moe_dispatch.py \
	tests/test_train_monitoring.py tests/test_parity.py tests/test_bench_memory.py tests/test_distill.py \
	tests/test_train_parity.py tests/test_sampling.py tests/test_plain_nnx.py tests/test_bench_tables.py
TEST_FILES := $(LONGEST_FIRST) $(filter-out $(LONGEST_FIRST),$(sort $(wildcard tests/test_*.py)))

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 $(TEST_FILES)

check: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" --durations=10 $(TEST_FILES)
