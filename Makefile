# Two commands: `make repro` runs the whole pipeline, `make test` runs the tests.
# Both create the virtual environment first (idempotent).

VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# z-lab's reference DFlash wheel, downloaded and never installed (its import name is dflash too):
# tests load its model code to check that exports load and decode there (tests/zlab.py).
REFERENCE := $(VENV)/reference/dflash-0.1.0-py3-none-any.whl
# Stage commands in dvc.yaml call `python` and `torchrun`: put the venv first on PATH.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup repro test test-fast bytecode lint check-declaration bench clean

setup: $(STAMP) $(REFERENCE)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(REFERENCE): tests/reference.txt $(STAMP)
	$(BIN)/python -m pip download -q --no-deps --require-hashes -r tests/reference.txt -d $(@D)
	touch $@

repro: setup
	$(BIN)/dvc repro
	$(BIN)/dflash report

# Two pytest-xdist workers, a test file each at a time (its module fixtures built once).
# The tests start a few hundred Python processes (ranks, agents, stages): bytecode compiled
# once up front spares each of them compiling the package again where the environment
# forbids writing it (PYTHONDONTWRITEBYTECODE).
test: setup bytecode
	$(BIN)/pytest -q --durations=15 -n 2 --dist loadfile

test-fast: setup bytecode
	$(BIN)/pytest -q -m "not slow" -n 2 --dist loadfile

bytecode: setup
	$(BIN)/python -m compileall -q dflash stages bench tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# dvc repro on tiny params in a temporary copy; then each change must rerun exactly its stages.
check-declaration: setup
	$(BIN)/python tests/ci_declaration.py

bench: setup
	$(BIN)/python bench/plan_bench.py
	$(BIN)/python bench/tokenize_throughput.py
	$(BIN)/python bench/train_throughput.py

clean:
	rm -rf $(VENV) data/ingested data/regenerated data/tokenized data/stats data/plans \
		models checkpoints metrics plots wandb
