"""A forward launch block by block: the runs of docs/benchmark-log.md's section on where the widest
forward rows lose.

The package's forward source is patched here (not in the package) so that every block of the
register rows, the stream tier and the register clusters stamps `%globaltimer` and `%smid` at
three points of each row: when it starts the row, when the row's mean is known (every load of
the row has landed), and when its last store has been issued. A device pointer set through
the module's global `cupyln_trace` turns the stamps on (null: off, the same kernel). Each case
is checked against float64, timed with the stamps off and on (CUDA events, L2 flushed, least
of 3 medians), then traced in three calls after an L2 flush; the median call is summarized:

* the first round (rows started within 1 us of their SM's first start): when their loads
  landed and their stores were issued, and when the next round started;
* the medians of a row's two phases (start -> mean known, mean -> stores issued), first round
  and later rows;
* the last store on each SM;
* the steady rate of stores issued (the slope between the 25th and the 85th percentile of the
  rows' last stores) and where that line, drawn back, meets zero.

    python scripts/timeline.py [--no-affine] [--out DIR] bfloat16 4096x32768 2048x65536

--no-affine: w and b not given; --out: an .npz of the stamps (SM, start, mean, stores) a case.
"""

import argparse
import os
import sys

import cupy as cp
import ml_dtypes  # noqa: F401
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupyln  # noqa: E402
from cupyln import _compile, bench  # noqa: E402
from cupyln import reference as ref  # noqa: E402

ORIGINAL = _compile.source.__wrapped__
HEADER = r"""
extern "C" { __device__ unsigned long long* cupyln_trace = nullptr; }
__device__ __forceinline__ unsigned long long stamp_time() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned stamp_sm() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
#define TRACE(idx, cond)                                                   \
  do {                                                                     \
    if (cupyln_trace != nullptr && (cond)) {                               \
      unsigned long long* p_ = cupyln_trace + 4 * (idx);                   \
      p_[0] = stamp_sm(); p_[1] = T0; p_[2] = T1; p_[3] = stamp_time();    \
    }                                                                      \
  } while (0)
"""
T0 = "const unsigned long long T0 = stamp_time();"
T1 = "const unsigned long long T1 = stamp_time();"
# (text, the same text stamped): each must occur once in the forward source
PATCHES = [
    # register rows
    (
        "row < M; row += step) {\n    const T* __restrict__ xr = x + row * x_stride;",
        f"row < M; row += step) {{\n    {T0}\n    const T* __restrict__ xr = x + row * x_stride;",
    ),
    (
        "const A mu = group_sum<TPR, false>(held_sum(held_x, k, held), red[0]) * inv_n;\n",
        "const A mu = group_sum<TPR, false>(held_sum(held_x, k, held), red[0]) * inv_n;\n"
        f"    {T1}\n",
    ),
    (
        "normalize_store<T, TW, TB, A, VEC>(held_x[i], k, d, r, w, b, col, yr + col);\n    }\n",
        "normalize_store<T, TW, TB, A, VEC>(held_x[i], k, d, r, w, b, col, yr + col);\n    }\n"
        "    TRACE(row, lane == 0);\n",
    ),
    # stream rows
    ("  if (row >= M) return;\n  // PARTIAL", f"  if (row >= M) return;\n  {T0}\n  // PARTIAL"),
    ("  const A off = k + mr;\n", f"  const A off = k + mr;\n  {T1}\n"),
    (
        '    if (j + 1 < NCH) cur = next;\n  }\n}\n\n// Tier "reg" split',
        '    if (j + 1 < NCH) cur = next;\n  }\n  TRACE(row, t == 0);\n}\n\n// Tier "reg" split',
    ),
    # register clusters (one row a block at a time)
    (
        "    for (; row < M; row += step) {\n      load(0, row);\n      send(0);\n"
        "      finish(0, row);\n    }",
        f"    for (; row < M; row += step) {{\n      {T0}\n      load(0, row);\n      send(0);\n"
        f"      {T1}\n      finish(0, row);\n      TRACE(row * C + rank, t == 0);\n    }}",
    ),
]


def stamped(name):
    text, digest = ORIGINAL(name)
    if name != _compile.FWD_SOURCE:
        return text, digest
    for old, new in PATCHES:
        if text.count(old) != 1:
            raise RuntimeError(f"the forward source changed; not found once: {old[:60]!r}")
        text = text.replace(old, new)
    return text.replace("namespace cupyln {", HEADER + "namespace cupyln {", 1), digest + "-stamped"


def spread(a, ps=(0, 50, 100)):
    return " / ".join(f"{np.percentile(a, p):.1f}" for p in ps)


def summarize(tr, nbytes, copy):
    """Print the summary of one traced call's stamps (rows of SM, start, mean, stores)."""
    sm = tr[:, 0].astype(int)
    start = tr[:, 1].astype(np.int64)
    base = start.min()
    t0 = (start - base) / 1e3
    t1 = (tr[:, 2].astype(np.int64) - base) / 1e3
    t3 = (tr[:, 3].astype(np.int64) - base) / 1e3
    sms = np.unique(sm)
    first = np.array([t0[sm == s].min() for s in sms])
    last = np.array([t3[sm == s].max() for s in sms])
    fr = t0 <= first[np.searchsorted(sms, sm)] + 1.0
    print(
        f"    first start -> last store {t3.max():.1f} us; {len(tr)} rows (or slices) on "
        f"{len(sms)} SMs"
    )
    print(
        f"    first round ({fr.sum()}): loads landed {t1[fr].min():.1f}-{t1[fr].max():.1f} us, "
        f"stores issued {t3[fr].min():.1f}-{t3[fr].max():.1f} us; next round from "
        f"{t0[~fr].min():.1f} us"
    )
    print(
        f"    medians, first round / later: start -> mean {np.median(t1[fr] - t0[fr]):.1f} / "
        f"{np.median(t1[~fr] - t0[~fr]):.1f} us, mean -> stores issued "
        f"{np.median(t3[fr] - t1[fr]):.1f} / {np.median(t3[~fr] - t1[~fr]):.1f} us"
    )
    print(f"    last store an SM (min / median / max): {spread(last)} us")
    done = np.sort(t3)
    i0, i1 = int(0.25 * len(done)), int(0.85 * len(done))
    rate = (i1 - i0) / (done[i1] - done[i0])  # rows a microsecond
    gbs = rate * nbytes / len(done) * 1e-3
    print(
        f"    steady rate of stores issued {gbs:.0f} GB/s ({gbs / copy:.1%}), its line from "
        f"{done[i0] - i0 / rate:.1f} us"
    )


def run_case(dt, m, n, affine, copy, out):
    xs = [ref.sample((m, n), dt, seed=n + 7 * i) for i in range(2)]
    w = ref.sample((n,), dt, loc=1.0, scale=0.2, seed=n + 1) if affine else None
    b = ref.sample((n,), dt, loc=0.0, scale=0.2, seed=n + 2) if affine else None
    plan = cupyln.describe(xs[0], w, b)["forward"]
    y, _, _ = cupyln.forward(xs[0], w, b)
    ref.assert_close(y[:64], ref.forward(xs[0][:64], w, b)[0], "y")
    mod = [v for k, v in _compile._modules.items() if k[1] == _compile.FWD_SOURCE][-1]
    ptr = cp.ndarray((1,), cp.uint64, mod.get_global("cupyln_trace"))
    buf = cp.zeros((8 * m, 4), cp.uint64)  # up to 8 blocks a row
    turn = [0]

    def call():
        turn[0] += 1
        return cupyln.forward(xs[turn[0] % 2], w, b)

    nbytes = 2 * xs[0].nbytes
    plain = min(bench.time_ms(call) for _ in range(3))
    ptr[0] = buf.data.ptr
    traced = min(bench.time_ms(call) for _ in range(3))
    calls = []
    for i in range(3):  # one call each, after bench.time_ms's L2 flush
        buf.fill(0)
        ms = bench.time_ms(lambda i=i: cupyln.forward(xs[i % 2], w, b), reps=1, warmup=0)
        tr = buf.get()
        calls.append((ms * 1e3, tr[tr[:, 1] != 0]))
    ptr[0] = 0
    us, tr = sorted(calls, key=lambda c: c[0])[1]
    g = nbytes / plain * 1e-6
    print(
        f"  {m} x {n}, {'w and b' if affine else 'no w or b'} [{plan}]\n"
        f"    {plain * 1e3:.1f} us ({g / copy:.1%}), stamped {traced * 1e3:.1f} us; "
        f"the median stamped call {us:.1f} us",
        flush=True,
    )
    summarize(tr, nbytes, copy)
    if out:
        path = os.path.join(out, f"timeline_{dt.name}_{m}x{n}{'' if affine else '_plain'}.npz")
        np.savez_compressed(path, stamps=tr, call_us=us)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dtype")
    p.add_argument("cases", nargs="+", help="MxN")
    p.add_argument("--no-affine", action="store_true", help="w and b not given")
    p.add_argument("--out", help="folder for an .npz of the stamps of each case")
    args = p.parse_args(argv)
    _compile.source = stamped
    dt = cp.dtype(args.dtype)
    copy = bench.copy_bandwidth()
    print(f"{dt.name}, copy {copy:.0f} GB/s", flush=True)
    for case in args.cases:
        m, n = (int(v) for v in case.split("x"))
        run_case(dt, m, n, not args.no_affine, copy, args.out)


if __name__ == "__main__":
    main()
