"""Measure the jagged kernels' launch shapes: threads per block and loads in flight for the
block-per-sequence kernels, on the Helion batches (B sequences of 1..128 rows). Prints GB/s
(forward 2x, backward 3x the bytes of values) and checks every variant against the first.
    python scripts/tune_jagged.py"""

import itertools

import cupy

from cupyln import _jagged, _launch, bench

KW = dict(max_seqlen=128, check_offsets=False)


def measure(values, offsets, dy, block, unroll):
    """(y, dx, forward ms, backward ms, kernels) with the block-per-sequence kernels at
    ``block`` threads and ``unroll`` loads in flight."""
    _launch.JAG_BLOCK = _launch.JAG_BLOCK_ALONE = block
    _launch.JAG_UNROLL = _launch.JAG_UNROLL_ALONE = unroll
    _jagged._kernels.cache_clear()
    y, mean, rstd = _jagged.jagged_forward(values, offsets, **KW)
    dx, _, _ = _jagged.jagged_backward(dy, values, offsets, None, mean, rstd, **KW)
    tf = bench.time_ms(lambda: _jagged.jagged_forward(values, offsets, **KW))
    tb = bench.time_ms(lambda: _jagged.jagged_backward(dy, values, offsets, None, mean, rstd,
                                                       **KW))  # fmt: skip
    dt = values.dtype
    k = _jagged._kernels(values.data.device_id, values.shape[1], dt, dt, dt, offsets.dtype,
                         16 // values.itemsize, 128)  # fmt: skip
    return y, dx, tf, tb, k


def main() -> None:
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for dtype, (b, d) in itertools.product(("float32", "bfloat16"), ((16384, 256), (16384, 32))):
        values, offsets, dy = bench.jagged_inputs(b, d, dtype)
        first = None
        for block, unroll in itertools.product((256, 512, 1024), (4, 8)):
            try:
                y, dx, tf, tb, k = measure(values, offsets, dy, block, unroll)
            except Exception as e:  # noqa: BLE001
                print(f"{dtype} B={b} D={d} block={block} unroll={unroll}: {e}", flush=True)
                continue
            first = first or (y.astype(cupy.float32), dx.astype(cupy.float32))
            # bf16 outputs may differ by one rounding step (0.016 at |y| in [2, 4))
            ok = bool(cupy.allclose(y.astype(cupy.float32), first[0], atol=0.05))
            ok = ok and bool(cupy.allclose(dx.astype(cupy.float32), first[1], atol=0.05))
            fg, bg = 2 * values.nbytes / tf * 1e-6, 3 * values.nbytes / tb * 1e-6
            print(f"{dtype:8s} B={b} D={d:3d} block={block:4d} unroll={unroll} "
                  f"fwd {fg:5.0f} GB/s ({fg / copy:4.0%}) "
                  f"regs={k.launch['fwd_short'].kernel.num_regs} "
                  f"resident={k.capacity['fwd_short'][0]}  bwd {bg:5.0f} GB/s ({bg / copy:4.0%}) "
                  f"regs={k.launch['bwd_short'].kernel.num_regs} "
                  f"resident={k.capacity['bwd_short'][0]} {'' if ok else 'MISMATCH'}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
