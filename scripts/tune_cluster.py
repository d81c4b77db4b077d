"""Measure the cluster tiers (kernels/layer_norm_bwd.cu ln_bwd_cluster, layer_norm_fwd.cu
ln_fwd_cluster) against each other and the tiers without clusters on wide rows, to set the
cluster size (the smallest that fits, or larger ones with more rows in each ring).

    python scripts/tune_cluster.py [--n 16384,32768] [--dtypes bfloat16,float32] [--forward]

For each width N (M = 2**27 // N rows, w and b of x's dtype) it times the plan without clusters,
then every cluster size whose slices fit (in the backward, 1 is the ring tier), checks the
results against the first, and prints GB/s (backward: 3 * bytes of x, x and dy read and dx
written; forward: 2 *) and the share of the copy bandwidth measured in the same run, with the
rows of slices each ring holds. --alt times another layer_norm_bwd.cu beside the package's.
"""

import argparse
import hashlib
import itertools
import os
import pathlib
import sys

import cupy
import numpy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cupyln import _api, _compile, _launch, bench  # noqa: E402

_shape = _launch._bwd_ring_shape
_source = _compile.source


def forced(cluster):
    """A _bwd_ring_shape that takes exactly ``cluster`` (None: never, the row tier)."""

    def shape(n, vec, itemsize, values, share, max_cluster):
        if cluster is None:
            return None
        got = _launch._bwd_slice_rows(n, vec, itemsize, values, share, cluster)
        if got is None:
            return None
        items, rows, row_bytes = got
        return cluster, items, int(cluster > 1 and rows >= 2), rows * row_bytes

    return shape


def _close(a, b):
    a, b = a.astype(cupy.float32), b.astype(cupy.float32)
    return bool(cupy.allclose(a, b, rtol=2e-2, atol=2e-2))


def run(x, w, dy, cluster):
    _launch._bwd_ring_shape = forced(cluster)
    _api._backward_launch.cache_clear()
    _api._backward_calls.clear()
    plan = _api._backward_launch(x.data.device_id, x.shape[1], x.dtype, w.dtype, w.dtype,
                                 16 // x.itemsize)[1]  # fmt: skip
    if (plan.tier == "row") != (cluster is None):
        return None
    _, mean, rstd = _api.forward(x, w, w)
    out = _api.backward(dy, x, w, mean, rstd)
    ms = bench.time_ms(lambda: _api.backward(dy, x, w, mean, rstd))
    return out, ms, _api.describe(x, w, w)["backward"]


FORWARD_KNOBS = ("FWD_CLUSTER_SPLIT", "FWD_CLUSTER_ROWS")


def forward(args, copy):
    defaults = {k: getattr(_launch, k) for k in FORWARD_KNOBS}
    pick = _launch._fwd_cluster
    settings = [None] + [
        dict(FWD_CLUSTER_SPLIT=k, FWD_CLUSTER_ROWS=rows, affine=affine)
        for k, rows, affine in (
            (1, 2, True),
            (1, 2, False),
            (2, 1, True),
            (3, 1, True),
            (3, 1, False),
            (1, 3, True),
        )  # fmt: skip
    ]
    for dtype, n in itertools.product(args.dtypes.split(","), map(int, args.n.split(","))):
        x, w, _, _ = bench._inputs(2**27 // n, n, numpy.dtype(dtype))
        first = None
        for knobs in settings:
            knobs = dict(knobs or {})
            affine = knobs.pop("affine", True)
            for name, value in {**defaults, **knobs}.items():
                setattr(_launch, name, value)
            _launch._fwd_cluster = pick if knobs else (lambda *a: None)
            _api.forget_forward_plans()
            wb = (w, w) if affine else (None, None)
            desc = _api.describe(x, *wb)["forward"]
            if knobs and "cluster" not in desc:
                continue
            out = _api.forward(x, *wb)
            ms = bench.time_ms(lambda x=x, wb=wb: _api.forward(x, *wb))
            if affine:
                first = out if first is None else first
                same = all(_close(a, b) for a, b in zip(out, first))
            else:
                same = True
            g = 2 * x.nbytes * 1e-6 / ms
            print(f"fwd {dtype:8s} N={n:6d} {g:5.0f} GB/s ({g / copy:4.0%}) {knobs} "
                  f"affine={affine} {desc}{'' if same else '  MISMATCH'}", flush=True)  # fmt: skip
    for name, value in defaults.items():
        setattr(_launch, name, value)
    _launch._fwd_cluster = pick


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="12288,16384,24576,32768,65536")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--alt", default="", help="another layer_norm_bwd.cu to time beside it")
    ap.add_argument("--forward", action="store_true", help="the forward instead")
    args = ap.parse_args()
    sources = [_compile.source(_compile.BWD_SOURCE)]
    if args.alt:
        sources.append(_compile._inline(pathlib.Path(args.alt).resolve(), set()))
        sources[-1] = (sources[-1], hashlib.sha256(sources[-1].encode()).hexdigest())
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    if args.forward:
        return forward(args, copy)
    for dtype, n in itertools.product(args.dtypes.split(","), map(int, args.n.split(","))):
        x, w, _, dy = bench._inputs(2**27 // n, n, numpy.dtype(dtype))
        gb = 3 * x.nbytes * 1e-6
        first = None
        for cluster, (k, src) in itertools.product((None, 1, 2, 4, 8), enumerate(sources)):
            if cluster is None and k:
                continue
            _compile.source = lambda name, src=src, orig=_compile.source: (
                src if name == _compile.BWD_SOURCE else orig(name)
            )
            _compile._kernels.clear()
            got = run(x, w, dy, cluster)
            _compile.source = _source
            if got is None:
                continue
            out, ms, desc = got
            first = out if first is None else first
            same = all(_close(a, b) for a, b in zip(out, first))
            g = gb / ms
            share = _launch._share(_api._device(x.data.device_id).smem_optin)
            rows = share // (2 * x.nbytes // x.shape[0] // (cluster or 1))
            print(f"{'ab'[k]} {dtype:8s} N={n:6d} {g:5.0f} GB/s ({g / copy:4.0%}) rows/ring={rows} "
                  f"{desc}{'' if same else '  MISMATCH'}", flush=True)  # fmt: skip
    _launch._bwd_ring_shape = _shape


if __name__ == "__main__":
    main()
