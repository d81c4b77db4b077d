"""python -m cupyln: info (versions, GPUs, kernel cache), check (every tier against the
float64 reference, the Triton tutorial's own check first), bench (GB/s against the copy
bandwidth) and plot (a saved bench --json file as a PNG)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys

from ._formats import FORMATS
from ._plans.devices import PROFILES


def _gpu_count() -> tuple[int, str]:
    """(number of CUDA devices, why none when 0)."""
    try:
        import cupy

        if cupy.cuda.runtime.driverGetVersion() == 0:
            return 0, "no NVIDIA driver found (libcuda.so.1 is missing: no GPU driver installed)"
        return cupy.cuda.runtime.getDeviceCount(), ""
    except ImportError as e:
        return 0, f"CuPy is not installed ({e}); pip install 'cupyln[cuda12]'"
    except Exception as e:  # noqa: BLE001 - any CUDA error means: no usable GPU
        return 0, f"{type(e).__name__}: {e}"


def cmd_info(_args) -> int:
    import numpy

    import cupyln

    print(f"cupyln {cupyln.__version__}  numpy {numpy.__version__}")
    try:
        import cupy
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        print(f"CuPy: not installed ({e})")
        return 0
    print(f"CuPy {cupy.__version__}  NVRTC {'.'.join(map(str, nvrtc.getVersion()))}")
    rt = cupy.cuda.runtime
    driver = rt.driverGetVersion()
    print(f"CUDA runtime {rt.runtimeGetVersion()}  driver {driver or 'none'}")
    default = os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    print(f"kernel cache: {os.environ.get('CUPY_CACHE_DIR', default)} (CuPy's, CUPY_CACHE_DIR)")
    n, why = _gpu_count()
    if n == 0:
        print(f"GPU: none found ({why})")
    for i in range(n):
        p = rt.getDeviceProperties(i)
        print(
            f"GPU {i}: {p['name'].decode()}  sm_{p['major']}{p['minor']}  "
            f"{p['multiProcessorCount']} SMs  {p['totalGlobalMem'] / 2**30:.0f} GiB  "
            f"L2 {p['l2CacheSize'] / 2**20:.0f} MiB"
        )
        print(f"       {_plans_read(i)}")
    return 0


def _plans_read(index: int) -> str:
    """What cupyln's plans read of GPU ``index``, or why it cannot run them."""
    from cupyln import _launcher

    try:
        d = _launcher.device(index)
    except RuntimeError as e:
        return str(e)
    return (f"plans read: {d.smem_block // 1024} KB shared memory a block, {d.smem_sm // 1024} "
            f"KB an SM, {d.threads_sm} threads an SM, clusters: {'yes' if d.clusters else 'no'}, "
            f"DRAM {d.dram / 1e9:.0f} GB/s")  # fmt: skip


# (label, shape, x dtype, w dtype, b dtype): odd widths, mixed dtypes, the tiers' edges
CHECK_CASES = (
    ("odd N, fp32", (37, 769), "float32", "float32", "float32"),
    ("bf16 x, fp32 w/b", (300, 4096), "bfloat16", "float32", "float32"),
    ("N = 3, no affine", (1000, 3), "float16", None, None),
    ("N = 1", (5, 1), "float32", "float32", "float32"),
    ("rank 3, fp64", (4, 7, 1000), "float64", "float64", "float64"),
    ("N = 32768, register / cluster tiers", (300, 32768), "bfloat16", "float32", "bfloat16"),
    ("N = 65536 fp32, cluster tiers", (200, 65536), "float32", "float32", "float32"),
    ("N = 65537, shared-memory tier", (6, 65537), "bfloat16", "bfloat16", "bfloat16"),
    ("N = 10^6, re-read tier", (2, 1_000_000), "float32", "float32", "float32"),
    ("M > 65535", (70000, 128), "bfloat16", "bfloat16", None),
)


def _check_case(label, shape, xdt, wdt, bdt, tutorial=False) -> bool:
    import cupy

    import cupyln
    from cupyln import reference as ref

    n = shape[-1]
    m = math.prod(shape[:-1])
    x = ref.sample(shape, xdt, seed=1)
    w = None if wdt is None else ref.sample((n,), wdt, loc=0.5, scale=0.3, seed=2)
    b = None if bdt is None else ref.sample((n,), bdt, loc=0.5, scale=0.3, seed=3)
    dy = ref.sample(shape, xdt, loc=0.0, scale=0.1 if tutorial else 1.0, seed=4)
    y, mean, rstd = cupyln.forward(x, w, b)
    dx, dw, db = cupyln.backward(dy, x, w, mean, rstd, db_dtype=bdt)
    cupy.cuda.get_current_stream().synchronize()
    yr, _, _ = ref.forward(x, w, b)
    dxr, dwr, dbr = ref.backward(dy, x, w, 1e-5, mean, rstd)  # at the saved statistics
    pairs = [("y", y, yr, 1.0), ("dx", dx, dxr, 1.0)]
    if dw is not None:
        pairs.append(("dw", dw, dwr, math.sqrt(m)))
    if bdt is not None:
        pairs.append(("db", db, dbr, math.sqrt(m)))
    ok = True
    parts = []
    for name, out, r, scale in pairs:
        err = float(cupy.abs(ref.to_float64(out) - r).max())
        if tutorial:  # the tutorial's own criterion: allclose(atol=1e-2, rtol=0)
            good = err <= 1e-2
        else:
            try:
                ar = "float64" if xdt == "float64" else "float32"
                ref.assert_close(out, r, name, atol_scale=scale, arithmetic=ar)
                good = True
            except AssertionError as e:
                print(f"    {e}")
                good = False
        ok &= good
        parts.append(f"{name} {err:.2e}{'' if good else ' FAIL'}")
    print(f"  {'ok  ' if ok else 'FAIL'} {label:32s} {str(shape):18s} {xdt:8s} " + "  ".join(parts))
    return ok


# the norm family: (label, shape, kind, x dtype, h dtype): RMSNorm, and the residual add in
# front of RMSNorm and LayerNorm, through the fused tiers and the unfused plan
FAMILY_CASES = (
    ("RMSNorm, odd N", (300, 769), "rms", "bfloat16", None),
    ("RMSNorm, N = 65536", (200, 65536), "rms", "bfloat16", None),
    ("add+RMSNorm, bf16", (500, 4096), "add_rms", "bfloat16", "bfloat16"),
    ("add+RMSNorm, fp32 residual stream", (300, 1000), "add_rms", "bfloat16", "float32"),
    ("add+LayerNorm, fp16", (500, 8192), "add_ln", "float16", "float16"),
    ("add+LayerNorm, unfused (N = 262144)", (8, 262144), "add_ln", "bfloat16", "float32"),
)


QUANT_CASES = (  # (format, its options, operands): RMSNorm, then add+LayerNorm, quantized
    ("fp8", {}, {"scale": 0.01}),
    ("fp8_row", {}, {}),
    ("fp8_block", {"block": 64, "pow2_scale": True}, {}),
    ("mxfp8", {"scale_layout": "cublas"}, {}),
    ("nvfp4", {}, {"global_amax": 8.0}),
)


def _check_quant(quant, opts, ops) -> bool:
    """y quantized in the norm's pass, dequantized, against the float64 y: the largest error
    within twice the reference quantization's own (a code apart where y's float32 rounding
    and the float64 reference's straddle a rounding boundary)."""
    import cupyln
    from cupyln import reference as ref

    ok = True
    for label, shape, dtype in (("RMSNorm", (500, 4096), "bfloat16"),
                                ("add+LayerNorm", (300, 8192), "float16")):  # fmt: skip
        n = shape[-1]
        x = ref.sample(shape, dtype, seed=11)
        w = ref.sample((n,), dtype, loc=1.0, scale=0.3, seed=12)
        b = ref.sample((n,), dtype, loc=0.0, scale=0.3, seed=13)
        if label == "RMSNorm":
            q = cupyln.rms_forward(x, w, quant=quant, **opts, **ops)[0]
            y = ref.rms_forward(x, w)[0]
        else:
            r = ref.sample(shape, dtype, loc=0.3, scale=1.0, seed=14)
            q, _, _, h = cupyln.forward(x, w, b, residual=r, quant=quant, **opts, **ops)
            y = ref.forward(h, w, b)[0]
        y = y.get()
        amax = ops.get("global_amax")
        got = ref.dequantize(q.data, q.scale, quant, n, global_amax=amax, **opts)
        data, scale = ref.quantize(y, quant, **opts, **ops)
        want = ref.dequantize(data, ops.get("scale", scale), quant, n, global_amax=amax, **opts)
        err, bound = abs(got - y).max(), 2 * abs(want - y).max() + 1e-6 * abs(y).max()
        good = bool(err <= bound)
        ok &= good
        print(f"  {'ok ' if good else 'BAD'} {quant:9s} {label:13s} {dtype:8s} {shape}: "
              f"{err:.3g} (reference {abs(want - y).max():.3g})")  # fmt: skip
    return ok


def _check_family(label, shape, kind, xdt, hdt) -> bool:
    """One family case, forward and backward (with dh), against the float64 reference at
    the saved statistics."""
    import cupyln
    from cupyln import reference as ref

    n = shape[-1]
    m = math.prod(shape[:-1])
    x = ref.sample(shape, xdt, seed=5)
    w = ref.sample((n,), xdt, loc=1.0, scale=0.3, seed=6)
    b = ref.sample((n,), xdt, loc=0.0, scale=0.3, seed=7)
    dy = ref.sample(shape, xdt, loc=0.0, scale=1.0, seed=8)
    pairs = []
    if kind == "rms":
        y, rstd = cupyln.rms_forward(x, w)
        dx, dw = cupyln.rms_backward(dy, x, w, rstd)
        pairs += [("y", y, ref.rms_forward(x, w)[0])]
        dxr, dwr = ref.rms_backward(dy, x, w, rstd)
    else:
        r = ref.sample(shape, hdt, loc=0.3, scale=1.0, seed=9)
        dh = ref.sample(shape, hdt, loc=0.0, scale=0.5, seed=10)
        if kind == "add_rms":
            y, rstd, h = cupyln.rms_forward(x, w, residual=r, residual_dtype=hdt)
            dx, dw = cupyln.rms_backward(dy, h, w, rstd, dh=dh)
            yr = ref.rms_forward(h, w)[0]
            dxr, dwr = ref.rms_backward(dy, h, w, rstd, dh=dh)
        else:
            y, mean, rstd, h = cupyln.forward(x, w, b, residual=r, residual_dtype=hdt)
            dx, dw, _ = cupyln.backward(dy, h, w, mean, rstd, dh=dh)
            yr = ref.forward(h, w, b)[0]
            dxr, dwr, _ = ref.backward(dy, h, w, 1e-5, mean, rstd)
            dxr = dxr + ref.to_float64(dh)
        same = bool((ref.to_float64(h) == ref.to_float64(ref.add(x, r, hdt))).all())
        pairs += [("y", y, yr)]
        if not same:
            print(f"  FAIL {label}: h is not x + residual rounded to {hdt}")
            return False
    pairs += [("dx", dx, dxr), ("dw", dw, dwr)]
    ok, parts = True, []
    for name, out, want in pairs:
        try:
            ref.assert_close(out, want, name, atol_scale=math.sqrt(m) if name == "dw" else 1.0)
            good = True
        except AssertionError as e:
            print(f"    {e}")
            good = False
        ok &= good
        parts.append(f"{name} {'ok' if good else 'FAIL'}")
    print(f"  {'ok  ' if ok else 'FAIL'} {label:36s} {str(shape):15s} {xdt:8s} " + "  ".join(parts))
    return ok


def cmd_check(_args) -> int:
    n, why = _gpu_count()
    if n == 0:
        print(f"cupyln check needs a CUDA GPU, and none is usable here: {why}", file=sys.stderr)
        return 2
    print("max |out - ref| against the float64 reference:")
    ok = _check_case(
        "Triton tutorial check (atol 1e-2)", (1151, 8192), "float16", "float16", "float16", True
    )
    for case in CHECK_CASES:
        ok &= _check_case(*case)
    for case in FAMILY_CASES:
        ok &= _check_family(*case)
    print("quantized y (quant=), max |dequantized - y|:")
    for case in QUANT_CASES:
        ok &= _check_quant(*case)
    print("check passed" if ok else "check FAILED")
    return 0 if ok else 1


def cmd_bench(args) -> int:
    n, why = _gpu_count()
    if n == 0:
        print(f"cupyln bench needs a CUDA GPU, and none is usable here: {why}", file=sys.stderr)
        return 2
    from cupyln import bench, bench_frameworks

    if args.overhead:
        for name, us in bench_frameworks.host_overhead_us().items():
            print(f"host time per {name} call (4 x 64 float32): {us:.1f} us")
        for name, us in bench_frameworks.torch_overhead_us().items():
            print(f"host time per call, {name} (4 x 64 float32): {us:.1f} us")
        return 0
    if args.jagged:
        return _bench_jagged(args, bench)
    if args.jax:
        for r in bench_frameworks.jax_bandwidth():
            print(f"{r['provider']:11s} jitted {r['dtype']} M={r['M']:<7d} N={r['N']:<6d} "
                  f"forward {r['fwd_GBs']:5.0f} GB/s ({r['fwd_ms'] * 1e3:6.1f} us), "
                  f"forward+backward {r['fwd_bwd_ms'] * 1e3:6.1f} us")  # fmt: skip
        return 0
    if args.train:
        for name, ms in bench_frameworks.training_step_ms().items():
            print(f"training step, 4-layer pre-LN block d=1024, 8 x 1024 tokens, bf16, {name}: "
                  f"{ms:.2f} ms")  # fmt: skip
        return 0
    ns = tuple(int(v) for v in args.n.split(",")) if args.n else bench.DEFAULT_NS

    def forward_line(width):  # a forward-only row, its provider in ``width`` columns
        def line(r):
            print(f"{r.provider:{width}s} {r.dtype:9s} M={r.M:<8d} N={r.N:<6d} fwd "
                  f"{r.fwd_GBs:6.0f} GB/s ({r.fwd_of_copy:4.0%})", flush=True)  # fmt: skip

        return line

    if args.peers and args.quant:
        from cupyln import bench_peers

        copy, rows = bench_peers.run_quant_peers(args.quant, args.dtype, 2**args.log2_elements,
                                                 ns, forward_line(24))  # fmt: skip
        print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
        return _save(args, bench, copy, rows)
    if args.peers:
        from cupyln import bench_peers

        def peer(r):
            print(f"{r.provider:14s} {r.dtype:9s} M={r.M:<8d} N={r.N:<6d} fwd {r.fwd_GBs:6.0f} "
                  f"GB/s ({r.fwd_of_copy:4.0%})  bwd {r.bwd_GBs:6.0f} GB/s "
                  f"({r.bwd_of_copy:4.0%}) {r.kernels}", flush=True)  # fmt: skip

        copy, rows = bench_peers.run_peers(args.norm, args.dtype, 2**args.log2_elements, ns,
                                           peer)  # fmt: skip
        print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
        return _save(args, bench, copy, rows)
    if args.quant:
        copy, rows = bench.run_quant(args.quant, args.dtype, 2**args.log2_elements, ns,
                                     args.norm, forward_line(16))  # fmt: skip
        print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
        return _save(args, bench, copy, rows)
    if args.emulate:
        from cupyln import _control

        _control.emulate(args.emulate)
        print(f"plans as on {PROFILES[args.emulate].name}, run on this GPU", flush=True)

    directions = bench.DIRECTIONS if args.direction == "both" else (args.direction,)

    def show(r):
        timed = (("fwd", r.fwd_GBs, r.fwd_of_copy), ("bwd", r.bwd_GBs, r.bwd_of_copy))
        cells = [
            f"{k} {gbs:6.0f} GB/s ({share:4.0%})" for k, gbs, share in timed if gbs is not None
        ]
        print(
            f"{r.provider:8s} {r.dtype:9s} M={r.M:<8d} N={r.N:<6d} " + "  ".join(cells), flush=True
        )
        if args.verbose and r.kernels:
            print(f"         {r.kernels}", flush=True)

    with _progress(len(ns)) as tick:

        def step(r):
            show(r)
            if r.provider == "cupyln":
                tick()

        copy, rows = bench.run(args.dtype, 2**args.log2_elements, ns, not args.no_torch, step,
                               args.compile, directions, args.norm)  # fmt: skip
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
    return _save(args, bench, copy, rows)


def _save(args, bench, copy, rows) -> int:
    """The sweep's rows to the files ``--csv``, ``--json`` and ``--plot`` name."""
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(bench.as_dicts(rows)[0]))
            wr.writeheader()
            wr.writerows(bench.as_dicts(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBs": copy, "rows": bench.as_dicts(rows)}, f, indent=1)
    if args.plot:
        bench.plot(rows, args.plot, copy, f"({args.dtype}, M*N = 2^{args.log2_elements})")
    return 0


class _progress:
    """A tqdm progress bar over the sweep's widths when tqdm is installed (on stderr, so the
    table on stdout stays clean); nothing otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.bar = None

    def __enter__(self):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="width", file=sys.stderr, leave=False)
        except ImportError:
            pass
        return lambda: self.bar.update(1) if self.bar is not None else None

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def _bench_jagged(args, bench) -> int:
    def show(r):
        print(
            f"{r['provider']:20s} {r['dtype']:9s} B={r['B']:<6d} D={r['D']:<4d} "
            f"fwd {r['fwd_GBs']:6.0f} GB/s ({r['fwd_of_copy']:4.0%})  "
            f"bwd {r['bwd_GBs']:6.0f} GB/s ({r['bwd_of_copy']:4.0%})",
            flush=True,
        )

    dtypes = tuple(args.dtype.split(",")) if args.dtype != "bfloat16" else ("float32", "bfloat16")
    copy, rows = bench.run_jagged(dtypes, progress=show)
    print(f"device-to-device copy: {copy:.0f} GB/s (read + write)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBs": copy, "rows": rows}, f, indent=1)
    return 0


def cmd_plot(args) -> int:
    """Render a saved ``bench --json`` file as a PNG (no GPU needed)."""
    from cupyln import bench

    with open(args.json) as f:
        data = json.load(f)
    rows = data["rows"]
    dtypes = sorted({r["dtype"] for r in rows})
    bench.plot(rows, args.png, data.get("copy_GBs"), f"({', '.join(dtypes)})")
    print(f"wrote {args.png}")
    return 0


def _version() -> str:
    from cupyln import __version__

    return __version__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cupyln", description=__doc__)
    p.add_argument("--version", action="version", version=f"cupyln {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="versions, GPUs, kernel cache")
    info.add_argument("--version", action="version", version=f"cupyln {_version()}")
    info.set_defaults(fn=cmd_info)
    sub.add_parser("check", help="correctness against the float64 reference").set_defaults(
        fn=cmd_check
    )
    b = sub.add_parser("bench", help="GB/s of forward/backward against the copy bandwidth")
    b.add_argument("--dtype", default="bfloat16", help="float32, float16, bfloat16, float64")
    b.add_argument("--log2-elements", type=int, default=27, help="M*N = 2**this (default 27)")
    b.add_argument("--n", default="", help="comma-separated row widths (default: the sweep)")
    b.add_argument(
        "--direction",
        choices=("both", "forward", "backward"),
        default="both",
        help="time the forward, the backward (dx, dw and db) or both (default)",
    )
    b.add_argument("--no-torch", action="store_true", help="skip the torch comparison")
    b.add_argument(
        "--norm",
        default="ln",
        choices=("ln", "rms", "add_rms", "add_ln"),
        help="LayerNorm (default), RMSNorm, or the residual add in front of either",
    )
    b.add_argument(
        "--quant",
        choices=tuple(FORMATS),
        help="the forward with y quantized in this format, against the plain forward",
    )
    b.add_argument("--compile", action="store_true", help="add torch.compile (slow to compile)")
    b.add_argument(
        "--peers",
        action="store_true",
        help="--norm's forward and backward through torch's autograd against torch, "
        "torch.compile and Liger (those installed)",
    )
    b.add_argument("--overhead", action="store_true", help="CPU time per call, tiny arrays")
    b.add_argument("--jagged", action="store_true", help="the jagged sweep (Helion's batches)")
    b.add_argument("--train", action="store_true", help="training step time, torch vs cupyln")
    b.add_argument("--jax", action="store_true", help="jitted cupyln.jax against pure JAX")
    b.add_argument("-v", "--verbose", action="store_true", help="show each width's kernels")
    b.add_argument(
        "--emulate",
        choices=sorted(PROFILES),
        help="cupyln plans as on this GPU (its SMs, shared memory, clusters), run on this one",
    )
    b.add_argument("--csv", default="", help="write the rows to this CSV file")
    b.add_argument("--json", default="", help="write copy bandwidth and rows to this JSON file")
    b.add_argument("--plot", default="", help="write a PNG of GB/s against N (matplotlib)")
    b.set_defaults(fn=cmd_bench)
    pl = sub.add_parser("plot", help="render a saved bench --json file as a PNG")
    pl.add_argument("json", help="a file written by bench --json")
    pl.add_argument("png", help="the PNG to write")
    pl.set_defaults(fn=cmd_plot)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
