# zckpt developer loop. Every target that runs code depends on `setup`, which builds .venv/ once
# (and again only when pyproject.toml or constraints.txt change), with the dev tools (the `dev` extra).
# A user install has no target here: `pipx install .` or `pip install .` (README §Install) already puts
# the command where pip/pipx put every tool, into the environment the user chose.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
DSVENV    := .venv-ds
DSSTAMP   := $(DSVENV)/.installed
DEMO_WORLD ?= 4
# pytest-xdist workers for `make test`: one per CPU this process may use (nproc follows the CPU affinity), plus
# one for the time tests spend waiting on subprocesses, sleeps and servers (2-core fresh clone: pytest 877 s
# with 2 workers, 811 s with 3). The two 3-worker runs that failed the interrupted-upload tests were started
# with SIGINT ignored, not too loaded: tests/conftest.py now gives SIGINT back to every test process.
TEST_JOBS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 1 )))
export DS_BUILD_OPS := 0
# Where torch puts the ops DeepSpeed compiles (torch's default, ~/.cache/torch_extensions, is shared by every
# checkout, and a checkout at another path recompiles them there).
export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(DSVENV)/torch_extensions
# The tests start hundreds of Python processes; without bytecode caches each one compiles zckpt (and, as
# the venvs are installed with --no-compile, torch) again. A caller's PYTHONDONTWRITEBYTECODE stays out.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup venvs test test-fast test-dist lint demo fixtures bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --no-compile -c constraints.txt -e '.[dev]' --config-settings editable_mode=compat
	# `import deepspeed` is the engine only under `python -m engine.run` (engine/run.py); remove the .pth
	# that older setups wrote (it made every process of this venv see the engine as deepspeed).
	$(VPY) -c 'import sysconfig, pathlib; pathlib.Path(sysconfig.get_path("purelib"), "engine-deepspeed-alias.pth").unlink(missing_ok=True)'
	touch $(STAMP)

# Both venvs at once when missing (pip waits on the network and the disk more than on a CPU).
venvs:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(DSSTAMP)

# Every test, and the layer contracts (pyproject [tool.importlinter]): what CI runs (.ci/run). Builds the
# real-DeepSpeed venv first when missing: the `deepspeed` tests use it as their oracle and fail without it.
# Tests run on $(TEST_JOBS) pytest-xdist workers, a test file to one worker, the files with slow tests first;
# tests marked `serial` run alone (tests/_xdist.py). Only the CUDA tests may skip (tests/conftest.py: any
# other skip fails the run); pytest's exit 5 (nothing collected) fails it too.
test: venvs
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder tests

# The quick loop (< 60 s on 2 cores): no multi-rank spawns, nothing marked slow, no real DeepSpeed.
test-fast: setup
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q -m "not dist and not slow and not deepspeed" tests

test-dist: setup
	$(VPY) -m pytest -q -m "dist and not deepspeed" tests

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check zckpt engine tests bench fixtures docs
	$(VENV)/bin/mypy

demo: setup
	bash docs/demo/run.sh $(DEMO_WORLD)

# Real DeepSpeed lives only in this separate dev venv; zckpt never imports it. CPU only: DS_BUILD_OPS=0
# (exported above) builds no DeepSpeed op; the stamp is written only once the install succeeded.
$(DSSTAMP): requirements-ds.txt
	test -x $(DSVENV)/bin/python || $(PY) -m venv $(DSVENV)
	$(DSVENV)/bin/pip install -q --no-compile -r requirements-ds.txt
	# DeepSpeed compiles its CPU ops on first use: here, not inside a test's time limit while another test
	# waits on the build lock. The ops the tests load: CPU Adam (optimizer offload) and the shared-memory comm
	# (every gloo run). FusedAdam (a config optimizer without offload) is loaded by no test (its folder was
	# untouched through whole runs) and was 40 s of this step's 113 s on a 2-core fresh clone: not built here;
	# if a test ever loads it, DeepSpeed builds it then.
	DS_ACCELERATOR=cpu $(DSVENV)/bin/python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder, \
	  ShareMemCommBuilder; [b().load() for b in (CPUAdamBuilder, ShareMemCommBuilder)]'
	touch $(DSSTAMP)

fixtures: $(DSSTAMP)
	$(DSVENV)/bin/python fixtures/make_fixtures.py

# Sections appended to bench/RESULTS.md: every group with a warm page cache (the engine group included:
# plain PyTorch, the engine and DeepSpeed at world 2 on CPU/gloo), then consolidate and scale (DeepSpeed's
# converters included) with caches dropped before every run (drop_caches: needs root), then consolidate
# from a local S3 server against download-then-consolidate: moto, and s3rver where npm is installed.
bench: setup $(DSSTAMP)
	$(VPY) bench/run.py
	$(VPY) bench/run.py --cache cold --only consolidate scale --repeat 1 --ds-repeat 1 --no-build
	$(VPY) bench/s3_bench.py --server moto --input bench/data/gpt100m_z3_w2 --append bench/RESULTS.md
	if command -v npm >/dev/null; then $(VPY) bench/s3_bench.py --server s3rver \
	  --input bench/data/gpt100m_z3_w2 --append bench/RESULTS.md; fi

clean:
	rm -rf $(VENV) $(DSVENV)
	if [ -f demo-out/.zckpt-demo ]; then rm -rf demo-out; fi
