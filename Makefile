# Two entry points: `make demo` (main job) and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-slow test-cluster bench fuzz conformance clean

$(STAMP): requirements.txt pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m graphmode demo

test: $(STAMP)     # OpenMP's wait bounded as the graphmode command bounds it (graphmode/openmp.py): kernels build claim
	HF_HUB_OFFLINE=1 GOMP_SPINCOUNT=$${GOMP_SPINCOUNT:-1000} $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m slow

# the robustness sweep (docs/robustness.md): bounded, seeded; a CI-sized sample runs in `make test`
fuzz: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m graphmode.fuzz $(FUZZ_ARGS)

# Ray Serve replicas (the serve-cluster extra, not in the default install): local Ray clusters, ~8 min on 2 cores
test-cluster: $(STAMP)
	$(BIN)/pip install -q -r requirements-cluster.txt
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m cluster tests/e2e/test_serve_cluster.py

bench: $(STAMP)
	$(BIN)/pip install -q -r requirements-bench.txt
	HF_HUB_OFFLINE=1 $(BIN)/python -m graphmode bench

# the external suites, full runs (not part of `make test`, which runs a sample); tables in docs/conformance.md
conformance: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m graphmode conformance onnx --jobs 2 --out build/conformance --publish docs/conformance.md
	HF_HUB_OFFLINE=1 $(BIN)/python -m graphmode conformance opinfo --jobs 2 --out build/conformance --publish docs/conformance.md

clean:
	rm -rf $(VENV) .pytest_cache
