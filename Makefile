# nlmserve: `make demo` runs the whole path on shipped data; `make test` is the one gate.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-stamp
PROTO  := proto/nlmserve/v1/lm.proto

.PHONY: all install proto test test-py typecheck demo clean bench system-deps cpp cpp-client bench-cpp test-experiments

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, which build is the choice of TORCH (a bare `pip install torch` on Linux pulls
# PyPI's CUDA build, several GB):
#   make               TORCH=cpu: the CPU wheel, from PyTorch's CPU index
#   make TORCH=cuda    PyPI's wheel, the CUDA build on Linux x86_64: for a machine with a GPU
#   make TORCH=pypi    the wheel of the index pip is configured with, as it is (a mirror or a
#                      wheel folder that already holds the build wanted; what .ci/run uses)
# Made once per .venv: to change it later, `rm .venv/.deps-stamp` and run make again.
# The package build generates nlmserve.proto's stubs into proto/ from its lm.proto (setup.py).
TORCH ?= cpu
TORCH_VERSION := 2.13.0
TORCH_FROM_cpu  := --index-url https://download.pytorch.org/whl/cpu
TORCH_FROM_cuda :=
TORCH_FROM_pypi :=
ifeq ($(filter $(TORCH),cpu cuda pypi),)
$(error TORCH must be cpu, cuda or pypi, not '$(TORCH)')
endif
$(DEPS): pyproject.toml setup.py | $(PY)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==$(TORCH_VERSION) $(TORCH_FROM_$(TORCH))
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

# The research harnesses' own tests (experiments/tests), apart from the gate.
test-experiments: install
	$(BIN)/pytest -q experiments/tests

# The demo trains for a fixed number of steps, so it trains the same weights and prints the
# same BLEU table on a quiet and on a busy machine. A workdir made by an earlier recipe is
# refused, naming what changed: remove it, or run `make demo DEMO_DIR=runs/demo-2`.
DEMO_DIR ?= runs/demo
demo: install
	$(BIN)/nlmserve experiment --workdir $(DEMO_DIR) --tuner mira --runs 3

bench: install
	$(BIN)/python -m bench.serve

# Debian packages for the C++ client (client/cpp) and Moses feature (moses_plugin/cpp; boost headers to
# compile the feature against a Moses tree), for the
# real-Prometheus test (tests/test_prometheus.py) and jemalloc, which `nlmserve serve` runs on
# where it is installed (common/memory.py); run as root.
SYSTEM_DEPS := cmake g++ make pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libboost-dev \
               prometheus libjemalloc2
system-deps:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_DEPS)

# C++ client library and its test drivers (build/cpp), installed as the CMake package the
# native front end and the load generator build against (build/cpp-prefix): all the Moses
# feature needs (`cmake --install build/cpp --prefix PREFIX` then, docs/moses.md). Incremental.
cpp-client:
	cmake -S client/cpp -B build/cpp -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cpp -j2
	cmake --install build/cpp --prefix build/cpp-prefix > /dev/null

# The serving benchmark's load generator (bench/cpp, build/bench/nlmserve_load), on the client's package.
bench-cpp: cpp-client
	cmake -S bench/cpp -B build/bench -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$(CURDIR)/build/cpp-prefix
	cmake --build build/bench -j2

# The client library, then the native front end (server/native, build/native/nlmserve_frontend)
# and the load generator.
cpp: cpp-client bench-cpp
	cmake -S server/native -B build/native -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=$(CURDIR)/build/cpp-prefix
	cmake --build build/native -j2

clean:
	rm -rf gen build *.egg-info runs/demo proto/__init__.py proto/lm_pb2* proto/py.typed
