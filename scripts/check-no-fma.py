#!/usr/bin/env python3
"""Build-time check that swapopt's CUDA kernels compute the CPU backend's formulas bit for bit.

The kernels and the CPU loops call the same functions (include/swapopt/core/elementwise_formulas.h);
the CPU side is compiled with -ffp-contract=off, the kernels with nvcc --fmad=false and IEEE
division and square root. This script reads the PTX embedded in the library (cuobjdump -ptx) and
fails if any kernel has what would change the bits:
  - a fused multiply-add (fma/mad on floats): contraction the CPU formula does not have;
  - a float mul/add/sub without an explicit rounding modifier (ptxas may fuse those into FFMA);
  - an approximate or flush-to-zero instruction (div.approx, div.full, sqrt.approx, rcp.approx, .ftz).
Correctly rounded div.rn / sqrt.rn are fine: ptxas expands them into exact sequences.

Usage: scripts/check-no-fma.py LIBRARY_OR_PTX [--cuobjdump PATH]
A .ptx file is read directly; otherwise cuobjdump (PyPI: nvidia-cuda-cuobjdump) extracts the PTX.
"""
import argparse
import re
import shutil
import subprocess
import sys

FLOAT = r"(?:f16|f16x2|bf16|bf16x2|f32|f32x2|f64)"
FORBIDDEN = [
    (re.compile(rf"\b(?:fma|mad)(?:\.[a-z0-9]+)*\.{FLOAT}\b"), "fused multiply-add"),
    (re.compile(rf"\b(?:mul|add|sub)(?:\.(?:sat|ftz))*\.{FLOAT}\b"), "float mul/add/sub without a rounding modifier"),
    (re.compile(r"\.approx\b|\bdiv\.full\b"), "approximate instruction"),
    (re.compile(r"\.ftz\b"), "flush-to-zero"),
]


def ptx_of(path, cuobjdump):
    if path.endswith(".ptx"):
        with open(path) as f:
            return f.read()
    tool = cuobjdump or shutil.which("cuobjdump")
    if tool is None:
        sys.exit("check-no-fma: cuobjdump not found (pip install nvidia-cuda-cuobjdump, or pass --cuobjdump)")
    return subprocess.run([tool, "-ptx", path], check=True, capture_output=True, text=True).stdout


def kernels(ptx):
    """(name, body lines) of every .entry kernel and .func device function (inlined or called)."""
    out, name, body = [], None, []
    for line in ptx.splitlines():
        m = re.search(r"\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([A-Za-z0-9_$]+)", line)
        if m:
            if name:
                out.append((name, body))
            name, body = m.group(1), []
        elif name:
            body.append(line)
    if name:
        out.append((name, body))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library")
    parser.add_argument("--cuobjdump")
    args = parser.parse_args()
    found = kernels(ptx_of(args.library, args.cuobjdump))
    if not any(True for _ in found):
        sys.exit(f"check-no-fma: no kernels in the PTX of {args.library} (built with CUDA and embedded PTX?)")
    bad = 0
    for name, body in found:
        for line in body:
            code = line.split("//")[0]
            for pattern, what in FORBIDDEN:
                if pattern.search(code):
                    print(f"check-no-fma: {what} in {name}: {code.strip()}")
                    bad += 1
    print(f"check-no-fma: {len(found)} kernels, {bad} forbidden instructions")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
