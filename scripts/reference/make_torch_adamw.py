#!/usr/bin/env python3
"""torch.optim.AdamW's own f32 results (single-tensor and foreach agree bitwise), which swapopt's
AdamW must equal: the state bit for bit, each param within 1 ulp (torch's CPU sqrt is 1 ulp off
in about 0.7% of elements; swapopt's is correctly rounded). Writes tests/golden/adamw_torch.txt in
make_golden.py's format (%.9g round-trips every f32).

torch runs with ATEN_CPU_CAPABILITY=default: its vectorised lerp fuses a multiply-add on AVX2,
which swapopt never does (its CPU and CUDA backends give the same bits without it).

Inputs are not stored: every init and grad value is input_value(index, step, salt) below, a
multiple of 1/1024 that f32 holds exactly, which tests/optim/adamw_torch_test.cpp computes the
same way. Param "b" has no grad at step 3, so its step count (and bias corrections) lag the
others'.

Run: python3 scripts/reference/make_torch_adamw.py   (needs torch; CI only reads the output)
"""
import os

os.environ["ATEN_CPU_CAPABILITY"] = "default"  # before torch loads: no fused multiply-adds
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "tests", "golden", "adamw_torch.txt")
STEPS = 6

# (group options, [(name, shape, grad scale)]); group 2's tiny grads make eps matter.
GROUPS = [
    (dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False),
     [("w", (24, 40), 1.0), ("b", (37,), 1.0)]),
    (dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True), [("n", (500,), 1.0)]),
    (dict(lr=1e-3, betas=(0.95, 0.9999), eps=1e-8, weight_decay=0.0, amsgrad=False), [("s", (16, 31), 2.0**-16)]),
]


def input_value(index, step, salt):
    """A value in [-1000/1024, 1000/1024], exact in f32: a hash of (index, step, salt)."""
    h = (index * 2654435761 + step * 40503 + salt * 97) % 2**32
    return ((h % 2001) - 1000) / 1024.0


def tensor_of(shape, step, salt, scale=1.0):
    n = 1
    for d in shape:
        n *= d
    return torch.tensor([input_value(i, step, salt) * scale for i in range(n)], dtype=torch.float32).reshape(shape)


def has_grad(name, step):
    return not (name == "b" and step == 3)


def run(foreach):
    params, groups = {}, []
    for gi, (options, specs) in enumerate(GROUPS):
        group = []
        for pi, (name, shape, _) in enumerate(specs):
            params[name] = torch.nn.Parameter(tensor_of(shape, 0, 10 * gi + pi))
            group.append(params[name])
        groups.append(dict(params=group, **options))
    opt = torch.optim.AdamW(groups, foreach=foreach)
    for step in range(1, STEPS + 1):
        for gi, (_, specs) in enumerate(GROUPS):
            for pi, (name, shape, scale) in enumerate(specs):
                params[name].grad = tensor_of(shape, step, 10 * gi + pi, scale) if has_grad(name, step) else None
        opt.step()
    return params, opt


def main():
    params, opt = run(foreach=False)
    other, _ = run(foreach=True)
    for name in params:
        assert torch.equal(params[name], other[name]), f"single-tensor and foreach differ at {name}"
    with open(OUT, "w") as f:
        for name, p in params.items():
            tensors = [("param", p.detach())] + [(k, v) for k, v in opt.state[p].items() if k != "step"]
            for key, t in tensors:
                f.write(f"tensor {name}.{key} {t.dim()} {' '.join(str(d) for d in t.shape)}\n")
                f.write(" ".join(f"{v:.9g}" for v in t.flatten().tolist()) + "\n")
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT", torch.backends.cpu.get_cpu_capability()
    print(f"wrote {os.path.relpath(OUT)} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
