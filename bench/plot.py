#!/usr/bin/env python3
"""Turns swapopt-bench JSON lines into PNG plots with gnuplot (Debian's `gnuplot-nox`).

    build/bench/swapopt-bench swap > swap.jsonl; build/bench/swapopt-bench ns > ns.jsonl
    python3 bench/plot.py OUT_DIR swap.jsonl ns.jsonl ...

Writes OUT_DIR/swap.png (swapped/bare step-time ratio by swap_times, packed and not) and
OUT_DIR/ns.png (Newton-Schulz vs GEMM GFLOP/s by shape) for whichever inputs are given.
"""
import json
import os
import subprocess
import sys
import tempfile


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.startswith("{")]
    return rows


def gnuplot(script):
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def plot_swap(rows, out, tmp):
    files = {}
    for packed in (True, False):
        data = [r for r in rows if r["bench"] == "swap" and r["packed"] == packed]
        if not data:
            continue
        path = os.path.join(tmp, f"swap_{packed}.dat")
        with open(path, "w") as f:
            for r in sorted(data, key=lambda r: r["swap_times"]):
                f.write(f"{r['swap_times']} {r['ratio']} {r['exposed_wait_ms']}\n")
        files["packed" if packed else "per-tensor"] = path
    if not files:
        return
    plots = ", ".join(f"'{p}' using 1:2 with linespoints title '{name}'" for name, p in files.items())
    gnuplot(f"""set terminal pngcairo size 800,500 noenhanced
set output '{os.path.join(out, "swap.png")}'
set title 'Swapped / bare Muon step time'
set xlabel 'swap_times'
set ylabel 'ratio (1 = no overhead)'
set grid
plot {plots}, 1 with lines dashtype 2 title 'bare'
""")


def plot_ns(rows, out, tmp):
    data = [r for r in rows if r["bench"] == "ns"]
    if not data:
        return
    path = os.path.join(tmp, "ns.dat")
    with open(path, "w") as f:
        for i, r in enumerate(data):
            f.write(f"{i} \"{r['m']}x{r['n']} {r['dtype']}\" {r['ns_gflops']} {r['gemm_gflops']}\n")
    gnuplot(f"""set terminal pngcairo size 800,500 noenhanced
set output '{os.path.join(out, "ns.png")}'
set title 'Newton-Schulz vs GEMM throughput ({data[0]["device"]})'
set ylabel 'GFLOP/s'
set style data histograms
set style fill solid 0.8
set grid y
plot '{path}' using 3:xtic(2) title 'Newton-Schulz (useful flops)', '' using 4 title 'GEMM'
""")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rows = load(sys.argv[2:])
    with tempfile.TemporaryDirectory() as tmp:
        plot_swap(rows, out, tmp)
        plot_ns(rows, out, tmp)


if __name__ == "__main__":
    main()
