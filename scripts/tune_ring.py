"""Measure the dense forward's ring tier (kernels/jagged.cu ln_fwd_ring) against the tier the
launcher picks on wide rows (register, row or cluster), to set the ring's block shapes and where
the register tier stops.

    python scripts/tune_ring.py [--n 8192,16384] [--dtypes bfloat16,float32]

For each width N (M = 2**27 // N rows, w and b of x's dtype) it times the launcher's plan, then
every ring block shape with the register tier switched off (blocks per SM sharing the shared
memory, threads per block), checks each against the first, and prints GB/s (2 * bytes of x)
and the share of the copy bandwidth measured in the same run.
"""

import argparse
import itertools
import os
import sys

import cupy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cupyln import _api, _launch, bench  # noqa: E402
from cupyln import reference as ref  # noqa: E402

KNOBS = ("REG_BLOCK_MAX", "FWD_REG_BLOCK_MAX", "RING_SPLIT", "RING_BLOCK_SPLIT", "RING_BLOCK")


def run(x, w, settings):
    for name, value in settings.items():
        setattr(_launch, name, value)
    _api.forget_forward_plans()
    y = _api.forward(x, w, w)[0]
    ms = bench.time_ms(lambda: _api.forward(x, w, w))
    return y, ms, _api.describe(x, w, w)["forward"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="8192,12288,16384,24576,32768,65536")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    defaults = {k: getattr(_launch, k) for k in KNOBS}
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for dtype, n in itertools.product(args.dtypes.split(","), map(int, args.n.split(","))):
        x = ref.sample((2**27 // n, n), dtype, seed=0)
        w = ref.sample((n,), dtype, loc=1.0, scale=0.2, seed=1)
        gb = 2 * x.nbytes * 1e-6
        first, seen = None, set()
        shapes = [{}] + [
            dict(
                REG_BLOCK_MAX=0,
                FWD_REG_BLOCK_MAX=0,
                RING_SPLIT=k,
                RING_BLOCK_SPLIT=blk,
                RING_BLOCK=alone,
            )
            for k, blk, alone in itertools.product((1, 2, 3), (256, 512), (256, 512))
        ]
        for settings in shapes:
            y, ms, desc = run(x, w, {**defaults, **settings})
            if desc in seen:
                continue
            seen.add(desc)
            first = y if first is None else first
            same = bool(cupy.allclose(y.astype(cupy.float32), first.astype(cupy.float32),
                                      rtol=2e-2, atol=2e-2))  # fmt: skip
            g = gb / ms
            print(f"{dtype:8s} N={n:6d} {g:5.0f} GB/s ({g / copy:4.0%}) {desc}"
                  f"{'' if same else '  MISMATCH'}", flush=True)  # fmt: skip
        for name, value in defaults.items():
            setattr(_launch, name, value)


if __name__ == "__main__":
    main()
