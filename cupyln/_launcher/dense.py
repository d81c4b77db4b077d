"""Launches of the dense norms: a ``Problem`` and its operands' pointers become the forward's
or the backward's kernels on a stream.

Every dense kernel of a direction takes the same parameter list (kernels/args.cuh:
CUPYLN_FWD_PARAMS, CUPYLN_BWD_PARAMS), packed here by the one format below that lists it. The
launches work on raw pointers and a raw stream, which is what the CuPy API and the framework
bridges share: they run on the current device (w/b pointers 64-byte aligned, or 0 for none), on
``stream`` (None: CuPy's current stream).

A launch for a problem seen before is a dictionary lookup: the plan, compiled kernel,
``_driver.Launcher`` and grid of each (device, problem, pointers' alignment) are cached.
"""

from __future__ import annotations

from typing import NamedTuple

from .. import _runtime
from .._driver import Launcher
from .._dtypes import acc_dtype
from .._plans import backward as bwd
from .._plans import forward as fwd
from .._plans.common import grid_size, vector_width
from .._problem import Problem
from .cache import cached, table
from .device import capacity, device, function, placed

# The parameter lists' formats (``struct`` module codes, laid out as C lays out parameters): Q
# a pointer, q an i64, i an int, {a} the arithmetic type (f: float, d: double).
# x, x_stride, y, w, b, mean, rstd, M, N, eps, res, res_stride, h, qscale, qin, qamax, qvalue
FWD_ARGS = "QqQQQQQqi{a}QqQQQQf"
NO_QUANT = (0, 0, 0, 0.0)  # qscale, qin, qamax, qvalue of a y not quantized
# dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, inv_n, rows_per_slice,
# dh, dh_stride
BWD_ARGS = "QqQqQQQQQQqi{a}qQq"
REDUCE_ARGS = "QQiiQQ"  # ln_partial_reduce: dw_part, db_part, G, N, dw, db

_MAX_CACHED = 4096  # distinct problems remembered by the pointer-level cache


def fmt(layout: str, x_dtype) -> str:
    """A parameter format with the arithmetic type of inputs of ``x_dtype`` filled in."""
    return layout.format(a="d" if acc_dtype(x_dtype).itemsize == 8 else "f")


@cached(maxsize=4096)
def vector_widths(itemsize: int, n: int, strides: tuple, align: int) -> int:
    """``vector_width`` for pointers whose OR has low bits ``align`` (every pack is a power
    of two up to 16 bytes, so the OR's alignment is every pointer's)."""
    return vector_width(itemsize, n, strides, (align,))


# ------------------------------------------------------------------------------ forward
@cached(maxsize=4096)
def forward_launch(device_id: int, p: Problem, vec: int):
    """(launcher, plan, resident blocks, grid) of the forward of problem ``p`` at packs of
    ``vec`` on this device."""
    dev = device(device_id)

    def make(max_cluster):
        return fwd.forward_launch_plan(
            p.m, p.n, p.dtype, p.tw, p.tb, vec, smem_limit=dev.smem_block,
            max_cluster=max_cluster, sm_count=dev.sm_count, dram_per_sm=dev.dram_per_sm,
            affine=p.affine, rms=p.rms, residual=p.residual, threads_sm=dev.threads_sm,
            y_dtype=p.y_dtype, quant=p.quant,
        )  # fmt: skip

    plan, f, cap = placed(device_id, make)
    launcher = _forward_launcher(f, plan.kernel.arg("T"))
    return launcher, plan, cap, fwd.forward_grid(p.m, plan, cap)


@cached(maxsize=1024)
def add_launch(device_id, m, n, x_dtype, r_dtype, h_dtype, vec):
    """(launcher, grid) of ln_fwd_add: h = x + res."""
    k = fwd.add_kernel(x_dtype, r_dtype, h_dtype, vec)
    f = function(k, device_id, 0)
    grid = grid_size(m * (n // vec), fwd.ADD_BLOCK, capacity(f, fwd.ADD_BLOCK, 0, device_id))
    return _forward_launcher(f, x_dtype), grid


@cached(maxsize=4096)
def _forward_launcher(f, x_dtype) -> Launcher:
    return Launcher(f, fmt(FWD_ARGS, x_dtype))


_pointer_forwards = table()  # forward_launch_at's launches by problem and pointers' alignment


def forward_launch_at(device_id: int, p: Problem, align: int):
    """(launcher, grid, block, shared bytes, pack width, plan) of the forward of problem ``p``
    for pointers whose OR has low bits ``align``: one lookup for a problem seen before (the
    bridges' repeated calls, the CuPy API's first call of a shape)."""
    key = (device_id, p, align)
    launch = _pointer_forwards.get(key)
    if launch is None:
        widest = max([p.dtype.itemsize, p.ty.itemsize] + [d.itemsize for d in p.residual or ()])
        vec = vector_widths(widest, p.n, (p.x_stride, p.r_stride), align)
        k, plan, _, grid = forward_launch(device_id, p, vec)
        launch = (k, grid, plan.block, plan.smem, vec, plan)
        if len(_pointer_forwards) < _MAX_CACHED:
            _pointer_forwards[key] = launch
    return launch


def launch_forward(device_id: int, p: Problem, ptrs: tuple, eps: float, stream=None,
                   quant: tuple = NO_QUANT) -> None:  # fmt: skip
    """Forward of problem ``p`` (M >= 1) at ``ptrs`` = (x, y, w, b, mean, rstd, residual, h):
    y and h contiguous, mean/rstd of M values (0: not stored), w/b 0 where absent, residual
    and h 0 without an add in front; ``quant``: (scales, input scalar, amax, value) of a
    quantized y (p.quant), whose elements y is. A plan that does not fuse the add runs
    ln_fwd_add first, then the norm of h, which writes y in y's dtype whatever h's."""
    x, y, w, b, mean, rstd, res, h = ptrs
    key = (device_id, p, (x | y | res | h) & 15)
    launch = _pointer_forwards.get(key)  # one lookup for the bridges' repeated calls
    k, grid, block, smem, vec, plan = forward_launch_at(*key) if launch is None else launch
    stream = _runtime.current_stream() if stream is None else stream
    if not plan.unfused:
        k(grid, block, smem, stream, x, p.x_stride, y, w, b, mean, rstd, p.m, p.n, eps, res,
          p.r_stride, h, *quant)  # fmt: skip
        return
    # the add first, then the norm of h (its Store writes y in y's dtype)
    r_dtype, h_dtype = p.residual
    add, add_grid = add_launch(device_id, p.m, p.n, p.dtype, r_dtype, h_dtype, vec)
    add(add_grid, fwd.ADD_BLOCK, 0, stream, x, p.x_stride, 0, 0, 0, 0, 0, p.m, p.n, 0.0, res,
        p.r_stride, h, *NO_QUANT)  # fmt: skip
    of_h = p._replace(dtype=h_dtype, residual=None, x_stride=p.n, r_stride=0,
                      y_dtype=None if p.ty == h_dtype else p.ty)  # fmt: skip
    launch_forward(device_id, of_h, (h, y, w, b, mean, rstd, 0, 0), eps, stream, quant)


# ------------------------------------------------------------------------------ backward
@cached(maxsize=1024)
def partial_reduce(device_id, n, x_dtype, w_dtype, db_dtype, slices):
    """(launcher, grid, block) of ln_partial_reduce summing ``slices`` dw/db partial rows of N
    columns: at most the blocks the device holds at once, each walking column chunks."""
    dev = device(device_id)
    k, cols, y = bwd.reduce_kernel(n, slices, dev.sm_count, x_dtype, w_dtype, db_dtype)
    # sm_90 and newer, and a driver that also captures such launches into CUDA graphs (12.3)
    after = bwd.REDUCE_AFTER_PRIOR and dev.arch >= 90 and _runtime.driver_version() >= 12030
    f = function(k, device_id, 0)
    grid = min(-(-n // cols), capacity(f, 32 * y, 0, device_id))
    return Launcher(f, REDUCE_ARGS, after), grid, (32, y)


@cached(maxsize=4096)
def _backward_kernels(device_id, n, x_dtype, w_dtype, vec, short=False, rms=False, dh=False):
    """(launcher, plan, resident blocks, column launcher or None) of the backward's plan for
    rows of N (``short``: bwd.backward_short; ``rms``: RMSNorm's; ``dh``: dh added to dx)."""
    smem = device(device_id).smem_block

    def make(max_cluster):
        return bwd.backward_plan(n, x_dtype, w_dtype, vec, smem, max_cluster, short=short,
                                 rms=rms, dh=dh)  # fmt: skip

    plan, f, cap = placed(device_id, make)
    cols = dwdb_cols(device_id, x_dtype, rms) if plan.tier == "row" else None
    return Launcher(f, fmt(BWD_ARGS, x_dtype)), plan, cap, cols


@cached(maxsize=64)
def dwdb_cols(device_id, x_dtype, rms=False) -> Launcher:
    """ln_bwd_dwdb_cols, the column sums of the row tier and of the jagged backward."""
    f = function(bwd.dwdb_cols_kernel(x_dtype, rms), device_id, 0)
    return Launcher(f, fmt(BWD_ARGS, x_dtype))


class BackwardLaunch(NamedTuple):
    kernel: Launcher
    plan: object
    capacity: int
    cols: Launcher | None  # the row tier's dw/db column kernel
    partials: int  # G: dw/db partial rows
    per: int  # rows a slice of the column kernel (row tier)
    reduce: tuple  # partial_reduce's (launcher, grid, block)
    inv_n: float  # 1 / N rounded to the arithmetic type, as a kernel's division would


@cached(maxsize=4096)
def backward_launch(device_id: int, p: Problem, vec: int) -> BackwardLaunch:
    """The backward's launch for problem ``p`` at packs of ``vec``, with the short launch's
    plan where M makes one."""
    m, n, x_dtype, w_dtype = p.m, p.n, p.dtype, p.tw
    key = device_id, n, x_dtype, w_dtype, vec
    k, plan, cap, cols = _backward_kernels(*key, False, p.rms, p.dh)
    if plan.tier == "reg" and bwd.backward_short(m, plan, cap):
        k, plan, cap, cols = _backward_kernels(*key, True, p.rms, p.dh)
    sms = device(device_id).sm_count
    if plan.tier == "row":
        g, per = bwd.dwdb_slices(m, n, sms)
    else:
        g, per = bwd.backward_grid(m, plan, cap, sms), 0
    acc = acc_dtype(x_dtype).type
    inv_n = float(acc(1) / acc(n))
    # RMSNorm has no db: its reduce is instantiated with w's dtype in db's place
    red = partial_reduce(device_id, n, x_dtype, w_dtype, w_dtype if p.rms else p.tb, g)
    return BackwardLaunch(k, plan, cap, cols, g, per, red, inv_n)


def launch_backward(device_id: int, p: Problem, ptrs: tuple, workspace, stream=None) -> None:
    """Backward of problem ``p`` (M >= 1) at ``ptrs`` = (dy, x, w, mean, rstd, dx, dw, db, dh):
    dx contiguous; w, dw, db, dh 0 where absent (mean too for RMSNorm). ``workspace(nbytes)``
    returns (address, owner) of scratch memory that stays untouched until the launches on
    ``stream`` are done (memory allocated on that stream); the owner is dropped once they are
    enqueued."""
    dy, x, w, mean, rstd, dx, dw, db, dh = ptrs
    esz = acc_dtype(p.dtype).itemsize
    align = (x | dy | dx | dh) & 15
    vec = vector_widths(p.dtype.itemsize, p.n, (p.x_stride, p.dy_stride, p.dh_stride), align)
    k, plan, cap, cols, g, per, (red, red_grid, red_block), inv_n = backward_launch(
        device_id, p, vec
    )
    stream = _runtime.current_stream() if stream is None else stream
    m, n = p.m, p.n
    part, owner = workspace((1 if p.rms else 2) * g * n * esz)
    dw_part = part if w else 0
    db_part = 0 if p.rms else part + g * n * esz
    args = (dy, p.dy_stride, x, p.x_stride, w, mean, rstd, dx, dw_part, db_part, m, n, inv_n,
            per, dh, p.dh_stride)  # fmt: skip
    if plan.tier != "row":  # one partial row per block (per cluster of blocks)
        k(g * plan.cluster, plan.block, plan.smem, stream, *args)
    else:
        k(grid_size(m, 1, cap), plan.block, plan.smem, stream, *args)
        if dw_part or db_part:
            cols((-(-n // 32), g), bwd.REDUCE_BLOCK, 0, stream, *args)
    if dw or db:
        red(red_grid, red_block, 0, stream, dw_part, db_part, g, n, dw, db)
    del owner  # back to its allocator, reusable by later work on this stream only


def describe_kernels(device_id: int, p: Problem, align: int) -> dict:
    """Which kernels the forward and the backward of problem ``p`` run for pointers whose OR
    has low bits ``align``, with launch shape, registers per thread and resident blocks (for
    benchmarks)."""
    vec = vector_widths(p.dtype.itemsize, p.n, (p.x_stride,), align)
    out = {}
    f = forward_launch(device_id, p, vec)
    b = backward_launch(device_id, p._replace(b_dtype=p.tw), vec)
    for name, (k, plan, cap) in (("forward", f[:3]), ("backward", b[:3])):
        out[name] = (
            f"{plan.tier} vec={plan.vec} items={plan.items} tpr={plan.tpr} "
            f"block={plan.block} smem={plan.smem} regs={k.kernel.num_regs} resident={cap}"
            + (f" cluster={plan.cluster}" if plan.cluster > 1 else "")
        )
    return out
