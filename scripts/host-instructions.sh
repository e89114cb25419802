#!/usr/bin/env bash
# The host's instructions per param of an AdamW step, counted by callgrind: what a step does on the
# calling thread (checks, planning, the swap pipeline's bookkeeping, issuing ops), exact and
# repeatable where times on a busy 2-core machine are not. On CUDA a step of many small params
# is bound by this work (docs/benchmarks.md, "Many params").
#
#   scripts/host-instructions.sh [PARAMS]     (default 2000 params of 1024-4096 elements)
#
# Builds a portable tree in build-callgrind (valgrind does not run AVX-512 code), runs
# `swapopt-bench scale --params PARAMS` under callgrind collecting only inside Optimizer::step()
# (the bare step) and SwapOptimizer::step() (the swapped one), and prints their instructions per
# param and step. The math runs on the CPU stream's worker thread, outside both.
set -euo pipefail
cd "$(dirname "$0")/.."
params=${1:-2000}
command -v valgrind > /dev/null || scripts/install-deps.sh valgrind
build=build-callgrind
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dbuildtype=debugoptimized -Dnative_arch=false -Dcuda=disabled -Dnccl=disabled -Dgloo=disabled \
    -Dtests=false -Dexamples=false -Dbench=true > /dev/null
fi
ninja -C "$build" bench/swapopt-bench > /dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# Instructions inside each step function over a run of `scale` at --reps R: its total over
# max(R, 20000 / params) steps plus one warm-up step (the first, which also creates the state).
collect() {  # reps -> "bare swapped" totals
  OMP_NUM_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1" \
    --toggle-collect='swapopt::Optimizer::step()' --toggle-collect='swapopt::SwapOptimizer::step()' \
    "$build/bench/swapopt-bench" scale --params "$params" --reps "$1" > /dev/null 2> "$out/log" || { cat "$out/log"; exit 1; }
  callgrind_annotate --inclusive=yes "$out/cg.$1" 2> /dev/null > "$out/annotated.$1"
  for f in 'swapopt::Optimizer::step()' 'swapopt::SwapOptimizer::step()'; do
    grep -F ":$f" "$out/annotated.$1" | awk '{gsub(",", "", $1); if ($1 + 0 > max) max = $1 + 0} END {printf "%d ", max}'
  done
}
steps() { echo $(( $1 > 20000 / params ? $1 : 20000 / params )); }
# Two runs whose step counts differ: the difference is steady-state steps only.
low=$(( 20000 / params + 1 )) high=$(( 20000 / params + 9 ))
read -r bare_low swap_low <<< "$(collect "$low")"
read -r bare_high swap_high <<< "$(collect "$high")"
n=$(( $(steps "$high") - $(steps "$low") ))
echo "bare: $(( (bare_high - bare_low) / (n * params) )) instructions per param and step ($n steps of $params params)"
echo "swapped: $(( (swap_high - swap_low) / (n * params) )) instructions per param and step"
