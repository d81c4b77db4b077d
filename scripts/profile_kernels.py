"""Run one forward or backward shape a few times, for a profiler to capture its kernels.

    ncu --clock-control none -k regex:ln_bwd --launch-skip 2 --launch-count 1 \\
        python scripts/profile_kernels.py backward bfloat16 16384

M = 2**27 // N rows, w and b of x's dtype (the benchmark's data).
"""

import os
import sys

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupyln  # noqa: E402
from cupyln import bench  # noqa: E402


def main():
    which, dtype, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    x, w, b, dy = bench._inputs(2**27 // n, n, numpy.dtype(dtype))
    _, mean, rstd = cupyln.forward(x, w, b)
    print(cupyln.describe(x, w, b)[which])
    for _ in range(4):
        if which == "forward":
            cupyln.forward(x, w, b)
        else:
            cupyln.backward(dy, x, w, mean, rstd)
    x.device.synchronize()


if __name__ == "__main__":
    main()
