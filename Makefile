# Two commands do all the set-up on a fresh machine:
#   make demo   - create .venv, install ddpkit, train on the embedded dataset (one process per
#                 GPU, or 2 on a CPU machine)
#   make test   - create .venv, install ddpkit + test tools, run the whole test suite
#   (make check - the fast subset for the edit-test loop)
PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch for development and CI; users install ddpkit with any torch >= 2.4.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test check test-gpu test-multinode test-slurm slurm bench bench-quick peers horovod clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/ddpkit train --output runs/demo --overwrite

# Installs Slurm for its tests (root + apt-get), then the layering contracts (pyproject.toml,
# import-linter), then the whole suite, multi-node and real-Slurm tests included (they need root and `ip netns`; without them they
# skip, with the reason in the summary). pytest exits 5 when it collected nothing: that must
# fail, not pass silently.
#
# In two parts: the tests that bring up clusters of their own (network namespaces, Slurm, pods:
# marked `alone`, they load both cores and time their nodes' rounds) run by themselves; then
# the rest on 2 pytest workers at once (pytest-xdist; --dist loadfile keeps a file's tests and
# fixtures on one worker), as most of their time is processes starting and waiting. The last
# line counts the processes that imported torch and the CPU they spent on it
# (scripts/torch_imports.py): the suite's main cost, in a figure that does not move with the host.
test: $(VENV)/.installed $(VENV)/.horovod slurm
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/torch_imports.py start $(VENV)
	$(BIN)/python -m pytest -q -m alone; alone=$$?; \
	$(BIN)/python -m pytest -q -m "not alone" -n 2 --dist loadfile; rest=$$?; \
	$(BIN)/python scripts/torch_imports.py report $(VENV); \
	for rc in $$alone $$rest; do \
		if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; done; \
	if [ $$alone -ne 0 ]; then exit $$alone; fi; exit $$rest

# The edit-test loop (a few minutes on 2 cores): the layering, then every test not marked slow,
# multinode or gpu; `make test` runs them all, and is what CI runs.
check: $(VENV)/.installed
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/torch_imports.py start $(VENV)
	$(BIN)/python -m pytest -q -m "not slow and not multinode and not gpu"; rc=$$?; \
	$(BIN)/python scripts/torch_imports.py report $(VENV); \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Only the tests that need a CUDA GPU (marked `gpu`; `make test` runs them too where CUDA is
# present). Without a GPU they skip with the reason. Every other test pins itself to CPU + gloo.
test-gpu: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m gpu; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Only the multi-node tests: several "machines" as Linux network namespaces (root), 2.5-4 min.
test-multinode: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m multinode; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Debian's slurm-wlm + munge for the real-Slurm tests (tests/test_slurm.py bring up a private
# two-node cluster of their own and remove it). Root and apt-get: ~10 s the first time. Without
# root or apt-get the Slurm tests skip with the reason; in CI (CI=true) a failed install fails.
slurm:
	@bash scripts/install_slurm.sh; rc=$$?; \
	if [ $$rc -eq 1 ] && [ "$$CI" = "true" ]; then echo "error: installing slurm-wlm/munge failed (see above)" >&2; exit 1; \
	elif [ $$rc -ne 0 ]; then echo "warning: no Slurm here; tests/test_slurm.py will be skipped" >&2; fi

# Only the real-Slurm tests (about 2 min).
test-slurm: $(VENV)/.installed slurm
	$(BIN)/python -m pytest -q tests/test_slurm.py; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Horovod 0.28.1 built from source against this torch (the optional `--engine horovod`
# and the bench's horovod row): ~4-7 min the first time, then the wheel cached in
# ~/.cache/ddpkit is reused. In CI (CI=true) a failed build fails; elsewhere it only warns and
# the Horovod tests skip with the reason.
$(VENV)/.horovod: scripts/build_horovod.sh | $(VENV)/.installed
	@if bash scripts/build_horovod.sh $(BIN)/python; then :; \
	elif [ "$$CI" = "true" ]; then echo "error: building horovod failed (see above)" >&2; exit 1; \
	else echo "warning: horovod did not build; its tests and bench row will be skipped" >&2; fi
	touch $@

horovod: $(VENV)/.installed
	bash scripts/build_horovod.sh $(BIN)/python
	touch $(VENV)/.horovod

$(VENV)/.plot: | $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[plot]"
	touch $@

bench: $(VENV)/.plot
	$(BIN)/ddpkit bench --output bench-out

bench-quick: $(VENV)/.plot
	$(BIN)/ddpkit bench --quick --output bench-out

# The same workload as a hand-written DDP loop, ddpkit, Accelerate and Lightning Fabric, all
# built in one job per round with their steps alternating (installs the `peers` extra:
# accelerate, lightning). About 10 minutes on 2 cores.
peers: $(VENV)/.installed
	$(BIN)/pip install --quiet -e ".[peers]"
	$(BIN)/python benchmarks/peers/run_peers.py --interleave --rounds 4 --steps 6 --output peers-out

clean:
	rm -rf $(VENV) runs bench-out peers-out .pytest_cache
