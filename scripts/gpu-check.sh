#!/usr/bin/env bash
# The GPU checks, in two halves, for a device machine that cannot install packages:
#
#   scripts/gpu-check.sh prepare   # here: build build-gpu with -Dcuda=enabled, and copy the
#                                  # non-system shared libraries it needs into build-gpu/runtime-libs
#   scripts/gpu-check.sh run       # on the GPU machine (carry build-gpu): the CUDA and NCCL tests,
#                                  # then the benchmarks on cuda; everything goes under $OUT
#
# `run` builds build-gpu itself when it is missing and meson is there.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=build-gpu
export PATH="$PATH:/usr/local/cuda/bin"

prepare() {
  make build BUILD="$BUILD" BUILDTYPE=release MESON_ARGS="-Dcuda=enabled -Dfuzz=false" || return 1
  mkdir -p "$BUILD/runtime-libs"
  # Libraries from Debian packages the device may not have (gloo, hiredis, ...); CUDA's and the C
  # runtime's stay out: the device brings its own.
  for bin in "$BUILD/tests/swapopt-tests" "$BUILD/tests/swapopt-mp-worker" "$BUILD/bench/swapopt-bench"; do
    [ -x "$bin" ] || continue
    LD_LIBRARY_PATH="$BUILD" ldd "$bin" | awk '/=> \// {print $3}' |
      grep -v -E '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+|ld-linux|libcuda|libcudart|libcublas|libcublasLt|libnccl)[.-]' |
      grep -v "^$PWD/$BUILD/" | while read -r lib; do cp -L "$lib" "$BUILD/runtime-libs/"; done
  done
  du -sh "$BUILD"
}

run() {
  local out="${OUT:-$PWD/gpu-results}"
  mkdir -p "$out"
  if [ ! -x "$BUILD/tests/swapopt-tests" ]; then
    command -v meson > /dev/null || { echo "no $BUILD and no meson: run 'scripts/gpu-check.sh prepare' and carry $BUILD"; return 1; }
    prepare || return 1
  fi
  export LD_LIBRARY_PATH="$PWD/$BUILD:$PWD/$BUILD/runtime-libs:${LD_LIBRARY_PATH:-}"
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  local status=0 tests="$BUILD/tests/swapopt-tests"
  # Everything below is bounded so that the whole run fits in 8 minutes.
  # CUDA backend vs the CPU one (bitwise elementwise ops, > 65535 matrices, borrowed stream, swap
  # bitwise, a second GPU when there is one), NCCL (world size 1, init against a missing rank),
  # sharded HSDP on thread ranks, then the whole suite.
  timeout 120 "$tests" -ts=cuda 2>&1 | tee "$out/tests-cuda.txt" || status=1
  timeout 60 "$tests" -tc="NCCL*" 2>&1 | tee "$out/tests-nccl.txt" || status=1
  timeout 60 "$tests" -tc="*on one GPU*" 2>&1 | tee "$out/tests-hsdp-gpu.txt" || status=1
  SWAPOPT_RANDOM_CONFIGS=300 timeout 120 "$tests" 2>&1 | tail -n 30 > "$out/tests-all.txt" || status=1
  # compute-sanitizer over the CUDA suite, where the device has it: memory errors, shared-memory
  # races, and synchronisation misuse.
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
  if [ -n "$sanitizer" ]; then
    for tool in memcheck racecheck synccheck; do
      timeout 90 "$sanitizer" --tool "$tool" --error-exitcode 1 "$tests" -ts=cuda \
        -tce="launch shapes*" > "$out/sanitizer-$tool.txt" 2>&1 || status=1
      tail -n 3 "$out/sanitizer-$tool.txt"
    done
  else
    echo "compute-sanitizer not found: skipped" | tee "$out/sanitizer.txt"
  fi
  for b in ns momentum swap step adamw; do
    timeout 30 "$BUILD/bench/swapopt-bench" "$b" --device cuda > "$out/bench-$b.jsonl" 2> "$out/bench-$b.txt" || status=1
  done
  tail -n 1 "$out"/tests-*.txt
  return $status
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: scripts/gpu-check.sh prepare|run"; exit 2 ;;
esac
