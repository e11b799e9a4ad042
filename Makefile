# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv and install ember into it first. torch is pinned so that pip takes
# the CPU build instead of pulling several GB of CUDA packages; on a GPU machine, install
# the CUDA build of torch >= 2.11 first and `pip install -e .` keeps it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
RUN    := runs/demo-$(shell date +%Y%m%d-%H%M%S)
# Test processes (pytest-xdist); 0 runs the suite in this one process.
TEST_WORKERS ?= 2

.PHONY: install test demo bench clean-demo

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15

data/stdlib.jsonl: | install
	$(BIN)/ember data corpus --out $@

data/demo/manifest.json: data/stdlib.jsonl
	$(BIN)/ember data prepare data/stdlib.jsonl --out data/demo --tokenizer bpe --vocab-size 4096 --seq-len 128

demo: install data/demo/manifest.json
	$(BIN)/ember train configs/tiny-gpt.toml --data data/demo --out $(RUN)
	$(BIN)/ember report $(RUN)

bench: install
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	$(BIN)/python benchmarks/vs_transformers.py --device auto
