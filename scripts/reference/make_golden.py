#!/usr/bin/env python3
"""Golden inputs/outputs for swapopt's Muon and AdamW tests, computed independently in numpy (f64).

Muon follows the reference system's math (SGD-form momentum, asym5/legacy Newton-Schulz on the
2-D core shape, scale sqrt(max(rows, cols)) * matched_adamw_rms, decoupled decay); AdamW follows
torch.optim.AdamW's documented algorithm. Writes tests/golden/{muon,adamw}.txt:

    tensor <name> <ndim> <dims...>
    <values, %.9g, one line>

Run: python3 scripts/reference/make_golden.py   (needs numpy only)
"""
import os
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "golden")

ASYM5 = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
         (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
LEGACY = (3.4445, -4.7750, 2.0315)


class Writer:
    def __init__(self, path):
        self.f = open(path, "w")

    def tensor(self, name, a):
        a = np.asarray(a, dtype=np.float32)
        self.f.write(f"tensor {name} {a.ndim} {' '.join(str(d) for d in a.shape)}\n")
        self.f.write(" ".join(f"{v:.9g}" for v in a.ravel()) + "\n")


def newton_schulz(x, schedule, eps):
    """x: [m, n] in f64. Iterates on the wide orientation, as the reference does."""
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in schedule:
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if tall else x


def core_matrices(shape):
    if len(shape) == 3 and shape[1] == 1:
        return shape[0], shape[2]
    return shape[-2], shape[-1]


def muon_step(p, g, buf, opt, schedule):
    m1, m2 = opt["momentum"], opt.get("momentum2", opt["momentum"])
    u = g + m1 * buf
    buf = m2 * buf + g
    if opt["nesterov"]:
        u = m1 * u + g
    rows, cols = core_matrices(p.shape)
    mats = u.reshape(-1, rows, cols)
    upd = np.stack([newton_schulz(m, schedule, opt["ns_epsilon"]) for m in mats]).reshape(p.shape)
    scale = np.sqrt(max(rows, cols)) * opt["matched_adamw_rms"]
    p = p * (1 - opt["lr"] * opt["weight_decay"]) + (-opt["lr"] * scale) * upd
    return p, buf


def muon_golden(rng):
    w = Writer(os.path.join(OUT, "muon.txt"))
    groups = [
        # group 0: reference defaults; wide, tall, square, and a batch of equal core shapes
        (dict(lr=2e-2, weight_decay=0.1, matched_adamw_rms=0.2, momentum=0.95, nesterov=True, ns_epsilon=1e-10),
         ASYM5, [("wide", (8, 16)), ("tall", (16, 8)), ("square", (12, 12)), ("experts", (3, 6, 10)),
                 ("single", (6, 10)), ("squeezed", (5, 1, 9))]),
        # group 1: legacy NS, momentum pair, no nesterov, no decay
        (dict(lr=5e-2, weight_decay=0.0, matched_adamw_rms=0.2, momentum=0.9, momentum2=0.8, nesterov=False,
              ns_epsilon=1e-7), [LEGACY] * 5, [("legacy", (5, 7))]),
    ]
    # group 2: nesterov with momentum2 != momentum (the nesterov step uses momentum, the buffer
    # momentum2). Drawn from a generator of its own, so the values of groups 0-1 and of adamw.txt
    # stay as they were.
    extra = [
        (dict(lr=3e-2, weight_decay=0.05, matched_adamw_rms=0.2, momentum=0.9, momentum2=0.6, nesterov=True,
              ns_epsilon=1e-7), ASYM5, [("nesterov_wide", (6, 10)), ("nesterov_tall", (12, 8))]),
    ]
    write_muon_groups(w, rng, groups, first_index=0)
    write_muon_groups(w, np.random.default_rng(20261203), extra, first_index=len(groups))


def write_muon_groups(w, rng, groups, first_index):
    steps = 3
    for gi, (opt, schedule, params) in enumerate(groups, start=first_index):
        for name, shape in params:
            p = rng.standard_normal(shape) * 0.1
            p = p.astype(np.float32).astype(np.float64)
            w.tensor(f"g{gi}.{name}.init", p)
            buf = np.zeros(shape)
            for step in range(1, steps + 1):
                if name == "square" and step == 2:
                    continue  # no grad this step: skipped, nothing changes
                g = rng.standard_normal(shape).astype(np.float32).astype(np.float64)
                w.tensor(f"g{gi}.{name}.grad{step}", g)
                p, buf = muon_step(p, g, buf, opt, schedule)
                w.tensor(f"g{gi}.{name}.param{step}", p)
            w.tensor(f"g{gi}.{name}.momentum_buffer", buf)


def adamw_golden(rng):
    w = Writer(os.path.join(OUT, "adamw.txt"))
    groups = [
        (dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, amsgrad=False),
         [("bias", (16,)), ("embed", (4, 5))]),
        (dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, amsgrad=True), [("norm", (7,))]),
    ]
    for gi, (o, params) in enumerate(groups):
        for name, shape in params:
            p = (rng.standard_normal(shape) * 0.5).astype(np.float32).astype(np.float64)
            w.tensor(f"g{gi}.{name}.init", p)
            m = np.zeros(shape)
            v = np.zeros(shape)
            vmax = np.zeros(shape)
            for t in range(1, 4):
                g = rng.standard_normal(shape).astype(np.float32).astype(np.float64)
                w.tensor(f"g{gi}.{name}.grad{t}", g)
                p = p * (1 - o["lr"] * o["weight_decay"])
                m = o["beta1"] * m + (1 - o["beta1"]) * g
                v = o["beta2"] * v + (1 - o["beta2"]) * g * g
                bc1 = 1 - o["beta1"] ** t
                bc2 = 1 - o["beta2"] ** t
                if o["amsgrad"]:
                    vmax = np.maximum(vmax, v)
                    denom = np.sqrt(vmax) / np.sqrt(bc2) + o["eps"]
                else:
                    denom = np.sqrt(v) / np.sqrt(bc2) + o["eps"]
                p = p - (o["lr"] / bc1) * m / denom
                w.tensor(f"g{gi}.{name}.param{t}", p)
            w.tensor(f"g{gi}.{name}.exp_avg", m)
            w.tensor(f"g{gi}.{name}.exp_avg_sq", v)
            if o["amsgrad"]:
                w.tensor(f"g{gi}.{name}.max_exp_avg_sq", vmax)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(20261202)
    muon_golden(rng)
    adamw_golden(rng)
    print("wrote", os.path.normpath(OUT))
