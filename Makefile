# The README's two commands: `make demo` and `make test`. Each does all the set-up it needs on a fresh
# Linux machine with Rust and Python >= 3.10: a virtual environment in .venv (reusing packages the
# system Python already has, such as a multi-GB torch), the abi3 wheel built by maturin, torch
# (scripts/install_torch.py: on a machine without a GPU, torch's CPU build from torch's own index;
# GRADWIRE_TORCH=auto|cpu|cuda|keep chooses), and the other Python dependencies from PyPI. Each step
# says what it does; the long ones (the cargo build, the downloads) print a line per crate or file.

# bash: the dependency install below filters pip's output and must keep pip's exit status (pipefail).
SHELL := /bin/bash

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

# PyPI's CDN sometimes cuts a multi-hundred-MB wheel (torch's CUDA dependencies, triton) short: pip
# resumes a cut download many times before giving up, and the dependency install below is retried as a
# whole (wheels already downloaded come from pip's cache on the next try).
export PIP_RESUME_RETRIES ?= 50
export PIP_RETRIES ?= 10
export PIP_TIMEOUT ?= 60
PIP_TRIES ?= 3

.PHONY: architecture docs-tables demo test lint test-rust test-python wheel install dev release bench reliability wan fuzz fuzz-smoke fuzz-cmin clean gpu-wheels

# maturin goes into the venv even when the system already has it: `wheel` runs the venv's own copy.
$(VENV)/.created:
	@echo "==> .venv: a virtual environment that reuses the system Python's packages"
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --ignore-installed "maturin>=1.5,<2"
	touch $@

# Build the one abi3 wheel (cp310-abi3: loads on every CPython >= 3.10) and install it with its extras.
wheel: $(VENV)/.created
	@echo "==> the Rust core and its Python module: cargo build --release through maturin (a line per crate; a few minutes the first time on 2 cores)"
	rm -rf dist
	$(VENV)/bin/maturin build --release -o dist
	@ls dist/*.whl | grep -q 'cp310-abi3' || (echo "wheel is not abi3: $$(ls dist)"; exit 1)

# One pip command: the wheel with its extras and the server from ./server (gradwire-server, which the
# `apps` extra names, is not on PyPI: pip takes it from the path).
install: wheel
	$(PIP) install -q --force-reinstall --no-deps dist/*.whl
	@echo "==> torch (scripts/install_torch.py; GRADWIRE_TORCH=auto|cpu|cuda|keep)"
	PIP_TRIES=$(PIP_TRIES) $(PY) scripts/install_torch.py
	@echo "==> gradwire's other dependencies from PyPI and the server from ./server (a line per download)"
	@set -o pipefail; for try in $$(seq 1 $(PIP_TRIES)); do \
	  $(PIP) install --progress-bar on "$$(ls dist/*.whl)[apps,test,bench,torchft]" ./server 2>&1 \
	    | { grep -v '^Requirement already satisfied' || true; } && exit 0; \
	  echo "pip install failed (try $$try of $(PIP_TRIES)); retrying"; sleep 10; \
	done; exit 1

# Release files in dist/release: the abi3 wheel for manylinux2014 (glibc >= 2.17: it installs on older
# distributions than `make wheel`'s manylinux_2_34 one; built with zig as the linker, ziglang from PyPI),
# and the sdists of both packages (gradwire, gradwire-server).
release: $(VENV)/.created
	$(PIP) install -q "ziglang" "build>=1"
	rm -rf dist/release
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/maturin build --release --quiet --zig --compatibility manylinux2014 -o dist/release
	$(VENV)/bin/maturin sdist -o dist/release
	$(PY) -m build --sdist --outdir dist/release server
	@ls dist/release

# Editable install for development: Python edits are live, Rust edits need `make dev` again.
dev: $(VENV)/.created
	PIP_TRIES=$(PIP_TRIES) $(PY) scripts/install_torch.py
	$(PIP) install -q -e ".[apps,test,bench,torchft]" -e ./server

# Style, checked by machine (CI runs this before the tests): ruff's lint and formatter for Python (settings
# in pyproject.toml), rustfmt and clippy with warnings as errors for the Rust crates (the fuzz crate's
# format too). ruff is pinned: a new release may format differently, and CI must not fail on its own.
RUFF_VERSION ?= 0.17.6
lint: $(VENV)/.created
	@$(VENV)/bin/ruff --version 2>/dev/null | grep -q "$(RUFF_VERSION)" || $(PIP) install -q --ignore-installed "ruff==$(RUFF_VERSION)"
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cargo fmt --all --check
	cargo fmt --check --manifest-path rust/core/fuzz/Cargo.toml
	cargo clippy --workspace --all-targets --quiet -- -D warnings

demo: install
	$(VENV)/bin/gradwire demo

# docs/ARCHITECTURE.md's generated parts (the library table's import column and row order, the floors, the
# data-path sketch) rewritten from the code; it reads the sources only (no install needed). Run it after
# adding, removing or re-importing a library module; a new module's row (what it owns) is written by hand.
architecture:
	$(PYTHON) scripts/architecture.py

# The README's and the tutorial's printed outputs rewritten from a run of today's code (scripts/docs_tables.py:
# the demo's table, the two quick starts' output): rerun after anything that changes their figures, and commit
# the documents. About 3 minutes on 2 idle cores (the demo is most of it).
docs-tables: install
	$(PY) scripts/docs_tables.py

test-rust:
	cargo test --workspace --exclude gradwire-python --quiet

test-python: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=30 tests

test: test-rust test-python

bench: install
	$(PY) bench/kernels.py
	$(PY) bench/dct_codec.py
	$(PY) bench/server_rounds.py
	$(PY) bench/gcomp_levels.py --speed-only
	$(PY) bench/codecs.py
	$(PY) bench/dct_indices.py
	$(PY) bench/model_record.py
	$(PY) bench/gcomp_levels.py
	$(PY) bench/ddp.py
	$(PY) bench/convergence.py

# About 30 minutes here: every reliability probe at full size, and docs/results/reliability.md rewritten from the results.
reliability: install
	$(PY) -m bench.reliability

# Time to loss over an emulated WAN (needs root: network namespaces, tc, a TUN delay line); about an hour on
# 2 shared cores. Writes docs/results/wan.md and docs/results/wan.png.
wan: install
	$(PY) bench/wan.py

# The cargo-fuzz targets of rust/core/fuzz (rust/core/fuzz/fuzz.sh installs cargo-fuzz and a toolchain
# if absent). `make fuzz`: every target for FUZZ_SECONDS (FUZZ_RUNS executions, if set, end it sooner),
# results in rust/core/fuzz/results.json; `make fuzz-smoke`: a few seconds of each (CI); `make fuzz-cmin`:
# what the runs found merged into the checked-in corpora, minimized.
FUZZ_SECONDS ?= 600
FUZZ_SMOKE_SECONDS ?= 2

fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) rust/core/fuzz/fuzz.sh run

fuzz-smoke:
	FUZZ_SMOKE_SECONDS=$(FUZZ_SMOKE_SECONDS) rust/core/fuzz/fuzz.sh smoke

fuzz-cmin:
	rust/core/fuzz/fuzz.sh cmin

# For bench/gpu.sh on a lent GPU machine (`make wheel gpu-wheels` builds both from this checkout) (Python 3.12, its own torch, no network): the abi3 wheel in dist/
# and, in .gpu-wheels/ (git-ignored, well under 64 MiB), the wheels of the server's and the tests' Python
# dependencies that machine's image lacks, at the versions the venv here runs, for CPython 3.12 on
# x86-64 manylinux (pure-Python wheels where there are). --no-deps: each is named, nothing it needs twice.
GPU_WHEELS ?= .gpu-wheels
GPU_PLATFORMS := $(foreach n,2_17 2_24 2_28 2_31 2_34,--platform manylinux_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-wheels: $(VENV)/.created
	@ls dist/*.whl >/dev/null 2>&1 || $(MAKE) wheel
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
	  --abi abi3 --abi none $(GPU_PLATFORMS) --platform any -d $(GPU_WHEELS) \
	  $$($(PY) -c "import importlib.metadata as m; print(' '.join(f'{n}=={m.version(n)}' for n in ('fastapi', 'starlette', 'opentelemetry-api', 'pydantic', 'pydantic-core', 'annotated-types', 'typing-inspection', 'pydantic-settings', 'python-dotenv', 'uvicorn', 'httptools', 'watchfiles', 'websockets', 'blake3', 'zstandard', 'typing-extensions')))")
	@du -sh $(GPU_WHEELS) && ls $(GPU_WHEELS)

clean:
	rm -rf $(VENV) dist target
