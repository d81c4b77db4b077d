"""The jagged kernels' plans (kernels/jagged.cu): shared memory and threads of the short path,
rows a chunk of the long path, and the template instantiations of one problem.

The forward's short path is a persistent grid whose shared memory is staging rings, one ring
per group of threads (the block, or each warp where a sequence of ``max_seqlen`` rows fits a
warp's share); the backward's is a block per sequence staging its x and dy. Sequences too long
for them take the long path: fixed chunks of rows, partial statistics combined in chunk order.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._dtypes import acc_dtype
from .common import STATIC_SMEM_MARGIN, kernel, share, staged

JAG_RING_BLOCK = 256  # forward: JAG_RING_SPLIT blocks this size share an SM...
JAG_RING_SPLIT = 3  # ...where a sequence of max_seqlen rows fits a third of the memory...
JAG_RING_BLOCK_ALONE = 512  # ...else one block this size
JAG_RING_WARPS = (16, 8)  # warps a block tried, in order, for a ring per warp
JAG_BLOCK = 256  # backward: blocks of this size with JAG_UNROLL loads in flight...
JAG_UNROLL = 4
JAG_BLOCK_ALONE = 512  # ...or, where the staged sequence leaves one block an SM, these
JAG_UNROLL_ALONE = 8
JAG_CHUNK_BLOCK = 256  # the long path's chunk kernels
JAG_DEFAULT_SMEM = 96 * 1024  # backward: staged bytes a block without a max_seqlen hint
JAG_SMALL_BLOCK = 256  # the offsets check, partition and statistics expansion


@dataclass(frozen=True)
class JaggedPlan:
    """Launch shape of the jagged kernels for one (D, dtype, pack width, max_seqlen).

    ``cap``: elements a sequence (forward) or each of x and dy (backward) may have to take the
    short path; ``rows``: rows a chunk of the long path (2 * rows * D <= cap, or 1); ``smem``:
    dynamic shared bytes of the short kernel, run with ``block`` threads. Forward: ``group``
    threads a sequence (``block`` or 32), each group with a ring of ``ring`` packs. Backward:
    ``unroll`` loads in flight a thread."""

    cap: int
    rows: int
    smem: int
    block: int
    group: int = 0
    ring: int = 0
    unroll: int = 1


def _rows(cap: int, d: int) -> int:
    return max(1, cap // (2 * d))


def jagged_plan(d: int, x_dtype, vec: int, smem_limit: int, max_seqlen, backward: bool):
    """The short path's shape. Forward: rings fill the shared memory of one block an SM, or of
    JAG_RING_SPLIT blocks where a sequence of ``max_seqlen`` rows fits their share (``cap``: what
    such a sequence needs when given, else the ring). Backward: what x and dy of ``max_seqlen``
    rows need (more blocks an SM for short sequences), else JAG_DEFAULT_SMEM; never past the
    device's opt-in limit."""
    usable = smem_limit - STATIC_SMEM_MARGIN
    item = x_dtype.itemsize
    hint = max_seqlen * d if max_seqlen else None
    if not backward:
        pack = vec * item
        warps = [w for w in JAG_RING_WARPS if hint and hint * item * w <= usable]
        if warps:
            block, group, ring_bytes = 32 * warps[0], 32, usable
        else:
            shares = [share(smem_limit, k) for k in range(JAG_RING_SPLIT, 0, -1)]
            ring_bytes = next(m for m in shares if not hint or hint * item <= m or m == shares[-1])
            block = group = JAG_RING_BLOCK_ALONE if ring_bytes == shares[-1] else JAG_RING_BLOCK
        groups = block // group
        ring = ring_bytes // groups // pack
        cap = ring * vec if hint is None else min(hint, ring * vec)
        return JaggedPlan(cap, _rows(cap, d), ring * pack * groups, block, group, ring)
    want = 2 * staged(hint, item) if hint else JAG_DEFAULT_SMEM
    smem = min(want, usable) // 32 * 32
    cap = smem // 2 // item
    alone = 2 * (smem + STATIC_SMEM_MARGIN) > smem_limit
    block, unroll = (JAG_BLOCK_ALONE, JAG_UNROLL_ALONE) if alone else (JAG_BLOCK, JAG_UNROLL)
    return JaggedPlan(cap, _rows(cap, d), smem, block, unroll=unroll)


def jagged_kernels(x_dtype, w_dtype, b_dtype, o_dtype, vec: int, fwd: JaggedPlan,
                   bwd: JaggedPlan) -> dict:  # fmt: skip
    """The jagged kernels of one problem by role: {role: (kernel, threads, shared bytes)}
    (``fwd``/``bwd``: the plans that shape the short kernels; ``o_dtype``: the offsets')."""
    t, tw, tb, i, a = x_dtype, w_dtype, b_dtype, o_dtype, acc_dtype(x_dtype)
    cb = JAG_CHUNK_BLOCK
    return {
        "partition": (kernel("jag_partition", I=i), JAG_SMALL_BLOCK, 0),
        "fwd_short": (
            kernel(
                "jag_fwd_short", T=t, TW=tw, TB=tb, I=i, VEC=vec, BLOCK=fwd.block, GROUP=fwd.group
            ),
            fwd.block,
            fwd.smem,
        ),  # fmt: skip
        "fwd_partial": (kernel("jag_fwd_partial", T=t, I=i, VEC=vec, BLOCK=cb), cb, 0),
        "fwd_combine": (kernel("jag_combine", A=a, I=i, FORWARD=True, BLOCK=cb), cb, 0),
        "fwd_apply": (kernel("jag_fwd_apply", T=t, TW=tw, TB=tb, I=i, VEC=vec, BLOCK=cb), cb, 0),
        "bwd_short": (
            kernel(
                "jag_bwd_short",
                T=t,
                TW=tw,
                I=i,
                VEC=vec,
                BLOCK=bwd.block,
                UNROLL=max(1, bwd.unroll // 2),
            ),
            bwd.block,
            bwd.smem,
        ),  # fmt: skip
        "bwd_partial": (kernel("jag_bwd_partial", T=t, TW=tw, I=i, VEC=vec, BLOCK=cb), cb, 0),
        "bwd_combine": (kernel("jag_combine", A=a, I=i, FORWARD=False, BLOCK=cb), cb, 0),
        "bwd_apply": (kernel("jag_bwd_apply", T=t, TW=tw, I=i, VEC=vec, BLOCK=cb), cb, 0),
        "expand": (kernel("jag_expand_stats", A=a, I=i), JAG_SMALL_BLOCK, 0),
    }


def check_kernel(o_dtype):
    """The offsets check, run before a plan is chosen."""
    return kernel("jag_check_offsets", I=o_dtype)


JAG_CLAMP_BLOCK = 1024  # the offsets' clamp: one block walks them (jag_clamp_offsets)


def clamp_kernel(o_dtype):
    """The offsets' clamp into a valid partition, where the host's check is skipped."""
    return kernel("jag_clamp_offsets", I=o_dtype)
