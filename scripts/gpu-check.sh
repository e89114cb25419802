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
  local status=0 tests="$BUILD/tests/swapopt-tests" started=$SECONDS
  # Every step is bounded, and the run as a whole stops starting new steps after 450 s, so that it
  # fits in 8 minutes with the setup; what was skipped for time is said.
  step() {  # seconds, output file, command...
    local limit=$1 file=$2
    shift 2
    if [ $((SECONDS - started + limit)) -gt 450 ]; then
      echo "skipped for time: $*" | tee -a "$out/skipped.txt"
      return 0
    fi
    timeout "$limit" "$@" > "$file" 2>&1 || { status=1; echo "failed: $* (see $(basename "$file"))"; }
    tail -n 1 "$file"
  }
  # CUDA backend vs the CPU one (bitwise elementwise ops, launch shapes, borrowed stream, swap
  # bitwise, a second GPU when there is one), NCCL (world size 1, init against a missing rank, 2
  # ranks on 2 GPUs), sharded HSDP on thread ranks, then the rest of the suite.
  step 90 "$out/tests-cuda.txt" "$tests" -ts=cuda
  step 60 "$out/tests-nccl.txt" "$tests" -tc="NCCL*"
  step 45 "$out/tests-hsdp-gpu.txt" "$tests" -tc="*on one GPU*"
  step 90 "$out/tests-all.txt" env SWAPOPT_RANDOM_CONFIGS=300 "$tests" -tse=cuda -tce="NCCL*,*on one GPU*"
  # compute-sanitizer where the device has it: memory errors over the CUDA suite; shared-memory
  # races and barrier misuse in the one kernel with shared memory (the norm).
  local sanitizer
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
  if [ -n "$sanitizer" ]; then
    step 90 "$out/sanitizer-memcheck.txt" "$sanitizer" --tool memcheck --error-exitcode 1 "$tests" -ts=cuda -tce="launch shapes*"
    for tool in racecheck synccheck; do
      step 30 "$out/sanitizer-$tool.txt" "$sanitizer" --tool "$tool" --error-exitcode 1 --kernel-name kns=frobenius_norm \
        "$tests" -tc="launch shapes: more than 65535*"
    done
  else
    echo "compute-sanitizer not found: skipped" | tee "$out/sanitizer.txt"
  fi
  # Every benchmark with the flags docs/benchmarks.md quotes; the JSON and the machine go under
  # $out/docs/data/cuda (copy to docs/data/cuda here and `python3 bench/report.py render --device cuda`).
  if command -v python3 > /dev/null; then
    step 150 "$out/bench.txt" python3 bench/report.py run --build "$BUILD" --docs "$out/docs" --device cuda --no-render
  else  # no Python on the device: the raw JSON lines at the default flags
    for b in ns momentum swap step adamw; do step 20 "$out/bench-$b.jsonl" "$BUILD/bench/swapopt-bench" "$b" --device cuda; done
  fi
  echo "gpu-check: $((SECONDS - started)) s"
  tail -n 1 "$out"/tests-*.txt
  return $status
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: scripts/gpu-check.sh prepare|run"; exit 2 ;;
esac
