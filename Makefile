# Quick start: `make demo` (main job on the real Azure trace) and `make test` (the test suite).
# Each target creates the local virtual environment .venv by itself on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: `make demo` needs only the runtime dependencies (`pip install .`: the scripted model,
# no torch), as do the benchmarks; `make test` adds the test extra (pytest, pytest-xdist, and torch
# for the torch tests).
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

DEMO_TRACE := out/azure-code-500.parquet
AZURE_CODE := ../shared/data/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv

.PHONY: demo test bench bench-check bench-vllm clean

$(STAMP): pyproject.toml
	@echo "setting up $(VENV): the package and its dependencies (about 1 min the first time)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "setting up $(VENV): the test extra (pytest, pytest-xdist, torch CPU; about 2 min the first time)"
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

demo: $(STAMP)
	@mkdir -p out
	$(BIN)/harness record $(AZURE_CODE) --limit 500 --time-scale 30 --seed 0 \
		--set num_gpu_blocks=600 --set max_num_seqs=64 --set max_num_batched_tokens=2048 \
		--set max_model_len=8192 -o $(DEMO_TRACE)
	$(BIN)/harness replay $(DEMO_TRACE)

# pytest-xdist workers for `make test` (`make test TEST_WORKERS=0` runs in one process); which
# modules share a worker (the vLLM ones) is decided in tests/conftest.py.
TEST_WORKERS ?= auto

# First the vLLM environments the vllm-marked tests use, one progress line each (tests/prepare_envs.py;
# HARNESS_SKIP_VLLM=1 skips them: the fast tier). Then pytest, under the reaper shim (harness/children.py:
# a Ctrl-C leaves no process of the run behind); `-v` undoes pyproject's `-q` once, so pytest-xdist
# prints the worker and test counts ("2 workers [1213 items]") and a dot per test.
test: $(TEST_STAMP)
	@$(BIN)/python tests/prepare_envs.py
	@echo "pytest -n $(TEST_WORKERS): the test count shows once the workers have collected the suite"
	$(BIN)/python -m harness.children -- $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -v; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected (exit 5), treated as success"; exit 0; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python bench/bench_reference.py

bench-check: $(STAMP)
	$(BIN)/python bench/bench_check.py

bench-vllm: $(STAMP)
	$(BIN)/harness vllm-env 0.33.0
	$(BIN)/python bench/bench_vllm.py

clean:
	rm -rf out $(VENV)
