#!/usr/bin/env python3
"""The same optimizer steps in PyTorch (torch.optim.Muon, torch.optim.AdamW foreach and fused) on
the shapes of `swapopt-bench step` / `swapopt-bench adamw`, with the same thread count, printed
next to swapopt's figures (run in the same invocation) with the ratio.

    python3 bench/peer_torch.py [--bench build/bench/swapopt-bench] [--dim 512] [--reps 5] [--threads 2]

Needs torch (PyPI). Prints JSON lines, then a table. Medians of --reps runs after one warm-up.
Unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the calling shell when timing (see docs/benchmarks.md).
"""
import argparse
import json
import statistics
import subprocess
import time

import torch


def model(dim, layers):
    g = torch.Generator().manual_seed(0)
    mats, vecs = [], []
    for _ in range(layers):
        for shape in [(3 * dim, dim), (dim, dim), (4 * dim, dim), (dim, 4 * dim)]:
            mats.append(torch.randn(shape, generator=g))
        vecs.append(torch.randn(dim, generator=g))
    for p in mats + vecs:
        p.requires_grad_(True)
        p.grad = torch.randn(p.shape, generator=g)
    return mats, vecs


ASYM5 = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
         (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


@torch.no_grad()
def muon_f32(params, bufs, lr=0.02, wd=0.1, m=0.95, rms=0.2, eps=1e-10):
    """swapopt's default Muon step (asym5, nesterov, matched AdamW RMS) in f32 torch ops."""
    for p, buf in zip(params, bufs):
        g = p.grad
        u = g + m * buf
        buf.mul_(m).add_(g)
        u = m * u + g
        x = u.T if u.shape[0] > u.shape[1] else u
        x = x / (x.norm() + eps)
        for a, b, c in ASYM5:
            A = x @ x.T
            x = a * x + (b * A + c * (A @ A)) @ x
        if u.shape[0] > u.shape[1]:
            x = x.T
        p.mul_(1 - lr * wd).add_(x, alpha=-lr * rms * max(p.shape) ** 0.5)


def median_ms(step, reps):
    step()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def swapopt(bench, command, dim, reps):
    out = subprocess.run([bench, command, "--dim", str(dim), "--reps", str(reps)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", default="build/bench/swapopt-bench")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--with-bf16-muon", action="store_true", help="also time torch.optim.Muon (bf16 NS; minutes per step on CPUs without bf16 units)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = 4
    rows = []

    ours = swapopt(a.bench, "step", a.dim, a.reps)
    # The same math in f32 with torch ops (swapopt's CPU default is f32 Newton-Schulz).
    mats, vecs = model(a.dim, layers)
    bufs = [torch.zeros_like(p) for p in mats]
    adamw = torch.optim.AdamW(vecs, lr=1e-3, foreach=True)
    rows.append(("Muon+AdamW step (torch ops, f32 NS)", median_ms(lambda: (muon_f32(mats, bufs), adamw.step()), a.reps),
                 ours["step_ms"]))
    if a.with_bf16_muon:  # torch.optim.Muon runs NS in bf16: very slow on CPUs without bf16 units
        mats, vecs = model(a.dim, layers)
        muon = torch.optim.Muon(mats, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(vecs, lr=1e-3, foreach=True)
        rows.append(("Muon+AdamW step (torch.optim.Muon, bf16 NS)", median_ms(lambda: (muon.step(), adamw.step()), a.reps),
                     ours["step_ms"]))

    for impl in ("foreach", "fused"):
        mats, vecs = model(a.dim, layers)
        opt = torch.optim.AdamW(mats + vecs, lr=1e-3, **{impl: True})
        try:
            t = median_ms(opt.step, a.reps)
        except RuntimeError as e:  # fused may be unavailable for a device
            print(json.dumps({"bench": "peer", "impl": f"adamw_{impl}", "error": str(e)}))
            continue
        ours = swapopt(a.bench, "adamw", a.dim, a.reps)
        rows.append((f"AdamW step (torch {impl})", t, ours["step_ms"]))

    for name, theirs, ours in rows:
        print(json.dumps({"bench": "peer", "what": name, "dim": a.dim, "threads": a.threads, "torch_ms": round(theirs, 3),
                          "swapopt_ms": round(ours, 3), "speedup": round(theirs / ours, 3)}))
    print(f"\n{'step':40s} {'torch ms':>10s} {'swapopt ms':>11s} {'speedup':>8s}")
    for name, theirs, ours in rows:
        print(f"{name:40s} {theirs:10.2f} {ours:11.2f} {theirs / ours:8.2f}")
    print(f"(torch {torch.__version__}, {a.threads} threads, width {a.dim}, {layers} layers)")


if __name__ == "__main__":
    main()
