#!/usr/bin/env python3
"""Runs swapopt's benchmarks and regenerates docs/benchmarks.md's tables and plots from them.

    python3 bench/report.py run    [--build build] [--docs docs] [--device cpu|cuda] [--no-render]
    python3 bench/report.py render [--docs docs] [--device cpu|cuda]

`run` runs every swapopt-bench subcommand with the flags in COMMANDS, keeps their JSON lines and
the machine they ran on in DOCS/data/DEVICE/, then renders (unless --no-render: a GPU machine
without gnuplot runs, this one renders). `render` only redraws from those
files: the PNGs in DOCS/img/ (gnuplot, Debian's gnuplot-nox) and, in DOCS/benchmarks.md, the text
between each `<!-- begin bench NAME DEVICE -->` and `<!-- end bench NAME DEVICE -->` pair. The
prose around those blocks is written by hand and must not quote the generated figures.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile

# The flags each benchmark runs with (and that docs/benchmarks.md quotes).
COMMANDS = {
    "ns": ["ns", "--reps", "7"],
    "momentum": ["momentum", "--reps", "7"],
    "swap": ["swap", "--dim", "384", "--reps", "5"],
    "step": ["step", "--reps", "3"],
    "adamw": ["adamw", "--reps", "7"],
    "scale": ["scale", "--reps", "3"],
    # The swapped step with its arenas kept across steps, in a process of its own: what an
    # allocator keeps is process-wide, so it would speed up the default run beside it too.
    "scale_retain": ["scale", "--reps", "3", "--retain-arenas", "1"],
    "pipeline": ["pipeline", "--reps", "7"],
    "checkpoint": ["checkpoint", "--reps", "3"],
    "ops": ["ops", "--reps", "7"],
}


# Where a GPU runs a benchmark at other flags: the swap at width 384 is too short on a GPU to hide
# anything, and the figure that matters there is for matrices of 2048 and up.
CUDA_COMMANDS = {
    "swap": ["swap", "--dim", "2048", "--reps", "5"],
}


def flags(name, device):
    return (CUDA_COMMANDS if device == "cuda" else {}).get(name, COMMANDS[name])


def command_line(name, device):
    return " ".join(["swapopt-bench"] + flags(name, device) + ["--device", device])


def sh(args, **kw):
    return subprocess.run(args, check=True, text=True, capture_output=True, **kw).stdout.strip()


def machine_info(build, device):
    """What the figures were measured on: CPU, memory, compiler and build flags, commit, date."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        cpu = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
        info["cpu"] = f"{cpu[0]} ({len(cpu)} logical cores)" if cpu else platform.processor()
    except OSError:
        info["cpu"] = platform.processor()
    try:
        kib = int(next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemTotal")))
        info["memory"] = f"{kib / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        pass
    info["os"] = platform.platform()
    try:
        options = {o["name"]: o["value"] for o in json.loads(sh(["meson", "introspect", build, "--buildoptions"]))}
        info["build"] = f"buildtype={options.get('buildtype')} native_arch={options.get('native_arch')} openmp={options.get('openmp')}"
    except (subprocess.CalledProcessError, FileNotFoundError, json.JSONDecodeError):
        pass
    try:  # the compiler Meson found (CXX, else c++), as it names itself
        info["compiler"] = sh([os.environ.get("CXX", "c++"), "--version"]).splitlines()[0]
    except (subprocess.CalledProcessError, FileNotFoundError, IndexError):
        pass
    try:
        info["commit"] = sh(["git", "rev-parse", "--short", "HEAD"])
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    info["threads"] = os.environ.get("OMP_NUM_THREADS", f"{os.cpu_count()} (OpenMP default)")
    if device == "cuda":
        try:
            info["gpu"] = sh(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"])
        except (subprocess.CalledProcessError, FileNotFoundError):
            info["gpu"] = "?"
    if os.path.exists("/proc/loadavg"):
        info["load_before"] = open("/proc/loadavg").read().split()[0]
    return info


def run(args):
    data = os.path.join(args.docs, "data", args.device)
    os.makedirs(data, exist_ok=True)
    info = machine_info(args.build, args.device)
    binary = os.path.join(args.build, "bench", "swapopt-bench")
    previous = os.path.join(data, "machine.json")
    kept = json.load(open(previous)) if args.only and os.path.exists(previous) else {}
    # Each benchmark keeps its own date and commit: a partial run (--only) re-dates only its own.
    info["commands"] = {**kept.get("commands", {})}
    info["runs"] = {**kept.get("runs", {})}
    for name in COMMANDS:
        if args.only and name not in args.only:
            continue
        cmd = [binary] + flags(name, args.device) + ["--device", args.device]
        print(f"== {command_line(name, args.device)}", file=sys.stderr, flush=True)
        out = subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE).stdout
        with open(os.path.join(data, f"{name}.jsonl"), "w") as f:
            f.write(out)
        info["commands"][name] = command_line(name, args.device)
        info["runs"][name] = {"date": info["date"], "commit": info.get("commit", "?"), "cpu": info.get("cpu", "?")}
    with open(os.path.join(data, "machine.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    if not args.no_render:
        render(args)


# ---- reading -------------------------------------------------------------------------------

def load(data, name):
    path = os.path.join(data, f"{name}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.startswith("{")]


def figure(v):
    """A measured value with about three significant digits, never in exponent form."""
    for limit, digits in ((100, 0), (10, 1), (1, 2)):
        if abs(v) >= limit:
            return f"{v:.{digits}f}"
    return f"{v:.3f}"


def spread(row, key):
    """'median (lo-hi)' of a field measured with its spread."""
    return f"{figure(row[key])} ({figure(row[key + '_lo'])}-{figure(row[key + '_hi'])})"


def elements(n):
    return f"{n / 2**20:g} M" if n >= 2**20 else f"{n / 2**10:g} K"


# ---- plots ---------------------------------------------------------------------------------

def gnuplot(script):
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


HEADER = """set terminal pngcairo size {w},{h} font 'DejaVu Sans,11' noenhanced
set output '{out}'
set grid y lc rgb '#dddddd'
set border 3
set tics nomirror
set key top left Left reverse
"""


def write_dat(tmp, name, rows):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        for r in rows:
            f.write(" ".join(str(x) for x in r) + "\n")
    return path


COLORS = ["#4878d0", "#ee854a", "#6acc64", "#999999"]


def plot_bars(out, tmp, size, title, ylabel, labels, fields, names, log=False):
    """One bar per field and label (fields: names with _lo/_hi spreads, drawn as bars), from zero
    (or on a log scale, for figures over several decades)."""
    dat = write_dat(tmp, "bars.dat", [[f'"{label}"'] + [r[k] for f in fields for k in (f, f + "_lo", f + "_hi")]
                                      for label, r in labels])
    series = ", ".join(f"'{dat if i == 0 else ''}' using {2 + 3 * i}:{3 + 3 * i}:{4 + 3 * i}{':xtic(1)' if i == 0 else ''} "
                       f"title '{name}' lc rgb '{COLORS[i]}'" for i, name in enumerate(names))
    gnuplot(HEADER.format(w=size[0], h=size[1], out=out) + f"""
set title '{title} (median, bars: fastest-slowest run)'
set ylabel '{ylabel}'
{"set logscale y" if log else "set yrange [0:*]"}
set rmargin 6
set style data histograms
set style histogram errorbars gap 2 lw 1
set style fill solid 0.85 border -1
{"set xtics rotate by -25" if len(labels) > 6 else ""}
{"set key below" if len(names) > 2 else ""}
plot {series}
""")


def plot_ns(rows, out, tmp, device):
    # A GPU's throughputs span three decades from 256x256 to 4096x4096: a log scale shows them all.
    plot_bars(out, tmp, (max(900, 60 * len(rows)), 480), f"Newton-Schulz vs GEMM throughput on {device}",
              "GFLOP/s (useful flops)", [(f'{r["m"]}x{r["n"]} {r["dtype"]}', r) for r in rows], ("ns_gflops", "gemm_gflops"),
              ("Newton-Schulz (5 steps)", "GEMM [k,k]@[k,l]"), log=device == "cuda")


def plot_momentum(rows, out, tmp, device):
    plot_bars(out, tmp, (700, 440), f"Fused Muon momentum vs memcpy on {device}",
              "GB/s moved (momentum 16 B/element, memcpy 8 B)", [(f'{elements(r["elements"])} f32', r) for r in rows],
              ("momentum_gbs", "memcpy_gbs"), ("momentum update", "memcpy"))


def plot_swap(rows, out, tmp, device):
    series = {}
    for packed in (True, False):
        data = sorted((r for r in rows if r["packed"] == packed), key=lambda r: r["swap_times"])
        series[packed] = write_dat(tmp, f"swap_{packed}.dat", [
            [r["swap_times"], r["bare_ms"], r["bare_ms_lo"], r["bare_ms_hi"], r["swap_ms"], r["swap_ms_lo"], r["swap_ms_hi"],
             r["peak_resident_bytes"] / 2**20, r["state_bytes"] / 2**20] for r in data])
    p, u = series[True], series[False]
    gnuplot(HEADER.format(w=1100, h=460, out=out) + f"""
set multiplot layout 1,2 title 'Swapped vs bare Muon step on {device}, width {rows[0]["dim"]} (median, bars: fastest-slowest run)'
set xlabel 'swap_times'
set xrange [0.5:8.5]
set xtics 1
set yrange [0:*]
set ylabel 'step time (ms)'
set title 'time'
set key bottom right
plot '{p}' using 1:2:3:4 with yerrorlines title 'bare (packed runs)' lc rgb '#999999' pt 7, \\
     '{p}' using 1:5:6:7 with yerrorlines title 'swapped, packed' lc rgb '#4878d0' pt 7, \\
     '{u}' using 1:5:6:7 with yerrorlines title 'swapped, per-tensor' lc rgb '#ee854a' pt 5
set ylabel 'momentum on the device (MiB)'
set title 'memory: peak resident state'
set key bottom left
plot '{p}' using 1:9 with lines title 'bare: all of it' lc rgb '#999999' dt 2 lw 2, \\
     '{p}' using 1:8 with linespoints title 'swapped, packed' lc rgb '#4878d0' pt 7, \\
     '{u}' using 1:8 with linespoints title 'swapped, per-tensor' lc rgb '#ee854a' pt 5
unset multiplot
""")


def plot_steps(step, adamw, out, tmp, device):
    s = write_dat(tmp, "step.dat", [[r["dim"], r["step_ms"], r["step_ms_lo"], r["step_ms_hi"]] for r in step])
    a = write_dat(tmp, "adamw.dat", [[r["dim"], r["step_ms"], r["step_ms_lo"], r["step_ms_hi"]] for r in adamw])
    widths = sorted({r["dim"] for r in step + adamw})
    gnuplot(HEADER.format(w=1100, h=440, out=out) + f"""
set multiplot layout 1,2 title 'Whole optimizer steps on {device}, 4 transformer-like layers (median, bars: fastest-slowest run)'
set xlabel 'model width'
set yrange [0:*]
set logscale x 2
set xrange [{min(widths) / 1.3:g}:{max(widths) * 1.3:g}]
set xtics ({", ".join(str(w) for w in widths)})
unset key
set ylabel 'ms per step'
set title 'Muon ({"bf16" if device == "cuda" else "f32"} NS) + AdamW'
plot '{s}' using 1:2:3:4 with yerrorlines title 'Muon + AdamW' lc rgb '#4878d0' pt 7
set title 'AdamW over every param'
plot '{a}' using 1:2:3:4 with yerrorlines title 'AdamW' lc rgb '#6acc64' pt 7
unset multiplot
""")


def plot_scale(rows, kept, out, tmp, device):
    kept_ms = {r["params"]: r["swap_ms"] for r in kept}
    dat = write_dat(tmp, "scale.dat", [[r["params"], r["bare_ms"] * 1e3 / r["params"], r["swap_ms"] * 1e3 / r["params"],
                                        r["state_dict_swap_us_per_param"], r["state_dict_swap_us_per_param_lo"],
                                        r["state_dict_swap_us_per_param_hi"], r["load_swap_us_per_param"],
                                        r["load_swap_us_per_param_lo"], r["load_swap_us_per_param_hi"],
                                        kept_ms[r["params"]] * 1e3 / r["params"] if r["params"] in kept_ms else "NaN",
                                        r.get("copy_new_us_per_param", "NaN"), r.get("copy_into_us_per_param", "NaN")]
                                       for r in rows])
    # The memcpy floors, where the run measured them.
    floor_series = (", \\\n     '' using 1:11 with linespoints title 'memcpy to new memory' lc rgb '#4878d0' dt 2 pt 6, \\\n"
                    "     '' using 1:12 with linespoints title 'memcpy to existing memory' lc rgb '#ee854a' dt 2 pt 4"
                    if all("copy_new_us_per_param" in r for r in rows) else "")
    # The retain_arenas run only where it was measured (a GPU run before it existed has none).
    retain_series = ", \\\n     '' using 1:10 with linespoints title 'swapped, retain_arenas' lc rgb '#6acc64' pt 5" if kept else ""
    gnuplot(HEADER.format(w=1100, h=440, out=out) + f"""
set multiplot layout 1,2 title 'AdamW over many small params (1024-4096 elements) on {device}: cost per param'
set xlabel 'params'
set logscale x
set xrange [70:70000]
set yrange [0:*]
set ylabel 'microseconds per param'
set title 'step (median)'
plot '{dat}' using 1:2 with linespoints title 'bare' lc rgb '#999999' pt 7, \\
     '' using 1:3 with linespoints title 'swapped' lc rgb '#4878d0' pt 7{retain_series}
set title 'checkpoint, swapped (bars: fastest-slowest run)'
plot '{dat}' using 1:4:5:6 with yerrorlines title 'state_dict()' lc rgb '#4878d0' pt 7, \\
     '' using 1:7:8:9 with yerrorlines title 'load_state_dict()' lc rgb '#ee854a' pt 5{floor_series}
unset multiplot
""")


def plot_pipeline(rows, out, tmp, device):
    plot_bars(out, tmp, (900, 460), f"Swap pipeline copies on {device}, pinned host and device",
              "GB/s (both at once: the two directions together)", [(f'{r["mib"]} MiB', r) for r in rows],
              ("h2d_gbs", "d2h_gbs", "both_gbs", "d2d_gbs"),
              ("H2D alone", "D2H alone", "H2D + D2H at once (two streams)", "device to device"),
              log=device == "cuda")  # on a GPU the device's own copies are 35x the host link's


CHECKPOINT_LABELS = {"step": "steps only", "save_state_dict": "save via StateDict", "save_checkpoint": "save_checkpoint",
                     "load_state_dict": "load via StateDict", "load_checkpoint": "load_checkpoint"}


def plot_checkpoint(rows, out, tmp, device):
    dat = write_dat(tmp, "checkpoint.dat", [[f'"{CHECKPOINT_LABELS[r["mode"]]}"', r["peak_bytes"] / 1e6] for r in rows])
    step = rows[0]["step_peak_bytes"] / 1e6
    gnuplot(HEADER.format(w=900, h=440, out=out) + f"""
set title 'Peak process memory, {rows[0]["state_mib"]} MiB of swapped AdamW state, on {device}'
set ylabel 'peak resident MB (VmHWM)'
set yrange [0:*]
set style data histograms
set style fill solid 0.85 border -1
set boxwidth 0.6
unset key
set label 1 'a process that only steps: {step:.0f} MB' at graph 0.02, first {step * 1.06:.0f} tc rgb '#555555'
plot '{dat}' using 2:xtic(1) lc rgb '#4878d0', {step:.1f} with lines dt 2 lc rgb '#555555'
""")


# ---- tables --------------------------------------------------------------------------------

def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" if i == 0 else "---:" for i in range(len(header))) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def block_machine(info, device):
    gpu = f"GPU {info['gpu']}; host " if "gpu" in info else ""
    lines = [f"Measured on {gpu}{info.get('cpu', '?')}, "
             f"{info.get('memory', '?')}; {info.get('os', '?')}; {info.get('compiler', '?')}, {info.get('build', '?')}; "
             f"threads: {info.get('threads', '?')}; load average before the run: {info.get('load_before', '?')}.",
             "", "Commands (`make bench` runs them all and regenerates this page):", ""]
    runs = info.get("runs", {})
    for name, command in info.get("commands", {}).items():
        run = runs.get(name, {"date": info.get("date", "?"), "commit": info.get("commit", "?")})
        # A partial run (--only) on another machine says so: its figures are not comparable.
        elsewhere = f", on {run['cpu']}" if run.get("cpu", info.get("cpu")) != info.get("cpu") else ""
        lines.append(f"- `{command}` ({run['date']}, commit `{run['commit']}`{elsewhere})")
    return "\n".join(lines)


def block_ns(rows):
    # "as run": the flops the backend executes (CUDA's bf16 Gram products are full GEMMs, twice the
    # useful flops, or from side 4096 3 of 4 blocks, 1.5x); rows measured before that column
    # existed show the useful figure.
    # "norm": the Frobenius norm NS starts with, timed alone, as a share of the NS time.
    body = table(["shape", "dtype", "NS ms", "NS GFLOP/s (useful)", "NS GFLOP/s (as run)", "GEMM GFLOP/s", "NS / GEMM", "norm / NS"],
                 [[f"{r['m']}x{r['n']}", r["dtype"], spread(r, "ns_ms"), spread(r, "ns_gflops"),
                   spread(r, "executed_gflops" if "executed_gflops" in r else "ns_gflops"), spread(r, "gemm_gflops"),
                   f"{r['ratio']:.2f}", f"{100 * r['norm_share']:.1f} %" if "norm_share" in r else "-"] for r in rows])
    ratios = [r["ratio"] for r in rows]
    return body + f"\n\nNS / GEMM per useful flop: {min(ratios):.2f} to {max(ratios):.2f}."


def block_momentum(rows):
    body = table(["elements", "momentum GB/s", "memcpy GB/s", "momentum / memcpy"],
                 [[elements(r["elements"]), spread(r, "momentum_gbs"), spread(r, "memcpy_gbs"), f"{r['ratio']:.2f}"] for r in rows])
    return body


def block_swap(rows):
    # "in a loop": backward + step back to back, prefetch_early before the backward (rows measured
    # before that column existed show "-").
    body = table(["mode", "swap_times", "bare ms", "swapped ms", "swapped / bare", "exposed wait ms", "peak on device", "saved",
                  "swapped / bare in a loop"],
                 [["packed" if r["packed"] else "per-tensor", r["swap_times"], spread(r, "bare_ms"), spread(r, "swap_ms"),
                   f"{r['ratio']:.3f}", f"{r['exposed_wait_ms']:.2f}", f"{r['peak_resident_bytes'] / 2**20:.2f} MiB",
                   f"{100 * (1 - r['peak_resident_bytes'] / r['state_bytes']):.0f} %",
                   f"{r['loop_ratio']:.3f}" if "loop_ratio" in r else "-"] for r in rows])
    state = rows[0]["state_bytes"] / 2**20
    at4 = {r["packed"]: r for r in rows if r["swap_times"] == 4}
    summary = f"Momentum of all matrices: {state:.2f} MiB (all of it on the device without swap)."
    if True in at4 and False in at4:
        summary += (f" At swap_times 4: swapped / bare {at4[True]['ratio']:.3f} packed, {at4[False]['ratio']:.3f} per-tensor;"
                    f" {100 * (1 - at4[True]['peak_resident_bytes'] / at4[True]['state_bytes']):.0f} % of the momentum"
                    " never on the device at once (packed).")
        if "loop_ratio" in at4[True]:
            summary += f" In a training loop: {at4[True]['loop_ratio']:.3f} packed, {at4[False]['loop_ratio']:.3f} per-tensor."
    return body + "\n\n" + summary


def block_step(rows):
    return table(["width", "Muon params", "Muon + AdamW step ms"],
                 [[r["dim"], f"{r['muon_params'] / 1e6:.1f} M", spread(r, "step_ms")] for r in rows])


def block_adamw(rows):
    # memcpy: a copy of as many bytes on the same device, alternated with the step.
    return table(["width", "params", "AdamW step ms", "GB/s (28 B/param)", "memcpy GB/s", "AdamW / memcpy"],
                 [[r["dim"], f"{r['params'] / 1e6:.2f} M", spread(r, "step_ms"), spread(r, "gbs"),
                   spread(r, "memcpy_gbs") if "memcpy_gbs" in r else "-",
                   f"{r['ratio']:.2f}" if "ratio" in r else "-"] for r in rows])


def block_scale(rows, kept):
    # kept: the run with retain_arenas, in its own process (its own bare step, its own ratio).
    kept = {r["params"]: r for r in kept}
    def kept_columns(n):
        return [spread(kept[n], "swap_ms"), f"{kept[n]['ratio']:.2f}"] if n in kept else ["-", "-"]
    steps = table(["params", "bare step ms", "swapped step ms", "swapped / bare", "retain_arenas: swapped step ms",
                   "retain_arenas: swapped / bare"],
                  [[r["params"], spread(r, "bare_ms"), spread(r, "swap_ms"), f"{r['ratio']:.2f}"] + kept_columns(r["params"])
                   for r in rows])
    # Each checkpoint figure beside its floor, the same bytes copied by memcpy (into new memory for
    # a state_dict, into memory that exists for a load), alternated with it. Runs before the
    # floors existed have none.
    def over(r, key):
        return f"{r[key]:.2f}" if key in r else "-"
    def floor(r, key):
        return spread(r, key) if key in r else "-"
    checkpoints = table(["params", "memcpy to new memory us/param", "state_dict us/param (bare)", "bare / memcpy",
                         "state_dict us/param (swapped)", "swapped / memcpy", "memcpy to existing memory us/param",
                         "load_state_dict us/param (swapped)", "load / memcpy"],
                        [[r["params"], floor(r, "copy_new_us_per_param"), spread(r, "state_dict_bare_us_per_param"),
                          over(r, "state_dict_bare_per_copy"), spread(r, "state_dict_swap_us_per_param"),
                          over(r, "state_dict_swap_per_copy"), floor(r, "copy_into_us_per_param"),
                          spread(r, "load_swap_us_per_param"), over(r, "load_swap_per_copy")] for r in rows])
    body = steps + "\n\n" + checkpoints
    big = [r for r in rows if r["params"] >= 1000]
    if len(big) >= 2:
        def flat(key):
            v = [r[key] for r in big]
            return f"{max(v) / min(v):.2f}"
        body += (f"\n\nFrom {big[0]['params']} to {big[-1]['params']} params the per-param cost varies by a factor of "
                 f"{flat('state_dict_bare_us_per_param')} (bare state_dict), {flat('state_dict_swap_us_per_param')} "
                 f"(swapped state_dict) and {flat('load_swap_us_per_param')} (swapped load_state_dict)")
        if all("copy_new_us_per_param" in r for r in big):
            body += (f"; their memcpy floors by {flat('copy_new_us_per_param')} (to new memory) and "
                     f"{flat('copy_into_us_per_param')} (to existing memory), their ratios to them by "
                     f"{flat('state_dict_bare_per_copy')}, {flat('state_dict_swap_per_copy')} and "
                     f"{flat('load_swap_per_copy')}")
        body += "."
    return body


def block_pipeline(rows):
    body = table(["copy size", "H2D GB/s", "D2H GB/s", "both at once GB/s", "both / faster one", "device-to-device GB/s"],
                 [[f"{r['mib']} MiB", spread(r, "h2d_gbs"), spread(r, "d2h_gbs"),
                   spread(r, "both_gbs"), f"{r['duplex']:.2f}", spread(r, "d2d_gbs")] for r in rows])
    return body


def block_checkpoint(rows):
    peaks = [r for r in rows if r["bench"] == "checkpoint"]
    body = table(["process", "peak MB", "above the stepping process", "seconds"],
                 [[r["mode"], f"{r['peak_bytes'] / 1e6:.1f}", f"{r['above_step_mb']:+.1f} MB",
                   "" if r["mode"] == "step" else spread(r, "seconds")] for r in peaks])
    for r in rows:
        if r["bench"] == "checkpoint_async":
            body += (f"\n\nWhile `save_async` writes the same state in the background: a step takes "
                     f"{spread(r, 'step_during_save_ms')} ms against {spread(r, 'step_ms')} ms without a save "
                     f"({r['ratio']:.2f}x); the save took {spread(r, 'save_s')} s from the call to `wait_save()`.")
    return body


def block_ops(rows):
    # raw: the runtime or cuBLAS call swapopt makes, called directly on the same stream (CUDA only).
    # The direct-call columns only where some row has one.
    direct = any("raw_host_us" in r for r in rows)
    header = ["op", "swapopt ops per call", "host us per call", "host us per op", "issue + wait us per call"]
    if direct:
        header += ["direct call: host us", "swapopt / direct (host)"]
    body = []
    for r in rows:
        line = [r["op"], r["ops"], spread(r, "host_us"), f"{r['host_us'] / r['ops']:.2f}", spread(r, "wall_us")]
        if direct:
            line += [spread(r, "raw_host_us"), f"{r['host_us'] / r['raw_host_us']:.2f}"] if "raw_host_us" in r else ["-", "-"]
        body.append(line)
    return table(header, body)


def replace_block(text, name, device, body):
    begin, end = f"<!-- begin bench {name} {device} -->", f"<!-- end bench {name} {device} -->"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        print(f"report: docs/benchmarks.md has no block '{name} {device}'; left out", file=sys.stderr)
        return text
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def render(args):
    data = os.path.join(args.docs, "data", args.device)
    img = os.path.join(args.docs, "img")
    os.makedirs(img, exist_ok=True)
    rows = {name: load(data, name) for name in COMMANDS}
    if not any(rows.values()):
        sys.exit(f"report: no results in {data}")
    info_path = os.path.join(data, "machine.json")
    info = json.load(open(info_path)) if os.path.exists(info_path) else {}
    doc_path = os.path.join(args.docs, "benchmarks.md")
    text = open(doc_path).read()
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        def png(name):
            path = os.path.join(img, f"{name}-{args.device}.png")
            written.append(path)
            return path
        if rows["ns"]:
            plot_ns(rows["ns"], png("ns"), tmp, args.device)
            text = replace_block(text, "ns", args.device, block_ns(rows["ns"]))
        if rows["momentum"]:
            plot_momentum(rows["momentum"], png("momentum"), tmp, args.device)
            text = replace_block(text, "momentum", args.device, block_momentum(rows["momentum"]))
        if rows["swap"]:
            plot_swap(rows["swap"], png("swap"), tmp, args.device)
            text = replace_block(text, "swap", args.device, block_swap(rows["swap"]))
        if rows["step"] and rows["adamw"]:
            plot_steps(rows["step"], rows["adamw"], png("steps"), tmp, args.device)
            text = replace_block(text, "step", args.device, block_step(rows["step"]))
            text = replace_block(text, "adamw", args.device, block_adamw(rows["adamw"]))
        if rows["scale"]:
            plot_scale(rows["scale"], rows["scale_retain"], png("scale"), tmp, args.device)
            text = replace_block(text, "scale", args.device, block_scale(rows["scale"], rows["scale_retain"]))
        if rows["checkpoint"]:
            plot_checkpoint([r for r in rows["checkpoint"] if r["bench"] == "checkpoint"], png("checkpoint"), tmp, args.device)
            text = replace_block(text, "checkpoint", args.device, block_checkpoint(rows["checkpoint"]))
        if rows["pipeline"]:
            plot_pipeline(rows["pipeline"], png("pipeline"), tmp, args.device)
            text = replace_block(text, "pipeline", args.device, block_pipeline(rows["pipeline"]))
        if rows["ops"]:
            text = replace_block(text, "ops", args.device, block_ops(rows["ops"]))
    text = replace_block(text, "machine", args.device, block_machine(info, args.device))
    with open(doc_path, "w") as f:
        f.write(text)
    print(f"report: {doc_path} regenerated from {data}; plots: {', '.join(written) or 'none'}", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["run", "render"])
    parser.add_argument("--build", default="build")
    parser.add_argument("--docs", default="docs")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--only", nargs="+", choices=list(COMMANDS), help="run these benchmarks alone (render all)")
    parser.add_argument("--no-render", action="store_true", help="run only: keep the JSON, draw nothing")
    args = parser.parse_args()
    (run if args.action == "run" else render)(args)


if __name__ == "__main__":
    main()
