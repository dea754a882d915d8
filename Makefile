# `make demo` and `make test` each set up .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export TF_CPP_MIN_LOG_LEVEL ?= 2

.PHONY: install demo lint test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

# Two workers: the tests that share an expensive session fixture stay on one (conftest.py).
TEST_WORKERS ?= 2

# Style, checked by a tool (configuration in pyproject.toml); `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The backend-neutral core on JAX (tests/backends) runs in a process of its own, launched by
# tests/test_other_backend.py beside the rest (Keras fixes the backend at import).
test: $(STAMP) lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

# The benchmarks, each into results/NAME.json (scripts/harness.py). Multi30k comes from
# $MULTI30K_DIR, ../shared/data/multi30k beside the clone, or the download cache.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python scripts/bench_attention.py
	$(BIN)/python scripts/bench_fused_attention.py
	$(BIN)/python scripts/bench_decoding.py
	$(BIN)/python scripts/bench_train.py
	@model=$$(ls runs/multi30k/averaged.keras runs/multi30k/member-0/averaged.keras 2>/dev/null | head -1); \
	if [ -n "$$model" ]; then $(BIN)/python scripts/bench_serving.py --model "$$model"; \
	else echo "bench_serving: skipped (needs the recipe's model: scripts/reproduce_multi30k.sh)"; fi

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
