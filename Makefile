# `make train` and `make test` do all the set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pipetrain-installed

.PHONY: train test lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch first (it lies on the machine's disk); a plain `torch`
	# could fetch a multi-GB CUDA build. Skip when a torch is already installed.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	# tcmalloc is a system package (README, "Planning a split"): say whether CPU runs
	# will preload it.
	@$(PY) -c "from pipetrain.heap import setup_line; print(setup_line())"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/pipetrain train

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy pipetrain

test: lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
