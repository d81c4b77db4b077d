"""First-call cost: wall time of a first forward+backward (bf16 rows of 4096, float32 w and b)
and of a first jagged forward+backward (float32, D = 256), each in a fresh process, first with
an empty kernel cache (NVRTC builds every kernel) and then with the cache the first process
left (CuPy loads the built kernels from disk), and of the same calls once warm.
    python scripts/first_call.py"""

import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
import cupy
t0 = time.perf_counter()
import cupyln
from cupyln import reference as ref
x = ref.sample((1024, 4096), "bfloat16", seed=1)
w = ref.sample((4096,), "float32", seed=2)
v = ref.sample((3000, 256), "float32", seed=3)
off = cupy.asarray([0, 1000, 1001, 3000], cupy.int64)
cupy.cuda.runtime.deviceSynchronize()

def dense():
    y, mean, rstd = cupyln.forward(x, w, w)
    cupyln.backward(y, x, w, mean, rstd)

def jagged():
    y, mean, rstd = cupyln.jagged_forward(v, off, w[:256], w[:256])
    cupyln.jagged_backward(y, v, off, w[:256], mean, rstd)

out = {}
for name, fn in (("dense", dense), ("jagged", jagged)):
    for when in ("first", "warm"):
        t = time.perf_counter()
        fn()
        cupy.cuda.runtime.deviceSynchronize()
        out[f"{name} {when}"] = time.perf_counter() - t
print(json.dumps(out))
"""


def run(cache: str) -> dict:
    env = dict(os.environ, CUPY_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        cold, cached = run(cache), run(cache)
    print(f"{'call':8s} {'empty cache':>12s} {'cached':>8s} {'warm':>8s}")
    for name in ("dense", "jagged"):
        print(f"{name:8s} {cold[name + ' first']:11.2f}s {cached[name + ' first']:7.2f}s "
              f"{cold[name + ' warm'] * 1e3:6.2f}ms")  # fmt: skip


if __name__ == "__main__":
    main()
