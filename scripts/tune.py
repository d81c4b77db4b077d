# ruff: noqa: B023  (every closure here is timed inside the loop iteration that made it)
"""Time alternative launch shapes for the forward/backward kernels, to choose the heuristic's
rungs in cupyln/_launch.py by measurement.

    python scripts/tune.py [--dtype bfloat16] [--n 512,4096] [--json out.json]

For each width N (M = 2**27 // N rows) it launches every candidate shape of the register tier
(threads per row, vectors per thread, block) and of the row tier (block), under a persistent
grid (resident capacity) and, for the forward, one row group per block; prints GB/s (bytes as
the benchmark counts them) and the best candidates. Candidates are checked against the default
plan's output first, so a shape that computes something else is reported, not timed.
"""

import argparse
import json
import os
import sys

import cupy
import numpy

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cupyln import _api, _compile, _launch, bench  # noqa: E402
from cupyln import reference as ref  # noqa: E402
from cupyln._dtypes import ctype  # noqa: E402


def pow2(n):
    return 1 << max(0, n - 1).bit_length()


def candidates(n, vec, budget, subwarp_blocks):
    """Launch shapes to time for a row of N: sub-warp rows and blocks per row whose per-thread
    vectors stay within ``budget`` values (half of it at 1024 threads), and the row tier."""
    nvec = -(-n // vec)
    out = []
    for tpr in (4, 8, 16, 32):
        items = pow2(-(-nvec // tpr))
        if items * vec <= budget:
            out += [("reg", items, tpr, block) for block in subwarp_blocks]
    for block in (64, 128, 192, 256, 320, 384, 448, 512, 1024):
        items = pow2(-(-nvec // block))
        if items * vec <= (budget // 2 if block == 1024 else budget):
            out.append(("reg", items, block, block))
    if n >= 8192:
        out += [("row", 0, block, block) for block in (256, 512)]
    return out


def staged(row_bytes, info):
    """Dynamic shared memory of a row-tier kernel: the rows' bytes when they fit next to the
    kernel's static shared memory, else 0 (re-read); as _launch's plans decide."""
    return row_bytes if row_bytes <= info.smem_optin - _launch.STATIC_SMEM_MARGIN else 0


def compiled(source, expr, dev, block, smem, what):
    """(kernel, resident blocks), or None (and a line saying why) when it does not build."""
    try:
        k = _api._get(source, expr, dev, smem)
    except Exception as e:  # noqa: BLE001
        print(f"{what}: {expr}: {type(e).__name__}", flush=True)
        return None
    return k, _api._capacity(k, block, smem, dev)


def fwd_candidates(n, vec):
    return candidates(n, vec, 32, (128, 256))


def bwd_candidates(n, vec):
    return candidates(n, vec, 16, (128,))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--n", default="512,1024,2048,4096,5120,8192,12288,16384,32768,65536")
    p.add_argument("--json", default="")
    p.add_argument("--skip-bwd", action="store_true")
    args = p.parse_args()
    dt = numpy.dtype(args.dtype) if args.dtype != "bfloat16" else ref.BFLOAT16
    tx = ctype(dt)
    acc = numpy.float64 if dt.itemsize == 8 else numpy.float32
    dev = cupy.cuda.runtime.getDevice()
    info = _api._device(dev)
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    results = []
    for n in (int(v) for v in args.n.split(",")):
        m = 2**27 // n
        x, w, b, dy = bench._inputs(m, n, dt)
        vec = 16 // dt.itemsize
        y0, mean0, rstd0 = _api.forward(x, w, b)
        dx0, dw0, db0 = _api.backward(dy, x, w, mean0, rstd0)
        nbytes = m * n * dt.itemsize
        y = cupy.empty_like(x)
        mean = cupy.empty(m, acc)
        rstd = cupy.empty(m, acc)
        for tier, items, tpr, block in fwd_candidates(n, vec):
            if tier == "reg":
                minb = 1 if dt.itemsize > 4 else max(1, _launch.FWD_REG_THREADS // block)
                expr = _compile.template("ln_fwd_reg", tx, tx, tx, vec, items, tpr, block, minb)
                smem = 0
            else:
                smem = staged(-(-n * dt.itemsize // 16) * 16, info)
                expr = _compile.template("ln_fwd_row", tx, tx, tx, vec, block, smem > 0)
            built = compiled(_compile.FWD_SOURCE, expr, dev, block, smem, f"fwd N={n}")
            if built is None:
                continue
            k, cap = built
            rows = block // tpr
            grids = [("persistent", cap), ("full", -(-m // rows))]
            for grid_name, grid in grids:
                g = max(1, min(grid, 2**31 - 1))
                args_ = (x, numpy.int64(n), y, w, b, mean, rstd, numpy.int64(m),
                         numpy.int32(n), acc(1e-5))  # fmt: skip

                def launch(k=k, g=g, block=block, smem=smem, args_=args_):
                    k((g,), (block,), args_, shared_mem=smem)

                y.view(cupy.uint8).fill(0xFF)  # NaN in every float format
                launch()
                ok = bool(cupy.allclose(ref.to_float64(y), ref.to_float64(y0), atol=0.05))
                ok = ok and bool(cupy.allclose(mean, mean0, atol=1e-3))
                t = bench.time_ms(launch, reps=30) if ok else float("nan")
                gbs = 2 * nbytes / t * 1e-6
                r = dict(dir="fwd", N=n, tier=tier, items=items, tpr=tpr, block=block,
                         grid=grid_name, regs=k.num_regs, resident=cap, GBs=gbs,
                         of_copy=gbs / copy, ok=ok)  # fmt: skip
                results.append(r)
                print(f"fwd N={n:6d} {tier} items={items} tpr={tpr:4d} block={block:4d} "
                      f"{grid_name:10s} regs={k.num_regs:3d} res={cap:5d} {gbs:6.0f} GB/s "
                      f"({gbs / copy:4.0%}) {'' if ok else 'WRONG'}", flush=True)  # fmt: skip
        if args.skip_bwd:
            continue
        dx = cupy.empty_like(x)
        for tier, items, tpr, block in bwd_candidates(n, vec):
            if tier == "reg":
                # rows loaded directly, dw/db sums in registers (the launcher picks the rest)
                args = (tx, tx, vec, items, tpr, block, False, False, False)
                expr = _compile.template("ln_bwd_reg", *args)
                smem = 0
            else:
                smem = staged(2 * (-(-n * dt.itemsize // 16) * 16), info)
                expr = _compile.template("ln_bwd_row", tx, tx, vec, block, smem > 0)
            built = compiled(_compile.BWD_SOURCE, expr, dev, block, smem, f"bwd N={n}")
            if built is None:
                continue
            k, cap = built
            cols = _api._get(_compile.BWD_SOURCE, _launch.dwdb_cols_expr(dt), dev, 0)
            for mult in (0.5, 1, 2) if tier == "reg" else (1,):
                rows = block // tpr
                g = max(1, min(int(cap * mult), -(-m // rows)))
                gs, per = (g, 0) if tier == "reg" else _launch.dwdb_slices(m, n, info.sm_count)
                part = cupy.empty((2, gs, n), acc)
                dw = cupy.empty(n, dt)
                db = cupy.empty(n, dt)

                red, red_grid, red_block = _api.partial_reduce(dev, n, dt, dt, dt, gs)

                def launch(k=k, g=g, block=block, smem=smem, part=part, gs=gs, per=per,
                           tier=tier, red=red, red_grid=red_grid, red_block=red_block, cols=cols,
                           dw=dw, db=db):  # fmt: skip
                    if tier == "reg":
                        k((g,), (block,), (dy, numpy.int64(n), x, numpy.int64(n), w, mean0,
                          rstd0, dx, part[0], part[1], numpy.int64(m), numpy.int32(n),
                          acc(1) / acc(n)))  # fmt: skip
                    else:
                        k((g,), (block,), (dy, numpy.int64(n), x, numpy.int64(n), w, mean0,
                          rstd0, dx, numpy.int64(m), numpy.int32(n)), shared_mem=smem)  # fmt: skip
                        cols((-(-n // 32), gs), (32, 8), (dy, numpy.int64(n), x, numpy.int64(n),
                             mean0, rstd0, part[0], part[1], numpy.int64(m), numpy.int32(n),
                             numpy.int64(per)))  # fmt: skip
                    red(red_grid, red_block, 0, 0, part[0].data.ptr,
                        part[1].data.ptr, gs, n, dw.data.ptr, db.data.ptr)  # fmt: skip

                dx.view(cupy.uint8).fill(0xFF)
                launch()
                ok = bool(cupy.allclose(ref.to_float64(dx), ref.to_float64(dx0), atol=0.05))
                ok = ok and bool(cupy.allclose(ref.to_float64(dw), ref.to_float64(dw0),
                                               atol=0.05 * m**0.5))  # fmt: skip
                t = bench.time_ms(launch, reps=30) if ok else float("nan")
                gbs = 3 * nbytes / t * 1e-6
                r = dict(dir="bwd", N=n, tier=tier, items=items, tpr=tpr, block=block,
                         grid=f"x{mult}", regs=k.num_regs, resident=cap, GBs=gbs,
                         of_copy=gbs / copy, ok=ok)  # fmt: skip
                results.append(r)
                print(f"bwd N={n:6d} {tier} items={items} tpr={tpr:4d} block={block:4d} "
                      f"x{mult:<9} regs={k.num_regs:3d} res={cap:5d} {gbs:6.0f} GB/s "
                      f"({gbs / copy:4.0%}) {'' if ok else 'WRONG'}", flush=True)  # fmt: skip
        cupy.get_default_memory_pool().free_all_blocks()
    print("\nbest per width:")
    for d in ("fwd", "bwd"):
        for n in sorted({r["N"] for r in results}):
            rs = [r for r in results if r["dir"] == d and r["N"] == n and r["ok"]]
            if rs:
                best = max(rs, key=lambda r: r["GBs"])
                print(
                    f"{d} N={n:6d} best {best['GBs']:6.0f} GB/s ({best['of_copy']:4.0%}) "
                    f"{best['tier']} items={best['items']} tpr={best['tpr']} "
                    f"block={best['block']} {best['grid']} regs={best['regs']}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_GBs": copy, "dtype": args.dtype, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
