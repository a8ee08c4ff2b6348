# nlmserve: `make demo` runs the whole path on shipped data; `make test` is the one gate.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
DEPS   := $(VENV)/.deps-stamp
PROTO  := proto/nlmserve/v1/lm.proto
GEN    := gen/proto/lm_pb2.py

.PHONY: all install proto test test-py typecheck demo clean bench system-deps cpp

all: install

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned to the CPU build on this machine's disk; a bare `torch` pulls CUDA.
$(DEPS): pyproject.toml | $(PY)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "grpcio-tools>=1.60" "mypy-protobuf>=3.6"
	$(MAKE) proto
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=strict
	touch $(DEPS)

# Python stubs for nlmserve.proto, generated from proto/ (never hand-written).
proto: $(GEN)
$(GEN): $(PROTO) | $(PY)
	rm -rf gen/proto gen/tmp && mkdir -p gen/proto gen/tmp
	$(PY) -m grpc_tools.protoc -I proto --python_out=gen/tmp --pyi_out=gen/tmp \
	  --grpc_python_out=gen/tmp --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	  --mypy_grpc_out=gen/tmp $(PROTO)
	mv gen/tmp/nlmserve/v1/* gen/proto/ && rm -rf gen/tmp
	sed -i 's/^from nlmserve\.v1 import/from nlmserve.proto import/; s/nlmserve\.v1\.lm_pb2/nlmserve.proto.lm_pb2/g' gen/proto/*.py gen/proto/*.pyi
	printf '"""Generated from proto/nlmserve/v1 (make proto); do not edit."""\n' > gen/proto/__init__.py
	touch gen/proto/py.typed

# Re-link the strict editable install so new modules are seen (fast, no downloads).
install: $(DEPS)
	@$(BIN)/pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

typecheck: install
	$(BIN)/mypy

test-py: install
	$(BIN)/pytest -q

test: typecheck test-py

demo: install
	$(BIN)/nlmserve experiment --workdir runs/demo --tuner mira --runs 3

bench: install
	$(BIN)/python bench/serve.py

# Debian packages for the C++ client and Moses feature (moses_plugin/cpp; boost headers to
# compile the feature against a Moses tree) and for the
# real-Prometheus test (tests/test_prometheus.py); run as root.
SYSTEM_DEPS := cmake g++ make pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libboost-dev \
               prometheus
system-deps:
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SYSTEM_DEPS)

# C++ client library, its test driver and load generator, and the native front end
# (server/native), built incrementally in build/cpp.
cpp:
	cmake -S moses_plugin/cpp -B build/cpp -DCMAKE_BUILD_TYPE=Release
	cmake --build build/cpp -j2

clean:
	rm -rf gen build *.egg-info runs/demo
