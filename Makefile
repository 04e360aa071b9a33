# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install ddpkit, train on the embedded dataset with 2 processes
#   make test   - create .venv, install ddpkit + test tools, run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch for development and CI; users install ddpkit with any torch >= 2.4.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-multinode bench bench-quick horovod clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/ddpkit train --output runs/demo

# pytest exits 5 when it collected nothing: that must fail, not pass silently.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m "not multinode"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Several "machines" as Linux network namespaces (needs root); still being hardened (issue 6).
test-multinode: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m multinode

bench: $(VENV)/.installed
	$(BIN)/ddpkit bench --output bench-out

bench-quick: $(VENV)/.installed
	$(BIN)/ddpkit bench --quick --output bench-out

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache
