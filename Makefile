# The README's two commands: `make demo` and `make test`. Each does all the set-up it needs on a fresh
# Linux machine with Rust and Python >= 3.10: a virtual environment in .venv (reusing packages the
# system Python already has, such as a multi-GB torch), the abi3 wheel built by maturin, and the
# Python dependencies from PyPI.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: demo test test-rust test-python wheel install dev bench reliability wan fuzz fuzz-smoke fuzz-cmin clean

# maturin goes into the venv even when the system already has it: `wheel` runs the venv's own copy.
$(VENV)/.created:
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --ignore-installed "maturin>=1.5,<2"
	touch $@

# Build the one abi3 wheel (cp310-abi3: loads on every CPython >= 3.10) and install it with its extras.
wheel: $(VENV)/.created
	rm -rf dist
	$(VENV)/bin/maturin build --release --quiet -o dist
	@ls dist/*.whl | grep -q 'cp310-abi3' || (echo "wheel is not abi3: $$(ls dist)"; exit 1)

# One pip command: the wheel with its extras and the server from ./server (gradwire-server, which the
# `apps` extra names, is not on PyPI: pip takes it from the path).
install: wheel
	$(PIP) install -q --force-reinstall --no-deps dist/*.whl
	$(PIP) install -q "$$(ls dist/*.whl)[apps,test,bench]" ./server

# Editable install for development: Python edits are live, Rust edits need `make dev` again.
dev: $(VENV)/.created
	$(PIP) install -q -e ".[apps,test,bench]" -e ./server

demo: install
	$(VENV)/bin/gradwire demo

test-rust:
	cargo test --workspace --exclude gradwire-python --quiet

test-python: install
	$(PY) -m pytest -q -p no:cacheprovider tests

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

# About 30 minutes here: every reliability probe at full size, and docs/reliability.md rewritten from the results.
reliability: install
	$(PY) -m bench.reliability

# Time to loss over an emulated WAN (needs root: network namespaces, tc, a TUN delay line); about an hour on
# 2 shared cores. Writes docs/wan.md and docs/wan.png.
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

clean:
	rm -rf $(VENV) dist target
