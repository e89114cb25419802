# Thin wrapper over Meson: `make demo` runs the main job, `make test` the whole suite.
BUILD ?= build
BUILDTYPE ?= release
MESON_ARGS ?=
# nvcc lives here on the CUDA images; with it on PATH the CUDA backend is built (cuda=auto).
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: deps configure build demo demo-hsdp test bench clean

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

# Benchmarks: JSON lines under $(BUILD)/bench-results, plots next to them (see docs/benchmarks.md).
bench: build
	scripts/install-deps.sh gnuplot-nox
	mkdir -p $(BUILD)/bench-results
	for b in ns momentum swap step adamw; do $(BUILD)/bench/swapopt-bench $$b > $(BUILD)/bench-results/$$b.jsonl || exit 1; done
	python3 bench/plot.py $(BUILD)/bench-results $(BUILD)/bench-results/*.jsonl

test: build
	$(BUILD)/tests/swapopt-tests

clean:
	rm -rf $(BUILD)
