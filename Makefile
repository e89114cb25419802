# Thin wrapper over Meson: `make demo` runs the main job, `make test` the whole suite.
BUILD ?= build
BUILDTYPE ?= release
MESON_ARGS ?=
# nvcc lives here on the CUDA images; with it on PATH the CUDA backend is built (cuda=auto).
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: deps configure build demo demo-hsdp test test-hosts bench docs clean

deps:
	@scripts/install-deps.sh

$(BUILD)/build.ninja: | deps
	meson setup $(BUILD) --buildtype=$(BUILDTYPE) -Dnative_arch=true $(MESON_ARGS)

configure: $(BUILD)/build.ninja

build: configure
	ninja -C $(BUILD)

demo: build
	$(BUILD)/examples/swapopt-train

# Data-parallel HSDP Muon on a 2x2 mesh of local processes (Gloo over loopback).
demo-hsdp: build
	$(BUILD)/examples/swapopt-hsdp --mesh 2x2

# Benchmarks: every swapopt-bench run with the flags of docs/benchmarks.md, the JSON and machine
# kept in docs/data/cpu, the tables there and the plots in docs/img regenerated (bench/report.py).
bench: build
	scripts/install-deps.sh gnuplot-nox
	python3 bench/report.py run --build $(BUILD)

# The API reference from the public headers: $(BUILD)/docs/html/index.html. Fails on an
# undocumented public declaration.
docs: configure
	scripts/install-deps.sh doxygen
	BUILD=$(BUILD) SWAPOPT_VERSION=$$(meson introspect $(BUILD) --projectinfo | python3 -c 'import json,sys; print(json.load(sys.stdin)["version"])') doxygen docs/Doxyfile
	@echo "API reference: $(BUILD)/docs/html/index.html"

test: build
	$(BUILD)/tests/swapopt-tests

# Ranks on several "hosts": network namespaces on a bridge, Redis on its own host; bitwise equal to
# one host, and named errors in time for a partition, a killed or stopped rank, no Redis (root).
test-hosts: build
	tests/hosts/run.sh $(BUILD)

clean:
	rm -rf $(BUILD)
