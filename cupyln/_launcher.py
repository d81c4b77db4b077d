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
from ._plans.common import grid_size, vector_width
from ._plans.devices import PROFILES, Device, unsupported

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
# cudaDeviceAttr values (the CUDA runtime's enum) of what the plans read
_ATTRS = dict(sm_count=16, smem_block=97, smem_sm=81, l2_bytes=38, threads_sm=39,
              memory_khz=36, bus_bits=37, clusters=120)  # fmt: skip

_emulated: list = []  # [profile name] while emulate() holds one


def check_arch(name: str, arch: int) -> None:
    """Refuse a GPU older than MIN_ARCH, by name, before anything is compiled for it."""
    why = unsupported(name, arch)
    if why is not None:
        raise RuntimeError(why)


@cache
def device(device_id: int) -> Device:
    """The device as the plans see it, read off its attributes (or the profile ``emulate``
    holds, where the device can run its plans)."""
    cp = _runtime.cupy()
    rt = cp.cuda.runtime
    arch = int(cp.cuda.Device(device_id).compute_capability)
    name = rt.getDeviceProperties(device_id)["name"].decode()
    check_arch(name, arch)

    def attr(key: str) -> int:
        try:
            return rt.deviceGetAttribute(_ATTRS[key], device_id)
        except rt.CUDARuntimeError:  # not known to this driver
            return 0

    # double data rate: 2 transfers a memory clock (kHz) over the bus (bits)
    dram = 2e3 * attr("memory_khz") * attr("bus_bits") / 8
    keys = ("sm_count", "smem_block", "smem_sm", "l2_bytes", "threads_sm")
    own = Device(name, arch, *(attr(k) for k in keys), arch >= 90 and attr("clusters") > 0, dram)
    if not _emulated:
        return own
    profile = PROFILES[_emulated[0]]
    if profile.smem_block > own.smem_block or (profile.clusters and not own.clusters):
        raise RuntimeError(f"{name} cannot run the plans of {profile.name}: they take more "
                           "shared memory a block or clusters it lacks")  # fmt: skip
    return profile


def emulate(profile: str | None) -> None:
    """Plan as on the GPU of ``PROFILES[profile]`` from now on (None: as on the device itself),
    for the tests and the benchmark: the kernels still compile for the device in use and run
    on it. Drops every cached plan."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}; got {profile!r}")
    _emulated[:] = [] if profile is None else [profile]
    device.cache_clear()
    forget_plans()


def emulated() -> str | None:
    """The profile ``emulate`` holds, or None."""
    return _emulated[0] if _emulated else None


def function(k, device_id: int, smem: int):
    """The compiled kernel of record ``k``; kernels that take dynamic shared memory get the
    device's opt-in limit. (Reading the device first refuses one older than MIN_ARCH before
    anything compiles.)"""
    limit = device(device_id).smem_block
    return _compile.function(k, device_id, limit if smem else 0)


def capacity(f, block: int, smem: int, device_id: int, cluster: int = 1) -> int:
    """Resident blocks of compiled kernel ``f`` on the whole device (a persistent grid's size);
    for a kernel of thread-block clusters, resident clusters: 0 where the driver reports that
    none fits (SMs / cluster where the driver cannot tell)."""
    from cupy_backends.cuda.api import driver

    sms = device(device_id).sm_count
    if cluster > 1:
        clusters = max_active_clusters(f, cluster, block, smem)
        return max(1, sms // cluster) if clusters is None else clusters
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, block, smem)
    return max(1, per_sm) * sms


def _placed(device_id: int, make):
    """(plan, compiled kernel, resident blocks) of ``make(max_cluster)``: the plan at the
    device's largest cluster, or the plan without clusters where none of its clusters fits."""
    plan = make(device(device_id).max_cluster)
    f = function(plan.kernel, device_id, plan.smem)
    cap = capacity(f, plan.block, plan.smem, device_id, plan.cluster)
    if cap == 0:
        plan = make(1)
        f = function(plan.kernel, device_id, plan.smem)
        cap = capacity(f, plan.block, plan.smem, device_id)
    return plan, f, cap


# ------------------------------------------------------------------------------ forward
@lru_cache(maxsize=4096)
def forward_launch(device_id, m, n, x_dtype, w_dtype, b_dtype, vec, affine=(True, True),
                   rms=False, residual=None):  # fmt: skip
    """(launcher, plan, resident blocks, grid) of the forward of M rows of N on this device,
    ``affine``: (w given, b given); ``rms``: RMSNorm; ``residual``: (residual dtype, h dtype)
    of a residual add in front, or None."""
    dev = device(device_id)

    def make(max_cluster):
        return fwd.forward_launch_plan(m, n, x_dtype, w_dtype, b_dtype, vec, dev.smem_block,
                                       max_cluster, dev.sm_count, dev.dram_per_sm, affine, rms,
                                       residual, dev.threads_sm)  # fmt: skip

    plan, f, cap = _placed(device_id, make)
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
    # sm_90 and newer, and a driver that also captures such launches into CUDA graphs (12.3)
    after = bwd.REDUCE_AFTER_PRIOR and dev.arch >= 90 and _runtime.driver_version() >= 12030
    f = function(k, device_id, 0)
    grid = min(-(-n // cols), capacity(f, 32 * y, 0, device_id))
    return Launcher(f, REDUCE_ARGS, after), grid, (32, y)


@lru_cache(maxsize=4096)
def _backward_kernels(device_id, n, x_dtype, w_dtype, vec, short=False, rms=False, dh=False):
    """(launcher, plan, resident blocks, column launcher or None) of the backward's plan for
    rows of N (``short``: bwd.backward_short; ``rms``: RMSNorm's; ``dh``: dh added to dx)."""
    smem = device(device_id).smem_block

    def make(max_cluster):
        return bwd.backward_plan(n, x_dtype, w_dtype, vec, smem, max_cluster, short, rms, dh)

    plan, f, cap = _placed(device_id, make)
    cols = dwdb_cols(device_id, x_dtype, rms) if plan.tier == "row" else None
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


def precompile(device_id, n, x_dtype, w_dtype, b_dtype, db_dtype, affine=(True, True),
               rms=False, residual=None, backward=True) -> set:  # fmt: skip
    """Compile every kernel that rows of N (contiguous, pointers 16-byte aligned) can take at
    any M, forward and (``backward``) backward, so that no later call compiles: a CUDA-graph
    capture cannot load a module. ``residual``: (residual dtype, h dtype) or None; the
    backward of a residual is the one of h, with and without dh. Returns the kernel records."""
    dev = device(device_id)
    problem = (n, x_dtype, w_dtype, b_dtype, db_dtype, affine, rms, residual, backward)
    done = set()
    for max_cluster in (dev.max_cluster, 1):
        fits = True
        for item in _ahead(dev, max_cluster, *problem):
            if not hasattr(item, "kernel"):  # a kernel record of its own, no shared memory
                function(item, device_id, 0)
                done.add(item)
                continue
            f = function(item.kernel, device_id, item.smem)
            done.add(item.kernel)
            if item.cluster > 1:
                fits = fits and capacity(f, item.block, item.smem, device_id, item.cluster) > 0
        if fits:  # else the launches that find no cluster fitting take the plans without
            break
    return done


def _ahead(dev, max_cluster, n, x_dtype, w_dtype, b_dtype, db_dtype, affine, rms, residual,
           backward) -> set:  # fmt: skip
    """precompile's plans and kernel records at clusters of up to ``max_cluster`` blocks."""
    out = set()

    def forward(x, res):
        widest = max([x.itemsize] + [d.itemsize for d in res or ()])
        vec = vector_width(widest, n, (n,))
        for p in fwd.forward_launch_plans(n, x, w_dtype, b_dtype, vec, dev.smem_block,
                                          max_cluster, dev.dram_per_sm, affine, rms, res,
                                          dev.threads_sm):  # fmt: skip
            out.add(p)
            if p.unfused:  # ln_fwd_add, its cast, then the norm of h as a problem of its own
                out.add(fwd.add_kernel(x, *res, vec))
                out.add(fwd.add_kernel(res[1], None, x, vec))
                forward(res[1], None)

    forward(x_dtype, residual)
    if not backward:
        return out
    h = x_dtype if residual is None else residual[1]
    vec = vector_width(h.itemsize, n, (n,))
    for short in (False, True):
        for dh in {False, residual is not None}:
            p = bwd.backward_plan(n, h, w_dtype, vec, dev.smem_block, max_cluster, short, rms, dh)
            out.add(p)
            if p.tier == "row":
                out.add(bwd.dwdb_cols_kernel(h, rms))
    for slices in (1, bwd.PARTIAL_REDUCE_FEW):
        out.add(bwd.reduce_kernel(n, slices, dev.sm_count, h, w_dtype, db_dtype)[0])
    return out


def forget_plans() -> None:
    """Drop every cached plan, kernel and launch (after a plan constant changes: the tests and
    tuning scripts)."""
    for fn in (forward_launch, add_launch, _backward_kernels, backward_launch, partial_reduce,
               jagged, jagged_check, jagged_clamp, dwdb_cols):  # fmt: skip
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
def jagged_clamp(dev, o_dtype) -> Launcher:
    """The offsets' clamp (one block of jag.JAG_CLAMP_BLOCK threads)."""
    return Launcher(function(jag.clamp_kernel(o_dtype), dev, 0), JAGGED_CHECK_ARGS)


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
