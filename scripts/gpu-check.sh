#!/usr/bin/env bash
# The GPU checks, in two halves, for a device machine that cannot install packages:
#
#   scripts/gpu-check.sh prepare   # here: build build-gpu with -Dcuda=enabled, and copy the
#                                  # non-system shared libraries it needs into build-gpu/runtime-libs
#   scripts/gpu-check.sh run       # on the GPU machine (carry build-gpu): the CUDA and NCCL tests,
#                                  # the benchmarks on cuda, compute-sanitizer; results in
#                                  # gpu-results/ (and packed into $OUT/gpu-results.tar.gz)
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
  # Results go to gpu-results/ (a folder per run would do as well); where $OUT is set (the device
  # tool's return folder, which takes a few files, two folders deep) they are also packed into
  # $OUT/gpu-results.tar.gz: unpack it into gpu-results/ here.
  local out="$PWD/gpu-results"
  rm -rf "$out" && mkdir -p "$out"
  if [ ! -x "$BUILD/tests/swapopt-tests" ]; then
    command -v meson > /dev/null || { echo "no $BUILD and no meson: run 'scripts/gpu-check.sh prepare' and carry $BUILD"; return 1; }
    prepare || return 1
  fi
  export LD_LIBRARY_PATH="$PWD/$BUILD:$PWD/$BUILD/runtime-libs:${LD_LIBRARY_PATH:-}"
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  ldd "$BUILD/tests/swapopt-tests" | grep "not found" && { echo "libraries missing (above)"; return 1; }
  local status=0 tests="$BUILD/tests/swapopt-tests" started=$SECONDS
  # Every step is bounded, and the run as a whole stops starting new steps after 400 s; what was
  # skipped for time is said. The first full run took 80 s (docs/benchmarks.md).
  step() {  # seconds, output file, command...
    local limit=$1 file=$2
    shift 2
    if [ $((SECONDS - started + limit)) -gt 400 ]; then
      echo "skipped for time: $*" | tee -a "$out/skipped.txt"
      return 0
    fi
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$file" 2>&1 || { status=1; echo "FAILED: $* (see $file)"; }
    echo "$file ($((SECONDS - t0)) s): $(tail -n 1 "$out/$file")"
  }
  # CUDA backend vs the CPU one (bitwise elementwise ops, launch shapes, borrowed stream, swap
  # bitwise, a second GPU when there is one), NCCL (world size 1, init against a missing rank, 2
  # ranks on 2 GPUs), sharded HSDP on thread ranks on the GPU. The rest of the suite runs on the
  # CPU alone, as CI runs it.
  step 100 tests-cuda.txt "$tests" -ts=cuda --duration=true
  step 60 tests-nccl.txt "$tests" -tc="NCCL*" --duration=true
  step 45 tests-hsdp-gpu.txt "$tests" -tc="*on one GPU*" --duration=true
  # Every benchmark with the flags docs/benchmarks.md quotes, each bounded on its own; the JSON and
  # the machine go under gpu-results/docs/data/cuda (copy to docs/data/cuda here and
  # `python3 bench/report.py render --device cuda`).
  local bench
  for bench in ns:60 momentum:30 adamw:40 pipeline:30 swap:60 step:40 scale:60 scale_retain:40 checkpoint:40 ops:30; do
    if command -v python3 > /dev/null; then
      step "${bench#*:}" "bench-${bench%%:*}.txt" python3 bench/report.py run --build "$BUILD" --docs "$out/docs" --device cuda \
        --no-render --only "${bench%%:*}"
    else  # no Python on the device: the raw JSON lines at the default flags
      local args=("${bench%%:*}")
      [ "${args[0]}" = scale_retain ] && args=(scale --retain-arenas 1)
      step "${bench#*:}" "bench-${bench%%:*}.jsonl" "$BUILD/bench/swapopt-bench" "${args[@]}" --device cuda
    fi
  done
  # compute-sanitizer where the device runs it (not under gVisor): memory errors over the CUDA
  # suite; shared-memory races and barrier misuse in the kernels with shared memory (the norm's
  # partials and finish kernels, and the SYRK mirror's tile transpose), over the launch-shape
  # tests that run them at their limits. `kns=` takes a substring of a kernel's name and a filter
  # that matches no kernel checks nothing and passes: each one is first looked up among the
  # library's kernels.
  local sanitizer cuobjdump
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null || true)
  cuobjdump=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2> /dev/null || true)
  if [ -n "$sanitizer" ]; then
    step 90 sanitizer-memcheck.txt "$sanitizer" --tool memcheck --error-exitcode 1 "$tests" -ts=cuda -tce="launch shapes*"
    local tool kernels
    for kernels in norm_ mirror_lower; do
      if [ -n "$cuobjdump" ] && ! "$cuobjdump" -symbols "$BUILD/libswapopt.so" 2> /dev/null | grep -q "$kernels"; then
        status=1
        echo "FAILED: no kernel of libswapopt.so has '$kernels' in its name: the sanitizer filter checks nothing" |
          tee -a "$out/sanitizer-filters.txt"
        continue
      fi
      for tool in racecheck synccheck; do
        step 60 "sanitizer-$tool-$kernels.txt" "$sanitizer" --tool "$tool" --error-exitcode 1 --kernel-name "kns=$kernels" \
          "$tests" -tc="launch shapes*"
      done
    done
  else
    echo "compute-sanitizer not found: skipped" | tee "$out/sanitizer.txt"
  fi
  echo "gpu-check: $((SECONDS - started)) s, $([ $status = 0 ] && echo "all passed" || echo "some FAILED")"
  if [ -n "${OUT:-}" ]; then tar czf "$OUT/gpu-results.tar.gz" -C "$out" . && echo "packed into \$OUT/gpu-results.tar.gz"; fi
  return $status
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: scripts/gpu-check.sh prepare|run"; exit 2 ;;
esac
