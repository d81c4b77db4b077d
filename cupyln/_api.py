"""Array API: LayerNorm forward and backward on CuPy arrays.

Every check runs before anything is allocated or launched, so a call that raises has written
nothing. Kernels run on the device that holds ``x``, on that device's current CuPy stream.

The hot path: a call whose arrays have the shapes, strides, dtypes and device of an earlier
valid call reuses that call's checks and launch (a dictionary lookup on those attributes),
allocates its outputs with one pool allocation and launches through the driver with a packed
argument buffer (``_launcher``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy

from . import _checks, _launcher, _runtime
from ._dtypes import acc_dtype
from ._plans.common import vector_width

if TYPE_CHECKING:
    from cupy import ndarray

_forward_calls: dict = {}  # cached calls of forward / backward on CuPy arrays (_Call)
_backward_calls: dict = {}
_MAX_CALLS = 4096  # distinct attribute sets remembered; past that, new ones are not cached


def forget_plans() -> None:
    """Drop every cached plan, kernel and call (after a plan constant changes: the tests and
    tuning scripts)."""
    _launcher.forget_plans()
    _forward_calls.clear()
    _backward_calls.clear()


def set_plan_constant(name: str, value):
    """Set the tuned constant ``name`` of the plans (cupyln/_plans) to ``value`` and drop every
    cached plan and call, so the next calls plan with it; returns the value it had. For A/B
    runs (scripts/tune.py)."""
    from ._plans import backward, common, forward, jagged

    # every module that binds the name: a constant of common is imported by value elsewhere
    modules = [m for m in (common, forward, backward, jagged, _launcher) if hasattr(m, name)]
    if not name.isupper() or not modules:
        raise KeyError(f"no plan constant {name} in cupyln/_plans")
    old = getattr(modules[0], name)
    for module in modules:
        setattr(module, name, value)
    forget_plans()
    return old


def emulate(profile: str | None) -> None:
    """Plan as on the GPU of ``_plans.devices.PROFILES[profile]`` (None: as on the device in
    use), for the tests and the benchmark; drops every cached plan, kernel and call."""
    _launcher.emulate(profile)
    forget_plans()


def precompile(
    n: int,
    dtype,
    *,
    w_dtype=None,
    b_dtype=None,
    bias_dtype=None,
    affine: tuple = (True, True),
    rms: bool = False,
    residual_dtype=None,
    h_dtype=None,
    backward: bool = True,
    device: int | None = None,
) -> int:
    """Compile ahead every kernel that rows of ``n`` elements of ``dtype`` can take, at any
    number of rows, so that later calls compile nothing: warm up with it before capturing a
    CUDA graph (a capture cannot load a module), whatever M the capture uses.

    Covers contiguous rows at 16-byte aligned addresses (what the allocators return); other
    layouts may need other kernels. Args are the dtypes of a call: ``w_dtype`` (default
    ``dtype``; with a ``weight_offset``, float32: the kernels read w + offset), ``b_dtype``
    (default w's),
    ``bias_dtype`` (db's, default w's), ``affine`` (w given, b given), ``rms`` (RMSNorm),
    ``residual_dtype`` (a residual add in front: the residual's dtype) and ``h_dtype`` (h's,
    default the residual's), ``backward`` (the backward's kernels too), ``device`` (default
    CuPy's current device). Returns the number of kernels, compiled or already there."""
    x = _checks.dtype_arg(dtype, None, "dtype")
    if x is None:
        raise TypeError("dtype must be a dtype; got None")
    if isinstance(n, bool) or not isinstance(n, (int, numpy.integer)):
        raise TypeError(f"n must be an int; got {type(n).__name__}")
    if not 1 <= n <= _checks.MAX_N:
        raise ValueError(f"n must be in [1, {_checks.MAX_N}]; got {n}")
    w = _checks.dtype_arg(w_dtype, x, "w_dtype")
    b = _checks.dtype_arg(b_dtype, w, "b_dtype")
    affine = (bool(affine[0]), bool(affine[1]) and not rms)
    # an absent w or b is recorded in x's dtype, as the calls record it
    w, b = (d if given else x for d, given in zip((w, b), affine))
    db = _checks.dtype_arg(bias_dtype, w, "bias_dtype")
    residual = None
    if residual_dtype is not None:
        r = _checks.dtype_arg(residual_dtype, None, "residual_dtype")
        residual = (r, _checks.residual((), r, h_dtype, (), x))
    elif h_dtype is not None:
        raise ValueError("h_dtype needs a residual_dtype; got residual_dtype=None")
    dev = _runtime.cupy().cuda.runtime.getDevice() if device is None else int(device)
    with _runtime.OnDevice(dev):
        done = _launcher.precompile(dev, int(n), x, w, b, db, affine, bool(rms), residual,
                                    bool(backward))  # fmt: skip
    return len(done)


# ------------------------------------------------------------------------------ layout
def rows(a):
    """(array, row stride in elements) for a CuPy array: rows at one stride are used in place,
    other layouts are copied to C order."""
    e = a.itemsize
    stride = None
    if all(s % e == 0 for s in a.strides):
        stride = _checks.row_stride(a.shape, [s // e for s in a.strides])
    if stride is None:
        a = _runtime.cupy().ascontiguousarray(a)
        stride = a.shape[-1]
    return a, stride


def aligned_vector(a):
    """w/b are read as contiguous packs of up to 64 bytes: a strided or misaligned vector is
    copied to a fresh allocation."""
    if a is None or (a.data.ptr % 64 == 0 and a.flags.c_contiguous):
        return a
    return _runtime.cupy().array(a, copy=True, order="C")


def ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _round_up(nbytes: int, to: int = 256) -> int:
    return -(-nbytes // to) * to


# ------------------------------------------------------------------------------ cached calls
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
    type (a cached lookup in CuPy), others (ml_dtypes' bfloat16) as the dtype."""
    return dtype.type if dtype.type in _SCALAR_TYPES else dtype


def _ndarray(shape, dtype, mem, offset: int):
    return _runtime.cupy().ndarray(shape, dtype, mem + offset if offset else mem)


# ------------------------------------------------------------------------------ forward
def forward(
    x: ndarray,
    w: ndarray | None = None,
    b: ndarray | None = None,
    eps: float = 1e-5,
    *,
    residual: ndarray | None = None,
    residual_dtype=None,
    weight_offset: float = 0.0,
    out: tuple | None = None,
) -> tuple:
    """LayerNorm over the last dimension of ``x``.

    Args:
        x: CuPy array (..., N) of float32, float16, bfloat16 or float64; rows may be strided
            (last dimension contiguous); other layouts are copied.
        w, b: optional CuPy arrays of shape (N,), each of any of those dtypes.
        eps: added to the biased variance; finite and >= 0.
        residual: optional array of x's shape: h = x + residual (added in float32, stored in
            ``residual_dtype``, default residual's dtype) is normalized and returned too.
        weight_offset: the scale is w + weight_offset (Gemma's 1 + w); dw is unchanged by it.
        out: optional (y, mean, rstd) preallocated outputs (C-contiguous; entries may be None),
            sharing no memory with the inputs, but y may be x itself (in place).

    Returns:
        (y, mean, rstd): y of x's shape and dtype; mean and rstd of shape x.shape[:-1], float32
        (float64 for float64 x), rstd = 1 / sqrt(var + eps). Without ``out``, the three share
        one allocation. With a residual: (y, mean, rstd, h).
    """
    if residual is not None or residual_dtype is not None or weight_offset != 0.0:
        from . import _family

        return _family.norm_forward(x, w, b, eps, False, residual, residual_dtype, weight_offset,
                                    out)  # fmt: skip
    if out is None:
        try:
            call = _forward_calls.get(_forward_key(x, w, b))
        except AttributeError:  # not arrays: the checks below say what came
            call = None
        if call is not None:
            eps = _checks.eps(eps)
            cuda = _runtime.loaded[1]  # loaded by the call that was cached
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
                            call.m, call.n, eps, 0, 0, 0)  # fmt: skip
                nd, (y_dtype, stat_dtype) = cuda.ndarray, call.dtype_args
                return (
                    nd(call.shape, y_dtype, mem),
                    nd(call.lead, stat_dtype, mem + o1),
                    nd(call.lead, stat_dtype, mem + o2),
                )
    return _forward_checked(x, w, b, eps, out)


def _forward_checked(x, w, b, eps, out):
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.vector_array(w, "w", n, dev)
    _checks.vector_array(b, "b", n, dev)
    eps = _checks.eps(eps)
    acc = acc_dtype(x.dtype)
    lead = x.shape[:-1]
    specs = ((x.shape, x.dtype), (lead, acc), (lead, acc))
    inputs = (("x", x), ("w", w), ("b", b))
    outs = _checks.outputs(out, ("y", "mean", "rstd"), specs, dev, inputs, ("y", "x"))
    m = math.prod(lead)
    wdt = x.dtype if w is None else w.dtype
    bdt = x.dtype if b is None else b.dtype

    with _runtime.OnDevice(dev):
        x2, stride = rows(x)
        w2, b2 = aligned_vector(w), aligned_vector(b)
        y, mean, rstd = outs if outs is not None else (None, None, None)
        if outs is None and m:
            y_bytes = _round_up(m * n * x.itemsize)
            stat_bytes = _round_up(m * acc.itemsize)
            offsets = (y_bytes, y_bytes + stat_bytes, y_bytes + 2 * stat_bytes)
            mem = _runtime.allocate(offsets[2])
            y = _ndarray(x.shape, x.dtype, mem, 0)
            mean = _ndarray(lead, acc, mem, offsets[0])
            rstd = _ndarray(lead, acc, mem, offsets[1])
            in_place = x2 is x and w2 is w and b2 is b
            if in_place and len(_forward_calls) < _MAX_CALLS:
                affine = (w is not None, b is not None)
                k, grid, block, smem, vec, _ = _launcher.forward_launch_at(
                    dev, m, n, stride, x.dtype, wdt, bdt, affine, x.data.ptr & 15
                )
                _forward_calls[_forward_key(x, w, b)] = _Call(
                    dev, m, n, x.shape, lead, x.dtype, acc, stride, 0, wdt, bdt, offsets,
                    (_dtype_arg(x.dtype), _dtype_arg(acc)), k, grid, block, smem,
                    vec * x.itemsize - 1,
                )  # fmt: skip
        cupy = _runtime.cupy()
        y = cupy.empty(x.shape, x.dtype) if y is None else y
        mean = cupy.empty(lead, acc) if mean is None else mean
        rstd = cupy.empty(lead, acc) if rstd is None else rstd
        if m == 0:
            return y, mean, rstd
        _launcher.launch_forward(dev, m, n, x2.data.ptr, stride, x.dtype, y.data.ptr, ptr(w2),
                                 wdt, ptr(b2), bdt, mean.data.ptr, rstd.data.ptr, eps)  # fmt: skip
    return y, mean, rstd


def layer_norm(
    x: ndarray, w: ndarray | None = None, b: ndarray | None = None, eps: float = 1e-5
) -> ndarray:
    """``forward(x, w, b, eps)[0]``: the normalized array only."""
    return forward(x, w, b, eps)[0]


# ------------------------------------------------------------------------------ backward
def backward(
    dy: ndarray,
    x: ndarray,
    w: ndarray | None,
    mean: ndarray,
    rstd: ndarray,
    *,
    dh: ndarray | None = None,
    weight_offset: float = 0.0,
    bias_dtype=None,
    out: tuple | None = None,
) -> tuple[ndarray, ndarray | None, ndarray]:
    """Gradients of LayerNorm given the forward's saved mean and rstd.

    Args:
        dy: gradient of y, same shape and dtype as x (rows may be strided, as x).
        x: the forward's input.
        w: the forward's weight, or None (then dw is None).
        mean, rstd: the forward's statistics, shape x.shape[:-1], float32 (float64 for float64 x).
        dh: with a residual add in front (x is then the forward's h), the gradient reaching h
            along the residual stream, added to dx; dx is then the gradient of both x and
            residual, of h's dtype, and dy may have y's dtype where h's differs.
        weight_offset: the forward's (the scale is w + weight_offset).
        bias_dtype: dtype of db (default: w's dtype, or x's without w).
        out: optional (dx, dw, db) preallocated outputs (entries may be None), sharing no
            memory with each other or with the inputs.

    Returns:
        (dx, dw, db): dx like x; dw (w's dtype, None without w) and db (column sum of dy),
        computed deterministically (the same inputs give bitwise-identical results). Without
        ``out``, the three share one allocation.
    """
    if dh is not None or weight_offset != 0.0:
        from . import _family

        return _family.norm_backward(dy, x, w, mean, rstd, dh, weight_offset, bias_dtype, out)
    if out is None and bias_dtype is None:
        try:
            call = _backward_calls.get(_backward_key(dy, x, w, mean, rstd))
        except AttributeError:  # not arrays: the checks below say what came
            call = None
        if call is not None:
            cuda = _runtime.loaded[1]  # loaded by the call that was cached
            if not ptr(w) & 63 and cuda.device() == call.dev and cuda.context():
                return _backward_launch_call(call, dy, x, w, mean, rstd)
    return _backward_checked(dy, x, w, mean, rstd, bias_dtype, out)


def _backward_launch_call(call, dy, x, w, mean, rstd):
    """Allocate dx, dw, db in one block (the workspace in another) and launch."""
    o1, o2, size = call.offsets
    cuda = _runtime.loaded[1]
    mem = cuda.alloc(size)
    dx_ptr = mem.ptr
    dw_ptr = dx_ptr + o1 if w is not None else 0
    _launcher.launch_backward(call.dev, call.m, call.n, dy.data.ptr, call.dy_stride, x.data.ptr,
                              call.x_stride, call.dtype, ptr(w), call.w_dtype, mean.data.ptr,
                              rstd.data.ptr, dx_ptr, dw_ptr, dx_ptr + o2, call.b_dtype,
                              _runtime.pool_workspace)  # fmt: skip
    nd, (dx_dtype, dw_dtype, db_dtype) = cuda.ndarray, call.dtype_args
    n = (call.n,)
    return (
        nd(call.shape, dx_dtype, mem),
        None if w is None else nd(n, dw_dtype, mem + o1),
        nd(n, db_dtype, mem + o2),
    )


def _backward_checked(dy, x, w, mean, rstd, bias_dtype, out):
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.array(dy, "dy", dev)
    _checks.like(dy.shape, dy.dtype, "dy", x.shape, x.dtype, "x")
    _checks.vector_array(w, "w", n, dev)
    acc = acc_dtype(x.dtype)
    lead = x.shape[:-1]
    for a, name in ((mean, "mean"), (rstd, "rstd")):
        _checks.array(a, name, dev)
        _checks.statistics(a.shape, a.dtype, name, lead, acc, x.dtype)
    wdt = x.dtype if w is None else w.dtype
    db_dtype = _checks.bias_dtype(bias_dtype, wdt)
    specs = ((x.shape, x.dtype), ((n,), wdt), ((n,), db_dtype))
    inputs = (("dy", dy), ("x", x), ("w", w), ("mean", mean), ("rstd", rstd))
    outs = _checks.outputs(out, ("dx", "dw", "db"), specs, dev, inputs)
    m = math.prod(lead)

    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        x2, xs = rows(x)
        dy2, gs = rows(dy)
        mean2 = cupy.ascontiguousarray(mean)
        rstd2 = cupy.ascontiguousarray(rstd)
        w2 = aligned_vector(w)
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
        _launcher.launch_backward(
            dev, m, n, dy2.data.ptr, gs, x2.data.ptr, xs, x.dtype, ptr(w2), wdt,
            mean2.data.ptr, rstd2.data.ptr, dx.data.ptr, ptr(dw), db.data.ptr, db_dtype,
            _runtime.pool_workspace,
        )  # fmt: skip
    return dx, dw, db


def describe(x: ndarray, w: ndarray | None = None, b: ndarray | None = None) -> dict[str, str]:
    """Which kernels ``forward(x, w, b)`` and ``backward`` run for these arrays, with their
    launch shape, registers per thread and resident blocks on the device (for benchmarks)."""
    n, dev = x.shape[-1], x.data.device_id
    x2, stride = rows(x)
    vec = vector_width(x.itemsize, n, (stride,), (x2.data.ptr,))
    wdt = x.dtype if w is None else w.dtype
    bdt = x.dtype if b is None else b.dtype
    m = max(1, math.prod(x.shape[:-1]))  # (an empty x launches nothing; the plans of one row)
    with _runtime.OnDevice(dev):
        return _launcher.describe_kernels(dev, m, n, x.dtype, wdt, bdt, vec,
                                          (w is not None, b is not None))  # fmt: skip
