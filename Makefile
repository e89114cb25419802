# Thin wrapper over Meson: `make demo` runs the main job, `make test` the whole suite.
BUILD ?= build
BUILDTYPE ?= release
MESON_ARGS ?=
# nvcc lives here on the CUDA images; with it on PATH the CUDA backend is built (cuda=auto).
export PATH := $(PATH):/usr/local/cuda/bin

.PHONY: deps configure build demo test clean

deps:
	@scripts/install-deps.sh

$(BUILD)/build.ninja: | deps
	meson setup $(BUILD) --buildtype=$(BUILDTYPE) $(MESON_ARGS)

configure: $(BUILD)/build.ninja

build: configure
	ninja -C $(BUILD)

demo: build
	$(BUILD)/examples/swapopt-smoke

test: build
	$(BUILD)/tests/swapopt-tests

clean:
	rm -rf $(BUILD)
