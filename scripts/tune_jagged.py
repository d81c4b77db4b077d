"""Measure the jagged kernels' launch shapes on the Helion batches (B sequences of 1..128 rows):
the forward ring kernel's threads per block and warp groups, the backward block-per-sequence
kernel's threads and loads in flight. Prints GB/s (forward 2x, backward 3x the bytes of
values) and checks every variant against the first.
    python scripts/tune_jagged.py [--wide] [--backward]   (--wide: D = 256 only)"""

import itertools

import cupy

from cupyln import _jagged, _launch, bench

KW = dict(max_seqlen=128, check_offsets=False)
SHAPES = ((16384, 256), (16384, 32))
RING_BLOCKS = (256, 384, 512)  # threads per block of the ring kernel's block groups


def kernels(values, offsets):
    dt = values.dtype
    return _jagged._kernels(values.data.device_id, values.shape[1], dt, dt, dt, offsets.dtype,
                            16 // values.itemsize, 128)  # fmt: skip


def forward(values, offsets, ring_block, warps, split):
    """(y, ms, kernels) for one ring shape."""
    _launch.JAG_RING_BLOCK = _launch.JAG_RING_BLOCK_ALONE = ring_block
    _launch.JAG_RING_WARPS = warps
    _launch.JAG_RING_SPLIT = split
    _jagged._kernels.cache_clear()
    y, _, _ = _jagged.jagged_forward(values, offsets, **KW)
    ms = bench.time_ms(lambda: _jagged.jagged_forward(values, offsets, **KW))
    return y, ms, kernels(values, offsets)


def backward(values, offsets, dy, block, unroll):
    _launch.JAG_BLOCK = _launch.JAG_BLOCK_ALONE = block
    _launch.JAG_UNROLL = _launch.JAG_UNROLL_ALONE = unroll
    _jagged._kernels.cache_clear()
    _, mean, rstd = _jagged.jagged_forward(values, offsets, **KW)
    dx, _, _ = _jagged.jagged_backward(dy, values, offsets, None, mean, rstd, **KW)
    ms = bench.time_ms(lambda: _jagged.jagged_backward(dy, values, offsets, None, mean, rstd,
                                                       **KW))  # fmt: skip
    return dx, ms, kernels(values, offsets)


def close(a, b):
    # bf16 outputs may differ by one rounding step (0.016 at |y| in [2, 4))
    return bool(cupy.allclose(a.astype(cupy.float32), b.astype(cupy.float32), atol=0.05))


def main(backward_too: bool = False) -> None:
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    knobs = ("JAG_RING_BLOCK", "JAG_RING_BLOCK_ALONE", "JAG_RING_WARPS", "JAG_RING_SPLIT")
    defaults = {name: getattr(_launch, name) for name in knobs}
    for dtype, (b, d) in itertools.product(("float32", "bfloat16"), SHAPES):
        values, offsets, dy = bench.jagged_inputs(b, d, dtype)
        gb = 2 * values.nbytes * 1e-6
        first, seen = None, set()
        shapes = itertools.product(RING_BLOCKS, ((16, 8), (8,), ()), (1, 2, 3))
        for ring_block, warps, split in shapes:
            try:
                y, ms, k = forward(values, offsets, ring_block, warps, split)
            except Exception as e:  # noqa: BLE001
                print(f"{dtype} B={b} D={d} ring {ring_block} warps {warps}: {e}", flush=True)
                continue
            p = k.fwd
            if (p.block, p.group, p.smem) in seen:
                continue
            seen.add((p.block, p.group, p.smem))
            first = y if first is None else first
            print(f"{dtype:8s} B={b} D={d:3d} ring block={ring_block:4d} warps={warps!s:7s} "
                  f"group={p.group:4d} smem={p.smem >> 10:3d}K fwd {gb / ms:5.0f} GB/s "
                  f"({gb / ms / copy:4.0%}) regs={k.launch['fwd_short'].kernel.num_regs} "
                  f"blocks={k.fwd_blocks} "
                  f"{'' if close(y, first) else 'MISMATCH'}", flush=True)  # fmt: skip
        for name, value in defaults.items():
            setattr(_launch, name, value)
        if not backward_too:
            continue
        first = None
        for block, unroll in itertools.product((256, 512), (4, 8)):
            dx, ms, k = backward(values, offsets, dy, block, unroll)
            first = dx if first is None else first
            g = 1.5 * gb
            print(f"{dtype:8s} B={b} D={d:3d} bwd block={block:4d} unroll={unroll} "
                  f"{g / ms:5.0f} GB/s ({g / ms / copy:4.0%}) "
                  f"regs={k.launch['bwd_short'].kernel.num_regs} "
                  f"resident={k.capacity['bwd_short'][0]} {'' if close(dx, first) else 'MISMATCH'}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    import sys

    if "--wide" in sys.argv:  # D = 256 only
        SHAPES = SHAPES[:1]
    main(backward_too="--backward" in sys.argv)
