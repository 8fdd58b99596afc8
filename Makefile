# `make train` and `make test` each create .venv on a fresh machine and install what they need
# once: a stamp file in .venv records each install and is redone only when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
# `make train` replaces its own earlier run in its --out (stepgraph train refuses an --out
# that holds a run otherwise), with or without TRAIN_ARGS: --overwrite is part of the recipe,
# not of the overridable TRAIN_ARGS, so `make train TRAIN_ARGS="--model cnn"` runs twice too.
# A TRAIN_ARGS with --resume continues the run instead (the two flags exclude each other).
TRAIN_ARGS ?=
OVERWRITE = $(if $(filter --resume,$(TRAIN_ARGS)),,--overwrite)
PYTEST_ARGS ?= -q

.PHONY: train test clean

train: $(VENV)/.stamp-train
	$(VENV)/bin/stepgraph train $(OVERWRITE) $(TRAIN_ARGS)

test: $(VENV)/.stamp-test
	$(VPY) -m pytest $(PYTEST_ARGS)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# The cuda extra only where a GPU answers, and then the kernel cache filled once per install
# (stepgraph precompile), so the first run starts warm; plain `-e .` runs everything on the CPU.
$(VENV)/.stamp-train: pyproject.toml | $(VPY)
	if nvidia-smi >/dev/null 2>&1; then $(PIP) install -e ".[cuda]" && \
	    { $(VENV)/bin/stepgraph precompile --quiet || echo "kernel precompile skipped"; }; \
	else $(PIP) install -e .; fi
	touch $@

$(VENV)/.stamp-test: pyproject.toml | $(VPY)
	$(PIP) install -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
