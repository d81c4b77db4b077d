"""Array API: validation, flattening to rows, allocation and launch on CuPy arrays.

Every check runs before anything is allocated or launched, so a call that raises has written
nothing. Kernels run on the device that holds ``x`` and on that device's current CuPy stream.
``launch_forward`` / ``launch_backward`` take raw pointers and a stream: the framework bridges
(cupyln/torch.py, cupyln/jax.py) validate and allocate with their own tensors and launch
through them.

The hot path: a call whose arrays have the shapes, strides, dtypes and device of an earlier
valid call reuses that call's checks and launch plan (a dictionary lookup on those
attributes), allocates all its outputs with one pool allocation and launches through the
driver with a packed argument buffer (``_driver.Launcher``). ``launch_forward`` remembers its
finished launches by problem and pointer alignment, so a bridge's repeated call is one lookup.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import NamedTuple

import numpy

from . import _compile, _launch
from ._driver import Launcher, max_active_clusters
from ._driver import _driver as _driver_api
from ._dtypes import SUPPORTED_NAMES, TABLE, acc_dtype

_u64 = numpy.uint64  # a pointer kernel argument (0: null)
_MAX_N = 2**31 - 2**16  # columns are int32 in the kernels, with room for one block stride


_forward_calls: dict = {}  # cached calls of forward / backward on CuPy arrays (_Call)
_backward_calls: dict = {}
_pointer_forwards: dict = {}  # launch_forward's launches by problem, pointers' alignment
_MAX_CALLS = 4096  # distinct attribute sets remembered; past that, new ones are not cached


# ------------------------------------------------------------------------ validation
_modules: list = []  # [cupy, _Cuda], imported on first use (importing cupyln needs no CuPy)


class _Cuda:
    """The CuPy and driver functions the cached calls use, looked up once."""

    __slots__ = ("ndarray", "alloc", "device", "context", "stream")

    def __init__(self, cupy):
        self.ndarray = cupy.ndarray
        self.alloc = cupy.cuda.alloc  # the current allocator (cupy.cuda.set_allocator)
        self.device = cupy.cuda.runtime.getDevice
        self.context = _driver_api().ctxGetCurrent
        self.stream = cupy.cuda.get_current_stream


def _cupy():
    if not _modules:
        import cupy

        _modules.extend((cupy, _Cuda(cupy)))
    return _modules[0]


def _cuda() -> _Cuda:
    _cupy()
    return _modules[1]


def _check_array(a, name: str, device_id: int | None = None) -> None:
    cupy = _cupy()
    if not isinstance(a, cupy.ndarray):
        kind = f"{type(a).__module__}.{type(a).__qualname__}"
        raise TypeError(
            f"{name} must be a cupy.ndarray on a GPU; got {kind} (use cupy.asarray for NumPy "
            "data, cupy.from_dlpack for torch/JAX tensors, or cupyln.torch / cupyln.jax)"
        )
    if a.dtype not in TABLE:
        raise TypeError(f"{name} must have dtype {', '.join(SUPPORTED_NAMES)}; got {a.dtype}")
    if device_id is not None and a.data.device_id != device_id:
        raise ValueError(
            f"{name} must be on the same device as x (cuda:{device_id}); "
            f"got cuda:{a.data.device_id}"
        )


def _check_vector(a, name: str, n: int, device_id: int) -> None:
    if a is None:
        return
    _check_array(a, name, device_id)
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match x.shape[-1]; got {a.shape}")


def _check_eps(eps) -> float:
    if type(eps) is float and 0.0 <= eps < math.inf:  # the usual case, one test
        return eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, numpy.integer, numpy.floating)):
        raise TypeError(f"eps must be a real number; got {type(eps).__name__}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps must be finite and >= 0; got {eps}")
    return eps


def _check_x(x, name: str = "x") -> int:
    _check_array(x, name)
    return _check_width(x.shape, name)


def _check_width(shape, name: str) -> int:
    """N of an input of this shape (the bridges' check too): rows of 1 to _MAX_N elements."""
    if len(shape) == 0:
        raise ValueError(f"{name} must have at least one dimension (..., N); got a 0-d array")
    n = shape[-1]
    if not 1 <= n <= _MAX_N:
        raise ValueError(f"{name}.shape[-1] (N) must be in [1, {_MAX_N}]; got {n}")
    return n


def _check_out(out, name: str, shape, dtype, device_id: int) -> None:
    _check_array(out, name, device_id)
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"{name} must be a {numpy.dtype(dtype).name} array of shape {tuple(shape)}; "
            f"got {out.dtype} {out.shape}"
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def _check_outs(out, names, specs, device_id):
    if out is None:
        return None
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        raise TypeError(f"out must be a tuple ({', '.join(names)}); got {type(out).__name__}")
    for a, name, (shape, dtype) in zip(out, names, specs):
        if a is not None:
            _check_out(a, name, shape, dtype, device_id)
    return out


# ------------------------------------------------------------------------ layout
def row_stride(shape, strides):
    """Row stride, in elements, of the (M, N) row view of an array with this ``shape`` and
    ``strides`` (in elements): its rows must sit at one non-negative stride with a contiguous
    last dimension. None when they do not (the caller copies)."""
    n = shape[-1]
    if n != 1 and strides[-1] != 1:
        return None
    lead = [(d, s) for d, s in zip(shape[:-1], strides[:-1]) if d != 1]
    if not lead:
        return n
    if any(s0 != s1 * d1 for (_, s0), (d1, s1) in zip(lead, lead[1:])):
        return None
    return lead[-1][1] if lead[-1][1] >= 0 else None


def _rows(a):
    """(array, row stride in elements) for a CuPy array: rows at one stride are used in place,
    other layouts are copied to C order."""
    e = a.itemsize
    stride = None
    if all(s % e == 0 for s in a.strides):
        stride = row_stride(a.shape, [s // e for s in a.strides])
    if stride is None:
        a = _cupy().ascontiguousarray(a)
        stride = a.shape[-1]
    return a, stride


def _aligned_vector(a):
    """w/b are read as contiguous packs of up to 64 bytes: a strided or misaligned vector is
    copied to a fresh allocation."""
    if a is None or (a.data.ptr % 64 == 0 and a.flags.c_contiguous):
        return a
    return _cupy().array(a, copy=True, order="C")


# ------------------------------------------------------------------------ device, kernels
class _Device(NamedTuple):
    sm_count: int
    smem_optin: int
    max_cluster: int  # blocks per thread-block cluster the kernels may use (1: no clusters)
    dram_per_sm: float  # peak DRAM bytes per second an SM (0: not reported)


@cache
def _device(device_id: int) -> _Device:
    d = _cupy().cuda.Device(device_id)
    attrs = d.attributes
    clusters = _launch.MAX_CLUSTER if int(d.compute_capability) >= 90 else 1
    sms = attrs["MultiProcessorCount"]
    # double data rate: 2 transfers a memory clock (kHz) over the bus (bits)
    dram = 2e3 * attrs.get("MemoryClockRate", 0) * attrs.get("GlobalMemoryBusWidth", 0) / 8
    return _Device(sms, attrs["MaxSharedMemoryPerBlockOptin"], clusters, dram / sms)


def _capacity(kernel, block: int, smem: int, device_id: int, cluster: int = 1) -> int:
    """Resident blocks of ``kernel`` on the whole device (the persistent grid's size); for a
    kernel of thread-block clusters, resident clusters."""
    from cupy_backends.cuda.api import driver

    sms = _device(device_id).sm_count
    if cluster > 1:
        return max_active_clusters(kernel, cluster, block, smem) or max(1, sms // cluster)
    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, block, smem)
    return max(1, per_sm) * sms


def _get(plan_source: str, expr: str, device_id: int, smem: int):
    """Kernels that stage rows in shared memory get the device's opt-in limit."""
    limit = _device(device_id).smem_optin if smem else 0
    return _compile.kernel(plan_source, expr, device_id, limit)


# Kernel parameter layouts (struct format, see _driver): pointers Q, strides and row counts q,
# N and counts i, eps and 1 / N in the arithmetic type (f or d).
_FWD_ARGS = "QqQQQQQqi"  # x, x_stride, y, w, b, mean, rstd, m, n (+ eps)
# dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_p, db_p, m, n (+ 1 / N)
_BWD_REG_ARGS = "QqQqQQQQQQqi"
_BWD_ROW_ARGS = "QqQqQQQQqi"  # dy, dy_stride, x, x_stride, w, mean, rstd, dx, m, n
_COLS_ARGS = "QqQqQQQQqiq"  # dy, dy_stride, x, x_stride, mean, rstd, dw_p, db_p, m, n, per
_REDUCE_ARGS = "QQiiQQ"  # dw_p, db_p, slices, n, dw, db


def _eps_code(x_dtype) -> str:
    return "d" if acc_dtype(x_dtype).itemsize == 8 else "f"


@lru_cache(maxsize=4096)
def _forward_launch(device_id, m, n, x_dtype, w_dtype, b_dtype, vec, affine=(True, True)):
    """(launcher, plan, resident blocks) of the forward of M rows of N on this device, ``affine``
    (w given, b given): one cache lookup per call for a shape seen before (the bridges launch
    through it each call)."""
    dev = _device(device_id)
    plan = _launch.forward_launch_plan(
        m, n, x_dtype, w_dtype, b_dtype, vec, dev.smem_optin, dev.max_cluster, dev.sm_count,
        dev.dram_per_sm, affine,
    )  # fmt: skip
    return _forward_kernel(device_id, plan, x_dtype)


def forget_forward_plans() -> None:
    """Drop every cached forward plan, kernel and launch (after _launch's constants change:
    the tests and tuning scripts)."""
    _forward_launch.cache_clear()
    _forward_kernel.cache_clear()
    _forward_calls.clear()
    _pointer_forwards.clear()


@lru_cache(maxsize=4096)
def _forward_kernel(device_id, plan, x_dtype):
    k = _get(plan.source, plan.expr, device_id, plan.smem)
    return (
        Launcher(k, _FWD_ARGS + _eps_code(x_dtype)),
        plan,
        _capacity(k, plan.block, plan.smem, device_id, plan.cluster),
    )


@cache
def _driver_version() -> int:
    return _cupy().cuda.runtime.driverGetVersion()


@lru_cache(maxsize=1024)
def partial_reduce(device_id, n, x_dtype, w_dtype, db_dtype, slices):
    """(launcher, grid, block) of ln_partial_reduce, the fixed-order sum of ``slices`` dw/db
    partial rows of N columns, on this device: at most the blocks the device holds at once,
    each walking column chunks."""
    dev = _device(device_id)
    cols, y = _launch.partial_reduce_shape(n, slices, dev.sm_count)
    expr = _launch.reduce_expr(x_dtype, w_dtype, db_dtype, cols, y)
    # sm_90, and a driver that also captures such launches into CUDA graphs (12.3)
    after_prior = _launch.REDUCE_AFTER_PRIOR and dev.max_cluster > 1 and _driver_version() >= 12030
    k = _get(_compile.BWD_SOURCE, expr, device_id, 0)
    grid = min(-(-n // cols), _capacity(k, 32 * y, 0, device_id))
    return Launcher(k, _REDUCE_ARGS, after_prior), grid, (32, y)


@lru_cache(maxsize=4096)
def _backward_launch(device_id, n, x_dtype, w_dtype, db_dtype, vec, short=False):
    """(launcher, plan, resident blocks, dw/db column launcher or None) of the backward for
    this problem on this device (``short``: _launch.backward_short)."""
    dev = _device(device_id)
    plan = _launch.backward_plan(n, x_dtype, w_dtype, vec, dev.smem_optin, dev.max_cluster, short)
    k = _get(plan.source, plan.expr, device_id, plan.smem)
    cols = None
    if plan.tier == "row":
        cols = _get(_compile.BWD_SOURCE, _launch.dwdb_cols_expr(x_dtype), device_id, 0)
        cols = Launcher(cols, _COLS_ARGS)
    fmt = _BWD_ROW_ARGS if plan.tier == "row" else _BWD_REG_ARGS + _eps_code(x_dtype)
    cap = _capacity(k, plan.block, plan.smem, device_id, plan.cluster)
    return Launcher(k, fmt), plan, cap, cols


@lru_cache(maxsize=4096)
def _backward_grid(device_id, m, n, x_dtype, w_dtype, db_dtype, vec):
    """The backward's launch for M rows: _backward_launch's (launcher, plan, resident blocks,
    column launcher), with the short launch's plan where M makes one (_launch.backward_short),
    then G, rows per slice and partial_reduce: G dw/db partial rows, one per block (cluster) of
    the register, ring and cluster tiers (_launch.backward_grid) or per slice of the row tier's
    column kernel (_launch.dwdb_slices, its rows per slice), and 1 / N rounded to the arithmetic
    type (the kernels with partials take it). One cache lookup per call for a shape seen
    before."""
    key = device_id, n, x_dtype, w_dtype, db_dtype, vec
    launch = _backward_launch(*key)
    _, plan, cap, _ = launch
    if plan.tier == "reg" and _launch.backward_short(m, plan, cap):
        launch = _backward_launch(*key, True)
        _, plan, cap, _ = launch
    sms = _device(device_id).sm_count
    if plan.tier == "row":
        g, per = _launch.dwdb_slices(m, n, sms)
    else:
        g, per = _launch.backward_grid(m, plan, cap, sms), 0
    acc = acc_dtype(x_dtype).type
    inv_n = float(acc(1) / acc(n))  # IEEE division in that type, as a kernel's would round
    return (
        *launch, g, per, partial_reduce(device_id, n, x_dtype, w_dtype, db_dtype, g), inv_n
    )  # fmt: skip


@lru_cache(maxsize=4096)
def _vector_width(itemsize: int, n: int, strides: tuple, align: int) -> int:
    """``_launch.vector_width`` for pointers whose OR has low bits ``align`` (all the packs are
    powers of two up to 16 bytes, so the OR's alignment is every pointer's)."""
    return _launch.vector_width(itemsize, n, strides, (align,))


class _OnDevice:
    """Makes ``device_id`` current for the block when it is not already (cheap when it is)."""

    __slots__ = ("_ctx",)

    def __init__(self, device_id: int):
        cupy = _cupy()
        self._ctx = None
        if cupy.cuda.runtime.getDevice() != device_id:
            self._ctx = cupy.cuda.Device(device_id)
        elif not _driver_api().ctxGetCurrent():
            # a thread that has not used CUDA yet (torch's autograd thread, XLA's callback
            # thread): the driver-level launch needs the device's context made current
            cupy.cuda.runtime.setDevice(device_id)

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _current_stream() -> int:
    return _cupy().cuda.get_current_stream().ptr


class _RawStream:
    """A raw CUstream in the CUDA stream protocol (what ``cupy.cuda.Stream.from_external``
    takes)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_external_streams: dict = {}


def external_stream(device_id: int, ptr: int):
    """CuPy's Stream for a framework's raw stream ``ptr`` on ``device_id`` (cached): made
    current, CuPy's pool allocations and the CuPy calls inside are ordered on it. Call with
    ``device_id`` current."""
    s = _external_streams.get((device_id, ptr))
    if s is None:
        s = _cupy().cuda.Stream.from_external(_RawStream(ptr))
        _external_streams[(device_id, ptr)] = s
    return s


def describe(x, w=None, b=None) -> dict:
    """Which kernels ``forward(x, w, b)`` and ``backward`` run for these arrays, with their
    launch shape, registers per thread and resident blocks on the device (for benchmarks)."""
    n, dev = x.shape[-1], x.data.device_id
    x2, stride = _rows(x)
    vec = _launch.vector_width(x.itemsize, n, (stride,), (x2.data.ptr,))
    wdt = x.dtype if w is None else w.dtype
    bdt = x.dtype if b is None else b.dtype
    m = max(1, math.prod(x.shape[:-1]))  # (an empty x launches nothing; the plans of one row)
    affine = (w is not None, b is not None)
    out = {}
    with _OnDevice(dev):
        for name, (k, plan, cap) in (
            ("forward", _forward_launch(dev, m, n, x.dtype, wdt, bdt, vec, affine)),
            ("backward", _backward_grid(dev, m, n, x.dtype, wdt, wdt, vec)[:3]),
        ):
            out[name] = (
                f"{plan.tier} vec={plan.vec} items={plan.items} tpr={plan.tpr} "
                f"block={plan.block} smem={plan.smem} regs={k.kernel.num_regs} resident={cap}"
                + (f" cluster={plan.cluster}" if plan.cluster > 1 else "")
            )
    return out


# ------------------------------------------------------------------------ launch on pointers
# The kernels take raw device pointers: these two functions are what the CuPy API below and the
# framework bridges share. They launch on the current device, on ``stream`` (a raw CUstream;
# None: CuPy's current stream), and need pointers to memory of the dtypes named (w/b pointers
# 64-byte aligned, or 0 for none).
def launch_forward(dev, m, n, x_ptr, x_stride, x_dtype, y_ptr, w_ptr, w_dtype, b_ptr, b_dtype,
                   mean_ptr, rstd_ptr, eps, stream=None):  # fmt: skip
    """Forward of M >= 1 rows of N; y contiguous, mean/rstd of M values (both 0: not stored)."""
    align = (x_ptr | y_ptr) & 15
    key = (dev, m, n, x_stride, x_dtype, w_dtype, b_dtype, w_ptr != 0, b_ptr != 0, align)
    launch = _pointer_forwards.get(key)  # one lookup for the bridges' repeated calls
    if launch is None:
        vec = _vector_width(x_dtype.itemsize, n, (x_stride,), align)
        k, plan, cap = _forward_launch(dev, m, n, x_dtype, w_dtype, b_dtype, vec, key[7:9])
        launch = (k, _launch.forward_grid(m, plan, cap), plan.block, plan.smem)
        if len(_pointer_forwards) < _MAX_CALLS:
            _pointer_forwards[key] = launch
    k, grid, block, smem = launch
    k(grid, block, smem, _current_stream() if stream is None else stream,
      x_ptr, x_stride, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, m, n, eps)  # fmt: skip


def device_is_current(device_id: int) -> bool:
    """Whether ``device_id`` is the current device and its context is current in this thread
    (then a launch needs no ``_OnDevice``)."""
    cuda = _modules[1] if _modules else _cuda()
    return cuda.device() == device_id and bool(cuda.context())


def pool_workspace(nbytes: int):
    """A ``launch_backward`` workspace from CuPy's pool on its current stream."""
    mem = _allocate(nbytes)
    return mem.ptr, mem


def launch_backward(dev, m, n, dy_ptr, dy_stride, x_ptr, x_stride, x_dtype, w_ptr, w_dtype,
                    mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, db_dtype, workspace,
                    stream=None):  # fmt: skip
    """Backward of M >= 1 rows of N; dx contiguous. ``workspace(nbytes)`` returns (address,
    owner) of scratch memory that stays untouched until the launches on ``stream`` are done
    (memory allocated on that stream); the owner is dropped once they are enqueued."""
    esz = acc_dtype(x_dtype).itemsize
    vec = _vector_width(x_dtype.itemsize, n, (x_stride, dy_stride), (x_ptr | dy_ptr | dx_ptr) & 15)
    launch = _backward_grid(dev, m, n, x_dtype, w_dtype, db_dtype, vec)
    k, plan, cap, cols, g, per, (red, red_grid, red_block), inv_n = launch
    stream = _current_stream() if stream is None else stream
    part, owner = workspace(2 * g * n * esz)
    dw_part = part if w_ptr else 0
    db_part = part + g * n * esz
    if plan.tier != "row":  # one partial row per block (per cluster of blocks)
        k(g * plan.cluster, plan.block, plan.smem, stream, dy_ptr, dy_stride, x_ptr, x_stride,
          w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part, db_part, m, n, inv_n)  # fmt: skip
    else:
        k(_launch.grid_size(m, 1, cap), plan.block, plan.smem, stream, dy_ptr, dy_stride, x_ptr,
          x_stride, w_ptr, mean_ptr, rstd_ptr, dx_ptr, m, n)  # fmt: skip
        cols((-(-n // 32), g), _launch.REDUCE_BLOCK, 0, stream, dy_ptr, dy_stride, x_ptr,
             x_stride, mean_ptr, rstd_ptr, dw_part, db_part, m, n, per)  # fmt: skip
    red(red_grid, red_block, 0, stream, dw_part, db_part, g, n, dw_ptr, db_ptr)
    del owner  # back to its allocator, reusable by later work on this stream only


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _round_up(nbytes: int, to: int = 256) -> int:
    return -(-nbytes // to) * to


# ------------------------------------------------------------------------ cached calls
class _Call(NamedTuple):
    """What a valid call found for one set of array attributes (see the module docstring)."""

    dev: int
    m: int
    n: int
    shape: tuple  # of y / dx
    lead: tuple  # of mean, rstd
    dtype: numpy.dtype  # of y / dx
    acc: numpy.dtype
    x_stride: int
    dy_stride: int
    w_dtype: numpy.dtype
    b_dtype: numpy.dtype  # forward: b's; backward: db's
    offsets: tuple  # byte offsets of the outputs in their one allocation, and its size
    dtype_args: tuple  # the outputs' dtypes as cupy.ndarray takes them fastest (_dtype_arg)
    # forward only: the launch, valid while x's pointer has no bits of x_align set
    launch: object = None
    grid: int = 0
    block: int = 0
    smem: int = 0
    x_align: int = 0


def _vkey(a):
    return None if a is None else (type(a), a.shape, a.strides, a.dtype, a.data.device_id)


def _akey(a):
    return (type(a), a.shape, a.strides, a.dtype, a.data.device_id)


def _forward_key(x, w, b):
    """The attributes of x, w and b a cached forward depends on; one flat tuple in the usual
    call, with both w and b (the cheapest key to build and hash)."""
    if w is None or b is None:
        return (_akey(x), _vkey(w), _vkey(b))
    t = type
    return (
        t(x), x.shape, x.strides, x.dtype, x.data.device_id,
        t(w), w.shape, w.strides, w.dtype, w.data.device_id,
        t(b), b.shape, b.strides, b.dtype, b.data.device_id,
    )  # fmt: skip


def _backward_key(dy, x, w, mean, rstd):
    """The attributes of the arguments a cached backward depends on (flat, as _forward_key)."""
    if w is None:
        return (_akey(dy), _akey(x), None, _akey(mean), _akey(rstd))
    t = type
    return (
        t(dy), dy.shape, dy.strides, dy.dtype, dy.data.device_id,
        t(x), x.shape, x.strides, x.dtype, x.data.device_id,
        t(w), w.shape, w.strides, w.dtype, w.data.device_id,
        t(mean), mean.shape, mean.strides, mean.dtype, mean.data.device_id,
        t(rstd), rstd.shape, rstd.strides, rstd.dtype, rstd.data.device_id,
    )  # fmt: skip


_SCALAR_TYPES = (numpy.float16, numpy.float32, numpy.float64)


def _dtype_arg(dtype: numpy.dtype):
    """``dtype`` as ``cupy.ndarray`` resolves it fastest: NumPy's float types by their scalar
    type (a cached lookup in CuPy, about 0.2 µs less than a dtype object), others (ml_dtypes'
    bfloat16) as the dtype."""
    return dtype.type if dtype.type in _SCALAR_TYPES else dtype


def _allocate(nbytes: int):
    return _cupy().cuda.alloc(nbytes)


def _ndarray(shape, dtype, mem, offset: int):
    return _cupy().ndarray(shape, dtype, mem + offset if offset else mem)


# ------------------------------------------------------------------------ public functions
def forward(x, w=None, b=None, eps=1e-5, *, out=None):
    """LayerNorm over the last dimension of ``x``.

    Args:
        x: CuPy array (..., N) of float32, float16, bfloat16 or float64; rows may be strided
            (last dimension contiguous); other layouts are copied.
        w, b: optional CuPy arrays of shape (N,), each of any of those dtypes.
        eps: added to the biased variance; finite and >= 0.
        out: optional (y, mean, rstd) preallocated outputs (C-contiguous; entries may be None).

    Returns:
        (y, mean, rstd): y of x's shape and dtype; mean and rstd of shape x.shape[:-1], float32
        (float64 for float64 x), rstd = 1 / sqrt(var + eps). Without ``out``, the three share
        one allocation.
    """
    if out is None:
        try:
            call = _forward_calls.get(_forward_key(x, w, b))
        except AttributeError:  # not arrays: the checks below say what came
            call = None
        if call is not None:
            eps = _check_eps(eps)
            cuda = _modules[1]
            x_ptr = x.data.ptr
            w_ptr = 0 if w is None else w.data.ptr
            b_ptr = 0 if b is None else b.data.ptr
            if (
                not ((w_ptr | b_ptr) & 63 or x_ptr & call.x_align)
                and cuda.device() == call.dev
                and cuda.context()
            ):
                o1, o2, size = call.offsets
                mem = cuda.alloc(size)
                y_ptr = mem.ptr
                call.launch(call.grid, call.block, call.smem, cuda.stream().ptr,
                            x_ptr, call.x_stride, y_ptr, w_ptr, b_ptr, y_ptr + o1, y_ptr + o2,
                            call.m, call.n, eps)  # fmt: skip
                nd, (y_dtype, stat_dtype) = cuda.ndarray, call.dtype_args
                return (
                    nd(call.shape, y_dtype, mem),
                    nd(call.lead, stat_dtype, mem + o1),
                    nd(call.lead, stat_dtype, mem + o2),
                )
    return _forward_checked(x, w, b, eps, out)


def _forward_checked(x, w, b, eps, out):
    n = _check_x(x)
    dev = x.data.device_id
    _check_vector(w, "w", n, dev)
    _check_vector(b, "b", n, dev)
    eps = _check_eps(eps)
    acc = acc_dtype(x.dtype)
    lead = x.shape[:-1]
    specs = ((x.shape, x.dtype), (lead, acc), (lead, acc))
    outs = _check_outs(out, ("y", "mean", "rstd"), specs, dev)
    m = math.prod(lead)
    wdt = x.dtype if w is None else w.dtype
    bdt = x.dtype if b is None else b.dtype

    with _OnDevice(dev):
        x2, stride = _rows(x)
        w2, b2 = _aligned_vector(w), _aligned_vector(b)
        y, mean, rstd = outs if outs is not None else (None, None, None)
        if outs is None and m:
            y_bytes = _round_up(m * n * x.itemsize)
            stat_bytes = _round_up(m * acc.itemsize)
            offsets = (y_bytes, y_bytes + stat_bytes, y_bytes + 2 * stat_bytes)
            mem = _allocate(offsets[2])
            y = _ndarray(x.shape, x.dtype, mem, 0)
            mean = _ndarray(lead, acc, mem, offsets[0])
            rstd = _ndarray(lead, acc, mem, offsets[1])
            in_place = x2 is x and w2 is w and b2 is b
            if in_place and len(_forward_calls) < _MAX_CALLS:
                vec = _vector_width(x.itemsize, n, (stride,), x.data.ptr & 15)
                affine = (w is not None, b is not None)
                k, plan, cap = _forward_launch(dev, m, n, x.dtype, wdt, bdt, vec, affine)
                _forward_calls[_forward_key(x, w, b)] = _Call(
                    dev,
                    m,
                    n,
                    x.shape,
                    lead,
                    x.dtype,
                    acc,
                    stride,
                    0,
                    wdt,
                    bdt,
                    offsets,
                    (_dtype_arg(x.dtype), _dtype_arg(acc)),
                    k,
                    _launch.forward_grid(m, plan, cap),
                    plan.block,
                    plan.smem,
                    vec * x.itemsize - 1,
                )
        cupy = _cupy()
        y = cupy.empty(x.shape, x.dtype) if y is None else y
        mean = cupy.empty(lead, acc) if mean is None else mean
        rstd = cupy.empty(lead, acc) if rstd is None else rstd
        if m == 0:
            return y, mean, rstd
        launch_forward(dev, m, n, x2.data.ptr, stride, x.dtype, y.data.ptr, _ptr(w2), wdt,
                       _ptr(b2), bdt, mean.data.ptr, rstd.data.ptr, eps)  # fmt: skip
    return y, mean, rstd


def layer_norm(x, w=None, b=None, eps=1e-5):
    """``forward(x, w, b, eps)[0]``: the normalized array only."""
    return forward(x, w, b, eps)[0]


def backward(dy, x, w, mean, rstd, *, bias_dtype=None, out=None):
    """Gradients of LayerNorm given the forward's saved mean and rstd.

    Args:
        dy: gradient of y, same shape and dtype as x (rows may be strided, as x).
        x: the forward's input.
        w: the forward's weight, or None (then dw is None).
        mean, rstd: the forward's statistics, shape x.shape[:-1], float32 (float64 for float64 x).
        bias_dtype: dtype of db (default: w's dtype, or x's without w).
        out: optional (dx, dw, db) preallocated outputs (entries may be None).

    Returns:
        (dx, dw, db): dx like x; dw (w's dtype, None without w) and db (column sum of dy),
        computed deterministically (the same inputs give bitwise-identical results). Without
        ``out``, the three share one allocation.
    """
    if out is None and bias_dtype is None:
        try:
            call = _backward_calls.get(_backward_key(dy, x, w, mean, rstd))
        except AttributeError:  # not arrays: the checks below say what came
            call = None
        if call is not None:
            cuda = _modules[1]
            if not _ptr(w) & 63 and cuda.device() == call.dev and cuda.context():
                return _backward_launch_call(call, dy, x, w, mean, rstd)
    return _backward_checked(dy, x, w, mean, rstd, bias_dtype, out)


def _backward_launch_call(call, dy, x, w, mean, rstd):
    """Allocate dx, dw, db in one block and the workspace in another; launch."""
    o1, o2, size = call.offsets
    cuda = _modules[1]
    mem = cuda.alloc(size)
    dx_ptr = mem.ptr
    dw_ptr = dx_ptr + o1 if w is not None else 0
    launch_backward(call.dev, call.m, call.n, dy.data.ptr, call.dy_stride, x.data.ptr,
                    call.x_stride, call.dtype, _ptr(w), call.w_dtype, mean.data.ptr,
                    rstd.data.ptr, dx_ptr, dw_ptr, dx_ptr + o2, call.b_dtype,
                    pool_workspace)  # fmt: skip
    nd, (dx_dtype, dw_dtype, db_dtype) = cuda.ndarray, call.dtype_args
    n = (call.n,)
    return (
        nd(call.shape, dx_dtype, mem),
        None if w is None else nd(n, dw_dtype, mem + o1),
        nd(n, db_dtype, mem + o2),
    )


def _backward_checked(dy, x, w, mean, rstd, bias_dtype, out):
    n = _check_x(x)
    dev = x.data.device_id
    _check_array(dy, "dy", dev)
    if dy.shape != x.shape:
        raise ValueError(f"dy must have the shape of x {x.shape}; got {dy.shape}")
    if dy.dtype != x.dtype:
        raise TypeError(f"dy must have the dtype of x ({x.dtype}); got {dy.dtype}")
    _check_vector(w, "w", n, dev)
    acc = acc_dtype(x.dtype)
    lead = x.shape[:-1]
    for a, name in ((mean, "mean"), (rstd, "rstd")):
        _check_array(a, name, dev)
        if a.dtype != acc:
            raise TypeError(f"{name} must be {acc.name} for {x.dtype} x; got {a.dtype}")
        if a.shape != lead:
            raise ValueError(f"{name} must have shape x.shape[:-1] = {lead}; got {a.shape}")
    if bias_dtype is not None:
        db_dtype = numpy.dtype(bias_dtype)
    else:
        db_dtype = w.dtype if w is not None else x.dtype
    if db_dtype not in TABLE:
        raise TypeError(f"bias_dtype must be one of {', '.join(SUPPORTED_NAMES)}; got {db_dtype}")
    wdt = x.dtype if w is None else w.dtype
    specs = ((x.shape, x.dtype), ((n,), wdt), ((n,), db_dtype))
    outs = _check_outs(out, ("dx", "dw", "db"), specs, dev)
    m = math.prod(lead)

    cupy = _cupy()
    with _OnDevice(dev):
        x2, xs = _rows(x)
        dy2, gs = _rows(dy)
        mean2 = cupy.ascontiguousarray(mean)
        rstd2 = cupy.ascontiguousarray(rstd)
        w2 = _aligned_vector(w)
        if outs is None and m:
            dx_bytes = _round_up(m * n * x.itemsize)
            dw_bytes = _round_up(n * wdt.itemsize)
            offsets = (dx_bytes, dx_bytes + dw_bytes, dx_bytes + dw_bytes + n * db_dtype.itemsize)
            dtype_args = tuple(_dtype_arg(d) for d in (x.dtype, wdt, db_dtype))
            call = _Call(
                dev, m, n, x.shape, lead, x.dtype, acc, xs, gs, wdt, db_dtype, offsets, dtype_args
            )  # fmt: skip
            in_place = x2 is x and dy2 is dy and mean2 is mean and rstd2 is rstd and w2 is w
            if in_place and bias_dtype is None and len(_backward_calls) < _MAX_CALLS:
                _backward_calls[_backward_key(dy, x, w, mean, rstd)] = call
            return _backward_launch_call(call, dy2, x2, w2, mean2, rstd2)
        dx, dw, db = outs if outs is not None else (None, None, None)
        dx = cupy.empty(x.shape, x.dtype) if dx is None else dx
        dw = None if w is None else (cupy.empty(n, wdt) if dw is None else dw)
        db = cupy.empty(n, db_dtype) if db is None else db
        if m == 0:
            if dw is not None:
                dw.fill(0)
            db.fill(0)
            return dx, dw, db
        launch_backward(dev, m, n, dy2.data.ptr, gs, x2.data.ptr, xs, x.dtype, _ptr(w2), wdt,
                        mean2.data.ptr, rstd2.data.ptr, dx.data.ptr, _ptr(dw), db.data.ptr,
                        db_dtype, pool_workspace)  # fmt: skip
    return dx, dw, db
