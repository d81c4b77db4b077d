"""The launcher: plans become compiled kernels and launches. The only caller of the compile
and driver layers, for the dense kernels and the jagged ones alike.

Every dense kernel of a direction takes the same parameter list (kernels/args.cuh:
CUPYLN_FWD_PARAMS, CUPYLN_BWD_PARAMS), packed here by the one format below that lists it. The
launches work on raw pointers and a raw stream, which is what the CuPy API and the framework
bridges share: they run on the current device (w/b pointers 64-byte aligned, or 0 for none), on
``stream`` (None: CuPy's current stream).

A launch for a problem seen before is a dictionary lookup: the plan, compiled kernel,
``_driver.Launcher`` and grid of each (device, shape, dtypes, pack width) are cached.
"""

from __future__ import annotations

from functools import cache, lru_cache
from typing import NamedTuple

from . import _compile, _runtime
from ._driver import Launcher, max_active_clusters
from ._dtypes import acc_dtype
from ._plans import backward as bwd
from ._plans import forward as fwd
from ._plans import jagged as jag
from ._plans.common import MAX_CLUSTER, grid_size, vector_width

# The parameter lists' formats (``struct`` module codes, laid out as C lays out parameters): Q
# a pointer, q an i64, i an int, {a} the arithmetic type (f: float, d: double).
# x, x_stride, y, w, b, mean, rstd, M, N, eps, res, res_stride, h
FWD_ARGS = "QqQQQQQqi{a}QqQ"
# dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, inv_n, rows_per_slice,
# dh, dh_stride
BWD_ARGS = "QqQqQQQQQQqi{a}qQq"
REDUCE_ARGS = "QQiiQQ"  # ln_partial_reduce: dw_part, db_part, G, N, dw, db

_MAX_CACHED = 4096  # distinct problems remembered by the pointer-level cache


def _fmt(layout: str, x_dtype) -> str:
    return layout.format(a="d" if acc_dtype(x_dtype).itemsize == 8 else "f")


# ------------------------------------------------------------------------ device and kernels
class Device(NamedTuple):
    sm_count: int
    smem_optin: int
    max_cluster: int  # blocks per thread-block cluster the kernels may use (1: no clusters)
    dram_per_sm: float  # peak DRAM bytes per second an SM (0: not reported)


MIN_ARCH = 80  # the kernels use cp.async and bf16 conversions: Ampere (sm_80) and newer


def check_arch(name: str, arch: int) -> None:
    """Refuse a GPU older than MIN_ARCH, by name."""
    if arch < MIN_ARCH:
        raise RuntimeError(
            f"cupyln needs an NVIDIA GPU of compute capability {MIN_ARCH // 10}.{MIN_ARCH % 10} "
            f"(Ampere) or newer; {name} is sm_{arch}"
        )


@cache
def device(device_id: int) -> Device:
    cp = _runtime.cupy()
    d = cp.cuda.Device(device_id)
    arch = int(d.compute_capability)
    check_arch(cp.cuda.runtime.getDeviceProperties(device_id)["name"].decode(), arch)
    attrs = d.attributes
    clusters = MAX_CLUSTER if arch >= 90 else 1
    sms = attrs["MultiProcessorCount"]
    # double data rate: 2 transfers a memory clock (kHz) over the bus (bits)
    dram = 2e3 * attrs.get("MemoryClockRate", 0) * attrs.get("GlobalMemoryBusWidth", 0) / 8
    return Device(sms, attrs["MaxSharedMemoryPerBlockOptin"], clusters, dram / sms)


def function(k, device_id: int, smem: int):
    """The compiled kernel of record ``k``; kernels that take dynamic shared memory get the
    device's opt-in limit."""
    limit = device(device_id).smem_optin if smem else 0
    return _compile.function(k, device_id, limit)


def capacity(f, block: int, smem: int, device_id: int, cluster: int = 1) -> int:
    """Resident blocks of compiled kernel ``f`` on the whole device (a persistent grid's size);
    for a kernel of thread-block clusters, resident clusters."""
    from cupy_backends.cuda.api import driver

    sms = device(device_id).sm_count
    if cluster > 1:
        return max_active_clusters(f, cluster, block, smem) or max(1, sms // cluster)
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, block, smem)
    return max(1, per_sm) * sms


# ------------------------------------------------------------------------------ forward
@lru_cache(maxsize=4096)
def forward_launch(device_id, m, n, x_dtype, w_dtype, b_dtype, vec, affine=(True, True),
                   rms=False, residual=None):  # fmt: skip
    """(launcher, plan, resident blocks, grid) of the forward of M rows of N on this device,
    ``affine``: (w given, b given); ``rms``: RMSNorm; ``residual``: (residual dtype, h dtype)
    of a residual add in front, or None."""
    dev = device(device_id)
    limits = (dev.smem_optin, dev.max_cluster, dev.sm_count, dev.dram_per_sm)
    plan = fwd.forward_launch_plan(m, n, x_dtype, w_dtype, b_dtype, vec, *limits, affine, rms,
                                   residual)  # fmt: skip
    f = function(plan.kernel, device_id, plan.smem)
    cap = capacity(f, plan.block, plan.smem, device_id, plan.cluster)
    launcher = _forward_launcher(f, plan.kernel.arg("T"))
    return launcher, plan, cap, fwd.forward_grid(m, plan, cap)


@lru_cache(maxsize=1024)
def add_launch(device_id, m, n, x_dtype, r_dtype, h_dtype, vec):
    """(launcher, grid) of ln_fwd_add: h = x + res (r_dtype None: h = x, a cast)."""
    k = fwd.add_kernel(x_dtype, r_dtype, h_dtype, vec)
    f = function(k, device_id, 0)
    grid = grid_size(m * (n // vec), fwd.ADD_BLOCK, capacity(f, fwd.ADD_BLOCK, 0, device_id))
    return _forward_launcher(f, x_dtype), grid


@lru_cache(maxsize=4096)
def _forward_launcher(f, x_dtype) -> Launcher:
    return Launcher(f, _fmt(FWD_ARGS, x_dtype))


_pointer_forwards: dict = {}  # forward_launch_at's launches by problem and pointers' alignment


def forward_launch_at(dev, m, n, x_stride, x_dtype, w_dtype, b_dtype, affine, align, rms=False,
                      residual=None, res_stride=0):  # fmt: skip
    """(launcher, grid, block, shared bytes, pack width, plan) of the forward of M rows of N
    for pointers whose OR has low bits ``align``: one lookup for a problem seen before (the
    bridges' repeated calls, the CuPy API's first call of a shape). ``rms``, ``residual``:
    as forward_launch; ``res_stride``: the residual's row stride."""
    key = (dev, m, n, x_stride, x_dtype, w_dtype, b_dtype, affine, align, rms, residual,
           res_stride)  # fmt: skip
    launch = _pointer_forwards.get(key)
    if launch is None:
        widest = max([x_dtype.itemsize] + [d.itemsize for d in residual or ()])
        vec = vector_widths(widest, n, (x_stride, res_stride), align)
        k, plan, _, grid = forward_launch(dev, m, n, x_dtype, w_dtype, b_dtype, vec, affine, rms,
                                          residual)  # fmt: skip
        launch = (k, grid, plan.block, plan.smem, vec, plan)
        if len(_pointer_forwards) < _MAX_CACHED:
            _pointer_forwards[key] = launch
    return launch


def launch_forward(dev, m, n, x_ptr, x_stride, x_dtype, y_ptr, w_ptr, w_dtype, b_ptr, b_dtype,
                   mean_ptr, rstd_ptr, eps, stream=None, rms=False, res_ptr=0, res_stride=0,
                   r_dtype=None, h_ptr=0, h_dtype=None, workspace=None):  # fmt: skip
    """Forward of M >= 1 rows of N; y contiguous, mean/rstd of M values (0: not stored).
    ``rms``: RMSNorm. With a residual (``res_ptr`` at ``res_stride`` of ``r_dtype``), h = x +
    res is stored at ``h_ptr`` (contiguous, ``h_dtype``) and normalized; a plan that does not
    fuse the add runs ln_fwd_add first, and where h's dtype is not x's, its y goes through
    scratch memory from ``workspace(nbytes)`` (as launch_backward's) and is cast."""
    residual = (r_dtype, h_dtype) if res_ptr else None
    align = (x_ptr | y_ptr | res_ptr | h_ptr) & 15
    key = (dev, m, n, x_stride, x_dtype, w_dtype, b_dtype, (w_ptr != 0, b_ptr != 0), align, rms,
           residual, res_stride)  # fmt: skip
    launch = _pointer_forwards.get(key)  # one lookup for the bridges' repeated calls
    k, grid, block, smem, vec, plan = forward_launch_at(*key) if launch is None else launch
    stream = _runtime.current_stream() if stream is None else stream
    if not plan.unfused:
        k(grid, block, smem, stream, x_ptr, x_stride, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, m,
          n, eps, res_ptr, res_stride, h_ptr)  # fmt: skip
        return
    # the add first, then the norm of h (of h's dtype: y cast where it is not x's)
    add, add_grid = add_launch(dev, m, n, x_dtype, r_dtype, h_dtype, vec)
    add(add_grid, fwd.ADD_BLOCK, 0, stream, x_ptr, x_stride, 0, 0, 0, 0, 0, m, n, 0.0, res_ptr,
        res_stride, h_ptr)  # fmt: skip
    owner = None
    y_h = y_ptr
    if h_dtype != x_dtype:
        y_h, owner = workspace(m * n * h_dtype.itemsize)
    launch_forward(dev, m, n, h_ptr, n, h_dtype, y_h, w_ptr, w_dtype, b_ptr, b_dtype, mean_ptr,
                   rstd_ptr, eps, stream, rms)  # fmt: skip
    if owner is not None:
        cast, cast_grid = add_launch(dev, m, n, h_dtype, None, x_dtype, vec)
        cast(cast_grid, fwd.ADD_BLOCK, 0, stream, y_h, n, 0, 0, 0, 0, 0, m, n, 0.0, 0, 0, y_ptr)
    del owner


@lru_cache(maxsize=4096)
def vector_widths(itemsize: int, n: int, strides: tuple, align: int) -> int:
    """``vector_width`` for pointers whose OR has low bits ``align`` (every pack is a power
    of two up to 16 bytes, so the OR's alignment is every pointer's)."""
    return vector_width(itemsize, n, strides, (align,))


# ------------------------------------------------------------------------------ backward
@lru_cache(maxsize=1024)
def partial_reduce(device_id, n, x_dtype, w_dtype, db_dtype, slices):
    """(launcher, grid, block) of ln_partial_reduce summing ``slices`` dw/db partial rows of N
    columns: at most the blocks the device holds at once, each walking column chunks."""
    dev = device(device_id)
    k, cols, y = bwd.reduce_kernel(n, slices, dev.sm_count, x_dtype, w_dtype, db_dtype)
    # sm_90, and a driver that also captures such launches into CUDA graphs (12.3)
    after = bwd.REDUCE_AFTER_PRIOR and dev.max_cluster > 1 and _runtime.driver_version() >= 12030
    f = function(k, device_id, 0)
    grid = min(-(-n // cols), capacity(f, 32 * y, 0, device_id))
    return Launcher(f, REDUCE_ARGS, after), grid, (32, y)


@lru_cache(maxsize=4096)
def _backward_kernels(device_id, n, x_dtype, w_dtype, vec, short=False, rms=False, dh=False):
    """(launcher, plan, resident blocks, column launcher or None) of the backward's plan for
    rows of N (``short``: bwd.backward_short; ``rms``: RMSNorm's; ``dh``: dh added to dx)."""
    dev = device(device_id)
    plan = bwd.backward_plan(n, x_dtype, w_dtype, vec, dev.smem_optin, dev.max_cluster, short,
                             rms, dh)  # fmt: skip
    f = function(plan.kernel, device_id, plan.smem)
    cols = None
    if plan.tier == "row":
        cols = dwdb_cols(device_id, x_dtype, rms)
    cap = capacity(f, plan.block, plan.smem, device_id, plan.cluster)
    return Launcher(f, _fmt(BWD_ARGS, x_dtype)), plan, cap, cols


@lru_cache(maxsize=64)
def dwdb_cols(device_id, x_dtype, rms=False) -> Launcher:
    """ln_bwd_dwdb_cols, the column sums of the row tier and of the jagged backward."""
    f = function(bwd.dwdb_cols_kernel(x_dtype, rms), device_id, 0)
    return Launcher(f, _fmt(BWD_ARGS, x_dtype))


class BackwardLaunch(NamedTuple):
    kernel: Launcher
    plan: object
    capacity: int
    cols: Launcher | None  # the row tier's dw/db column kernel
    partials: int  # G: dw/db partial rows
    per: int  # rows a slice of the column kernel (row tier)
    reduce: tuple  # partial_reduce's (launcher, grid, block)
    inv_n: float  # 1 / N rounded to the arithmetic type, as a kernel's division would


@lru_cache(maxsize=4096)
def backward_launch(device_id, m, n, x_dtype, w_dtype, db_dtype, vec, rms=False,
                    dh=False) -> BackwardLaunch:  # fmt: skip
    """The backward's launch for M rows, with the short launch's plan where M makes one."""
    key = device_id, n, x_dtype, w_dtype, vec
    k, plan, cap, cols = _backward_kernels(*key, False, rms, dh)
    if plan.tier == "reg" and bwd.backward_short(m, plan, cap):
        k, plan, cap, cols = _backward_kernels(*key, True, rms, dh)
    sms = device(device_id).sm_count
    if plan.tier == "row":
        g, per = bwd.dwdb_slices(m, n, sms)
    else:
        g, per = bwd.backward_grid(m, plan, cap, sms), 0
    acc = acc_dtype(x_dtype).type
    inv_n = float(acc(1) / acc(n))
    red = partial_reduce(device_id, n, x_dtype, w_dtype, db_dtype, g)
    return BackwardLaunch(k, plan, cap, cols, g, per, red, inv_n)


def launch_backward(dev, m, n, dy_ptr, dy_stride, x_ptr, x_stride, x_dtype, w_ptr, w_dtype,
                    mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, db_dtype, workspace,
                    stream=None, rms=False, dh_ptr=0, dh_stride=0):  # fmt: skip
    """Backward of M >= 1 rows of N; dx contiguous. ``workspace(nbytes)`` returns (address,
    owner) of scratch memory that stays untouched until the launches on ``stream`` are done
    (memory allocated on that stream); the owner is dropped once they are enqueued. ``rms``:
    RMSNorm's (no mean, no db); ``dh_ptr`` (at ``dh_stride``, x's dtype) or 0: added to dx."""
    esz = acc_dtype(x_dtype).itemsize
    align = (x_ptr | dy_ptr | dx_ptr | dh_ptr) & 15
    vec = vector_widths(x_dtype.itemsize, n, (x_stride, dy_stride, dh_stride), align)
    k, plan, cap, cols, g, per, (red, red_grid, red_block), inv_n = backward_launch(
        dev, m, n, x_dtype, w_dtype, db_dtype, vec, rms, dh_ptr != 0
    )
    stream = _runtime.current_stream() if stream is None else stream
    part, owner = workspace((1 if rms else 2) * g * n * esz)
    dw_part = part if w_ptr else 0
    db_part = 0 if rms else part + g * n * esz
    args = (dy_ptr, dy_stride, x_ptr, x_stride, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part,
            db_part, m, n, inv_n, per, dh_ptr, dh_stride)  # fmt: skip
    if plan.tier != "row":  # one partial row per block (per cluster of blocks)
        k(g * plan.cluster, plan.block, plan.smem, stream, *args)
    else:
        k(grid_size(m, 1, cap), plan.block, plan.smem, stream, *args)
        if dw_part or db_part:
            cols((-(-n // 32), g), bwd.REDUCE_BLOCK, 0, stream, *args)
    if dw_ptr or db_ptr:
        red(red_grid, red_block, 0, stream, dw_part, db_part, g, n, dw_ptr, db_ptr)
    del owner  # back to its allocator, reusable by later work on this stream only


def forget_plans() -> None:
    """Drop every cached plan, kernel and launch (after a plan constant changes: the tests and
    tuning scripts)."""
    for fn in (forward_launch, add_launch, _backward_kernels, backward_launch, partial_reduce,
               jagged):  # fmt: skip
        fn.cache_clear()
    _pointer_forwards.clear()


# ------------------------------------------------------------------------------- jagged
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
JAGGED_CHECK_ARGS = "QqqQ"  # off, B, total, flags


class JaggedKernels:
    """The jagged kernels of one problem on one device: ``self(role, work, stream, *args)``
    launches a role's kernel on a grid for ``work`` items, at most its resident blocks."""

    def __init__(self, dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen):
        info = device(dev)
        self.fwd = jag.jagged_plan(d, x_dtype, vec, info.smem_optin, max_seqlen, False)
        self.bwd = jag.jagged_plan(d, x_dtype, vec, info.smem_optin, max_seqlen, True)
        kernels = jag.jagged_kernels(x_dtype, w_dtype, b_dtype, o_dtype, vec, self.fwd, self.bwd)
        self.launch, self.capacity = {}, {}
        for role, (k, block, smem) in kernels.items():
            f = function(k, dev, smem)
            self.launch[role] = Launcher(f, _fmt(JAGGED_ARGS[role], x_dtype))
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


@lru_cache(maxsize=1024)
def jagged(dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen) -> JaggedKernels:
    return JaggedKernels(dev, d, x_dtype, w_dtype, b_dtype, o_dtype, vec, max_seqlen)


@lru_cache(maxsize=64)
def jagged_check(dev, o_dtype):
    """(launcher, resident blocks) of the offsets check."""
    f = function(jag.check_kernel(o_dtype), dev, 0)
    return Launcher(f, JAGGED_CHECK_ARGS), capacity(f, jag.JAG_SMALL_BLOCK, 0, dev)


def describe_kernels(dev, m, n, x_dtype, w_dtype, b_dtype, vec, affine) -> dict:
    """Which kernels the forward and the backward of M rows of N run, with launch shape,
    registers per thread and resident blocks (for benchmarks)."""
    out = {}
    f = forward_launch(dev, m, n, x_dtype, w_dtype, b_dtype, vec, affine)
    b = backward_launch(dev, m, n, x_dtype, w_dtype, w_dtype, vec)
    for name, (k, plan, cap) in (("forward", f[:3]), ("backward", b[:3])):
        out[name] = (
            f"{plan.tier} vec={plan.vec} items={plan.items} tpr={plan.tpr} "
            f"block={plan.block} smem={plan.smem} regs={k.kernel.num_regs} resident={cap}"
            + (f" cluster={plan.cluster}" if plan.cluster > 1 else "")
        )
    return out
