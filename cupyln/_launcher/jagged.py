"""The jagged kernels (kernels/jagged.cu) of one problem on one device, compiled and ready to
launch by role, and the offsets' check and clamp."""

from __future__ import annotations

from typing import NamedTuple

import numpy

from .. import _runtime
from .._driver import Launcher
from .._dtypes import acc_dtype
from .._plans import backward as bwd
from .._plans import jagged as jag
from .._plans.common import grid_size, vector_width
from .cache import cached
from .dense import dwdb_cols, fmt, partial_reduce
from .device import capacity, device, function

# Parameter formats of the jagged kernels (kernels/jagged.cu), by role; every kernel but
# expand and check ends with has_long.
JAGGED_ARGS = {
    "partition": "QqqQQ",  # off, B, G, parts
    "fwd_short": "QQiQQQQQ{a}qiQiQ",  # x, off, D, y, w, b, mean, rstd, eps, cap, ring, parts, long
    "fwd_partial": "QQqiqqQQ",  # x, off, B, D, R, cap, part
    "fwd_combine": "QqiqqQQQQ{a}Q",  # off, B, D, R, cap, part, o1, o2, mean64, eps
    "bwd_combine": "QqiqqQQQQ{a}Q",
    "fwd_apply": "QQqiqqQQQQQQ",  # x, off, B, D, R, cap, y, w, b, mean64, rstd
    "bwd_short": "QQQqiQQQQqQ",  # dy, x, off, B, D, w, mean, rstd, dx, cap
    "bwd_partial": "QQQqiqqQQQQQ",  # dy, x, off, B, D, R, cap, w, mean, rstd, part
    "bwd_apply": "QQQqiqqQQQQQQQ",  # dy, x, off, B, D, R, cap, w, mean, rstd, c1, c2, dx
    "expand": "QqQQQQ",  # off, B, mean, rstd, row_mean, row_rstd
}
JAGGED_CHECK_ARGS = "QqqQ"  # off, B, total, flags (the clamp: off, B, total, out)


class JaggedKernels:
    """The jagged kernels of one problem on one device: ``self(role, work, stream, *args)``
    launches a role's kernel on a grid for ``work`` items, at most its resident blocks."""

    def __init__(self, dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen):
        info = device(dev)
        self.fwd = jag.jagged_plan(d, x_dtype, vec, info.smem_block, max_seqlen, False)
        self.bwd = jag.jagged_plan(d, x_dtype, vec, info.smem_block, max_seqlen, True)
        kernels = jag.jagged_kernels(x_dtype, w_dtype, b_dtype, o_dtype, vec, self.fwd, self.bwd)
        self.launch, self.capacity = {}, {}
        for role, (k, block, smem) in kernels.items():
            f = function(k, dev, smem)
            self.launch[role] = Launcher(f, fmt(JAGGED_ARGS[role], x_dtype))
            self.capacity[role] = (capacity(f, block, smem, dev), block, smem)
        # the forward short kernel is persistent: every resident block, each with its groups
        self.fwd_blocks = self.capacity["fwd_short"][0]
        self.fwd_groups = self.fwd_blocks * (self.fwd.block // self.fwd.group)
        self.cols = dwdb_cols(dev, x_dtype)  # dw/db: the dense backward's column kernel
        self.dtypes = x_dtype, w_dtype, b_dtype
        self.sm_count = info.sm_count

    def __call__(self, role, work, stream, *args):
        cap, block, smem = self.capacity[role]
        self.launch[role](grid_size(work, 1, cap), block, smem, stream, *args)


@cached(maxsize=1024)
def jagged(dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen) -> JaggedKernels:
    return JaggedKernels(dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen)


@cached(maxsize=64)
def jagged_clamp(dev, o_dtype) -> Launcher:
    """The offsets' clamp (one block of jag.JAG_CLAMP_BLOCK threads)."""
    return Launcher(function(jag.clamp_kernel(o_dtype), dev, 0), JAGGED_CHECK_ARGS)


@cached(maxsize=64)
def jagged_check(dev, o_dtype):
    """(launcher, resident blocks) of the offsets check."""
    f = function(jag.check_kernel(o_dtype), dev, 0)
    return Launcher(f, JAGGED_CHECK_ARGS), capacity(f, jag.JAG_SMALL_BLOCK, 0, dev)


# ------------------------------------------------------------------ launches on pointers
_PART_BYTES = 32  # struct Part in jagged.cu: int64 seq, double n, a, b
SMALL = jag.JAG_SMALL_BLOCK  # the check, partition and expand kernels
CLAMP = jag.JAG_CLAMP_BLOCK  # the offsets' clamp


class Jagged(NamedTuple):
    """A jagged problem: ``nseq`` sequences over ``total`` rows of ``d`` (values contiguous),
    offsets of ``o_dtype``; ``w_dtype``/``b_dtype`` None where absent (backward: ``b_dtype``
    is db's); ``max_seqlen`` the caller's bound on the sequences' rows, or None."""

    total: int
    d: int
    nseq: int
    dtype: numpy.dtype
    o_dtype: numpy.dtype
    w_dtype: numpy.dtype | None = None
    b_dtype: numpy.dtype | None = None
    max_seqlen: int | None = None


def check_offsets(dev, p: Jagged, offsets: int, stream: int, scratch) -> int:
    """Check the offsets at ``offsets`` on the GPU (one 24-byte copy back, one
    synchronization); raises ValueError for bad ones, returns the longest sequence's rows."""
    flags, owner = scratch(24)
    _runtime.memset(flags, 24, stream)  # flags 0, first bad offset "none", longest 0
    _runtime.memset(flags + 8, 8, stream, 0xFF)
    launch, cap = jagged_check(dev, p.o_dtype)
    grid = grid_size(max(1, -(-p.nseq // SMALL)), 1, cap)
    launch(grid, SMALL, 0, stream, offsets, p.nseq, p.total, flags)
    bits, first, longest = (int(v) for v in _runtime.to_host(flags, numpy.uint64, 3, stream))
    del owner

    def at(i: int) -> int:
        size = p.o_dtype.itemsize
        return int(_runtime.to_host(offsets + i * size, p.o_dtype, 1, stream)[0])

    if bits & 1:
        raise ValueError(f"offsets[0] must be 0; got {at(0)}")
    if bits & 2:
        raise ValueError(f"offsets must be non-decreasing; offsets[{first}] = {at(first)} > "
                         f"offsets[{first + 1}] = {at(first + 1)}")  # fmt: skip
    if bits & 4:
        raise ValueError(f"offsets[-1] must equal values.shape[0] = {p.total}; got {at(p.nseq)}")
    return longest


def _plan_seqlen(max_seqlen, longest):
    """The sequence length the kernels are shaped for: the caller's max_seqlen, else the
    longest sequence from the offsets check rounded up to a power of two (few distinct plans),
    else None (the plan's default)."""
    if max_seqlen:
        return int(max_seqlen)
    return 1 << max(0, int(longest) - 1).bit_length() if longest else None


def _long_path(longest, d: int, cap: int, total: int) -> bool:
    """Whether the long path's kernels must run: some sequence may have more than ``cap``
    elements (``longest``: a bound on the rows of every sequence, or None)."""
    return total > 0 and (longest is None or longest * d > cap)


def _offsets(dev, p: Jagged, offsets: int, check: bool, stream, scratch):
    """(pointer to the offsets the kernels read, owner, longest sequence or None): the
    offsets themselves after the host's check (``check``), else their clamp into a valid
    partition in ``scratch`` memory (no synchronization)."""
    if check:
        return offsets, None, check_offsets(dev, p, offsets, stream, scratch)
    o_ptr, owner = scratch((p.nseq + 1) * p.o_dtype.itemsize)
    jagged_clamp(dev, p.o_dtype)(1, CLAMP, 0, stream, offsets, p.nseq, p.total, o_ptr)
    return o_ptr, owner, None


def launch_jagged_forward(dev, p: Jagged, ptrs: tuple, eps: float, check: bool, scratch,
                          stream: int, shape_by_check: bool = True) -> None:  # fmt: skip
    """The forward of checked arguments at ``ptrs`` = (values, offsets, y, w, b, mean, rstd)
    (contiguous; w, b 64-byte aligned or 0) on ``stream`` of the current device, with scratch
    memory from ``scratch(nbytes)`` -> (address, owner) (as the dense backward's workspace).
    ``check``: check the offsets first (else read their clamp); ``shape_by_check``: plan the
    kernels for the longest sequence the check found (else for ``max_seqlen`` alone: the same
    kernels whether the check runs or not)."""
    x_ptr, offsets, y_ptr, w_ptr, b_ptr, m_ptr, r_ptr = ptrs
    total, d, nseq = p.total, p.d, p.nseq
    vec = vector_width(p.dtype.itemsize, d, (), (x_ptr, y_ptr))
    o_ptr, o_owner, longest = _offsets(dev, p, offsets, check, stream, scratch)
    longest = p.max_seqlen if longest is None else longest
    seqlen = _plan_seqlen(p.max_seqlen, longest if shape_by_check else None)
    tw = p.dtype if p.w_dtype is None else p.w_dtype
    tb = p.dtype if p.b_dtype is None else p.b_dtype
    k = jagged(dev, d, p.dtype, tw, tb, p.o_dtype, vec, seqlen)
    if nseq == 0:  # rows in no sequence (unchecked offsets): normalized to nothing, zeros
        if total:
            _runtime.memset(y_ptr, total * d * p.dtype.itemsize, stream)
        return
    f, groups = k.fwd, k.fwd_groups
    long_path = _long_path(longest, d, f.cap, total)
    chunks = -(-total // f.rows) if long_path else 0
    # scratch: has_long flag, the groups' first sequences, the long path's chunk records and
    # its sequences' exact means
    part, owner = scratch(16 + 8 * (groups + 1) + (2 * _PART_BYTES * chunks + 8 * nseq
                                                    if long_path else 0))  # fmt: skip
    flag, parts = part, part + 16
    recs = parts + 8 * (groups + 1)
    mean64 = recs + 2 * chunks * _PART_BYTES
    k("partition", -(-(nseq + 1) // SMALL), stream, o_ptr, nseq, groups, parts, flag)
    k("fwd_short", k.fwd_blocks, stream, x_ptr, o_ptr, d, y_ptr, w_ptr, b_ptr, m_ptr, r_ptr,
      eps, f.cap, f.ring, parts, int(long_path), flag)  # fmt: skip
    if long_path:
        k("fwd_partial", chunks, stream, x_ptr, o_ptr, nseq, d, f.rows, f.cap, recs, flag)
        k("fwd_combine", nseq, stream, o_ptr, nseq, d, f.rows, f.cap, recs, m_ptr, r_ptr,
          mean64, eps, flag)  # fmt: skip
        k("fwd_apply", chunks, stream, x_ptr, o_ptr, nseq, d, f.rows, f.cap, y_ptr, w_ptr,
          b_ptr, mean64, r_ptr, flag)  # fmt: skip
    del owner, o_owner  # back to their allocator once the launches are enqueued


def launch_jagged_backward(dev, p: Jagged, ptrs: tuple, check: bool, scratch, stream: int,
                           shape_by_check: bool = True) -> None:  # fmt: skip
    """The backward of checked arguments at ``ptrs`` = (dy, values, offsets, w, mean, rstd, dx,
    dw, db) (dw 0 without w), ``p.b_dtype`` db's dtype; the rest as
    launch_jagged_forward."""
    g_ptr, x_ptr, offsets, w_ptr, m_ptr, r_ptr, dx_ptr, dw_ptr, db_ptr = ptrs
    total, d, nseq = p.total, p.d, p.nseq
    esz = acc_dtype(p.dtype).itemsize
    vec = vector_width(p.dtype.itemsize, d, (), (x_ptr, g_ptr, dx_ptr))
    # the backward has no slow walk: only the check may skip the long path
    o_ptr, o_owner, longest = _offsets(dev, p, offsets, check, stream, scratch)
    seqlen = _plan_seqlen(p.max_seqlen, longest if shape_by_check else None)
    tw = p.dtype if p.w_dtype is None else p.w_dtype
    k = jagged(dev, d, p.dtype, tw, p.b_dtype, p.o_dtype, vec, seqlen)
    if total == 0 or nseq == 0:  # no row in a sequence (unchecked offsets): zero gradients
        _runtime.memset(dx_ptr, total * d * p.dtype.itemsize, stream)
        _runtime.memset(dw_ptr, d * tw.itemsize, stream)
        _runtime.memset(db_ptr, d * p.b_dtype.itemsize, stream)
        return
    bw = k.bwd
    long_path = _long_path(longest, d, bw.cap, total)
    chunks = -(-total // bw.rows) if long_path else 0
    g, per = bwd.dwdb_slices(total, d, k.sm_count)
    # scratch: has_long flag, chunk records, the long path's coefficients, per-row statistics,
    # the dw/db partial rows
    sizes = (16, 2 * chunks * _PART_BYTES, 2 * nseq * esz, 2 * total * esz, 2 * g * d * esz)
    base, owner = scratch(sum(-(-n // 16) * 16 for n in sizes))
    flag, recs, coef, rows, part = _carve(base, sizes)
    if long_path:  # else no sequence is long and the short kernel never writes the flag
        _runtime.memset(flag, 4, stream)
    k("bwd_short", nseq, stream, g_ptr, x_ptr, o_ptr, nseq, d, w_ptr, m_ptr, r_ptr, dx_ptr,
      bw.cap, flag)  # fmt: skip
    if long_path:
        c1, c2 = coef, coef + nseq * esz
        k("bwd_partial", chunks, stream, g_ptr, x_ptr, o_ptr, nseq, d, bw.rows, bw.cap, w_ptr,
          m_ptr, r_ptr, recs, flag)  # fmt: skip
        k("bwd_combine", nseq, stream, o_ptr, nseq, d, bw.rows, bw.cap, recs, c1, c2, 0, 0.0,
          flag)  # fmt: skip
        k("bwd_apply", chunks, stream, g_ptr, x_ptr, o_ptr, nseq, d, bw.rows, bw.cap, w_ptr,
          m_ptr, r_ptr, c1, c2, dx_ptr, flag)  # fmt: skip
    # dw/db: column sums over all rows, with each row's sequence statistics
    rm, rr = rows, rows + total * esz
    k("expand", -(-total // SMALL), stream, o_ptr, nseq, m_ptr, r_ptr, rm, rr)
    dw_part = part if w_ptr else 0
    db_part = part + g * d * esz
    # the dense backward's column kernel (BwdArgs: no w, no dx, 1 / N unused)
    k.cols((-(-d // 32), g), bwd.REDUCE_BLOCK, 0, stream, g_ptr, d, x_ptr, d, 0, rm, rr, 0,
           dw_part, db_part, total, d, 0.0, per, 0, 0)  # fmt: skip
    red, red_grid, red_block = partial_reduce(dev, d, *k.dtypes, g)
    red(red_grid, red_block, 0, stream, dw_part, db_part, g, d, dw_ptr, db_ptr)
    del owner, o_owner  # back to their allocator once the launches are enqueued


def _carve(base: int, sizes) -> list:
    """Addresses of consecutive 16-byte aligned pieces of ``sizes`` bytes from ``base``."""
    out = []
    for n in sizes:
        out.append(base)
        base += -(-n // 16) * 16
    return out
