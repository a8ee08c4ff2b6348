# nlmserve: `make demo` runs the whole path on shipped data; `make test` is the one gate.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-stamp
PROTO  := proto/nlmserve/v1/lm.proto

.PHONY: all install proto test test-py typecheck demo clean bench system-deps cpp

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build on this machine's disk; a bare `torch` pulls CUDA.
# The package build generates nlmserve.proto (gen/proto) from proto/ (setup.py).
$(DEPS): pyproject.toml setup.py | $(PY)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=strict
	touch $(DEPS)

# Re-link the strict editable install so new modules are seen, and regenerate the stubs of
# nlmserve.proto from $(PROTO) (the build step of setup.py; fast, no downloads).
install: $(DEPS)
	@$(BIN)/pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

# The stubs are part of the install (kept as a name for it).
proto: install

typecheck: install
	$(BIN)/mypy

test-py: install
	$(BIN)/pytest -q

test: typecheck test-py

# The demo trains for a fixed number of steps, so it trains the same weights and prints the
# same BLEU table on a quiet and on a busy machine. A workdir made by an earlier recipe is
# refused, naming what changed: remove it, or run `make demo DEMO_DIR=runs/demo-2`.
DEMO_DIR ?= runs/demo
demo: install
	$(BIN)/nlmserve experiment --workdir $(DEMO_DIR) --tuner mira --runs 3

bench: install
	$(BIN)/python bench/serve.py

# Debian packages for the C++ client and Moses feature (moses_plugin/cpp; boost headers to
# compile the feature against a Moses tree) and for the
# real-Prometheus test (tests/test_prometheus.py); run as root.
SYSTEM_DEPS := cmake g++ make pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libboost-dev \
               prometheus
system-deps:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_DEPS)

# C++ client library, its test driver and load generator (build/cpp), installed as the CMake
# package the native front end builds against (build/cpp-prefix), then the front end
# (server/native, build/native/nlmserve_frontend). Incremental.
cpp:
	cmake -S moses_plugin/cpp -B build/cpp -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cpp -j2
	cmake --install build/cpp --prefix build/cpp-prefix > /dev/null
	cmake -S server/native -B build/native -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$(CURDIR)/build/cpp-prefix
	cmake --build build/native -j2

clean:
	rm -rf gen build *.egg-info runs/demo
