"""Array API: validation, flattening to rows, allocation and launch on CuPy arrays.

Every check runs before anything is allocated or launched, so a call that raises has written
nothing. Kernels run on the device that holds ``x`` and on that device's current CuPy stream.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import NamedTuple

import numpy

from . import _compile, _launch
from ._dtypes import SUPPORTED_NAMES, TABLE, acc_dtype

_NULL = numpy.uint64(0)  # a null pointer kernel argument
_MAX_N = 2**31 - 2**16  # columns are int32 in the kernels, with room for one block stride


# ------------------------------------------------------------------------ validation
def _cupy():
    import cupy

    return cupy


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
    if isinstance(eps, bool) or not isinstance(eps, (int, float, numpy.integer, numpy.floating)):
        raise TypeError(f"eps must be a real number; got {type(eps).__name__}")
    eps = float(eps)
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"eps must be finite and >= 0; got {eps}")
    return eps


def _check_x(x, name: str = "x") -> int:
    _check_array(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension (..., N); got a 0-d array")
    n = x.shape[-1]
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
def _rows(a):
    """(array, row stride in elements) such that row i of the (M, N) view starts at
    a.data.ptr + i * stride elements with unit column stride; copies layouts that cannot."""
    n = a.shape[-1]
    e = a.itemsize
    ok = n == 1 or a.strides[-1] == e
    lead = [(d, s) for d, s in zip(a.shape[:-1], a.strides[:-1]) if d != 1]
    stride = n * e
    if lead:
        stride = lead[-1][1]
        ok = ok and stride >= 0 and stride % e == 0
        ok = ok and all(s0 == s1 * d1 for (_, s0), (d1, s1) in zip(lead, lead[1:]))
    if not ok:
        a = _cupy().ascontiguousarray(a)
        stride = n * e
    return a, stride // e


def _aligned_vector(a):
    """w/b are loaded as packs of up to 64 bytes: give them a fresh allocation if needed."""
    if a is None or a.data.ptr % 64 == 0:
        return a
    return a.copy()


# ------------------------------------------------------------------------ device, kernels
class _Device(NamedTuple):
    sm_count: int
    smem_optin: int


@cache
def _device(device_id: int) -> _Device:
    attrs = _cupy().cuda.Device(device_id).attributes
    return _Device(attrs["MultiProcessorCount"], attrs["MaxSharedMemoryPerBlockOptin"])


def _capacity(kernel, block: int, smem: int, device_id: int) -> int:
    """Resident blocks of ``kernel`` on the whole device (the persistent grid's size)."""
    from cupy_backends.cuda.api import driver

    per_sm = driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, block, smem)
    return max(1, per_sm) * _device(device_id).sm_count


def _get(plan_source: str, expr: str, device_id: int, smem: int):
    """Kernels that stage rows in shared memory get the device's opt-in limit."""
    limit = _device(device_id).smem_optin if smem else 0
    return _compile.kernel(plan_source, expr, device_id, limit)


@lru_cache(maxsize=4096)
def _forward_launch(device_id, n, x_dtype, w_dtype, b_dtype, vec):
    plan = _launch.forward_plan(n, x_dtype, w_dtype, b_dtype, vec, _device(device_id).smem_optin)
    k = _get(plan.source, plan.expr, device_id, plan.smem)
    return k, plan, _capacity(k, plan.block, plan.smem, device_id)


@lru_cache(maxsize=4096)
def _backward_launch(device_id, n, x_dtype, w_dtype, db_dtype, vec):
    plan = _launch.backward_plan(n, x_dtype, w_dtype, vec, _device(device_id).smem_optin)
    k = _get(plan.source, plan.expr, device_id, plan.smem)
    red = _get(_compile.BWD_SOURCE, _launch.reduce_expr(x_dtype, w_dtype, db_dtype), device_id, 0)
    cols = None
    if plan.tier == "row":
        cols = _get(_compile.BWD_SOURCE, _launch.dwdb_cols_expr(x_dtype), device_id, 0)
    return k, plan, _capacity(k, plan.block, plan.smem, device_id), red, cols


class _OnDevice:
    """Makes ``device_id`` current for the block when it is not already (cheap when it is)."""

    __slots__ = ("_ctx",)

    def __init__(self, device_id: int):
        cupy = _cupy()
        self._ctx = None
        if cupy.cuda.runtime.getDevice() != device_id:
            self._ctx = cupy.cuda.Device(device_id)

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def describe(x, w=None, b=None) -> dict:
    """Which kernels ``forward(x, w, b)`` and ``backward`` run for these arrays, with their
    launch shape, registers per thread and resident blocks on the device (for benchmarks)."""
    n, dev = x.shape[-1], x.data.device_id
    x2, stride = _rows(x)
    vec = _launch.vector_width(x.itemsize, n, (stride,), (x2.data.ptr,))
    wdt = x.dtype if w is None else w.dtype
    bdt = x.dtype if b is None else b.dtype
    out = {}
    with _OnDevice(dev):
        for name, (k, plan, cap) in (
            ("forward", _forward_launch(dev, n, x.dtype, wdt, bdt, vec)),
            ("backward", _backward_launch(dev, n, x.dtype, wdt, wdt, vec)[:3]),
        ):
            out[name] = (
                f"{plan.tier} vec={plan.vec} items={plan.items} tpr={plan.tpr} "
                f"block={plan.block} smem={plan.smem} regs={k.num_regs} resident={cap}"
            )
    return out


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
        (float64 for float64 x), rstd = 1 / sqrt(var + eps).
    """
    n = _check_x(x)
    dev = x.data.device_id
    _check_vector(w, "w", n, dev)
    _check_vector(b, "b", n, dev)
    eps = _check_eps(eps)
    acc = acc_dtype(x.dtype)
    lead = x.shape[:-1]
    specs = ((x.shape, x.dtype), (lead, acc), (lead, acc))
    outs = _check_outs(out, ("y", "mean", "rstd"), specs, dev)

    cupy = _cupy()
    with _OnDevice(dev):
        y, mean, rstd = outs if outs is not None else (None, None, None)
        y = cupy.empty(x.shape, x.dtype) if y is None else y
        mean = cupy.empty(lead, acc) if mean is None else mean
        rstd = cupy.empty(lead, acc) if rstd is None else rstd
        m = y.size // n
        if m == 0:
            return y, mean, rstd
        x2, stride = _rows(x)
        w, b = _aligned_vector(w), _aligned_vector(b)
        vec = _launch.vector_width(x.itemsize, n, (stride,), (x2.data.ptr, y.data.ptr))
        wdt = x.dtype if w is None else w.dtype
        bdt = x.dtype if b is None else b.dtype
        k, plan, cap = _forward_launch(dev, n, x.dtype, wdt, bdt, vec)
        grid = _launch.grid_size(m, plan.rows, cap)
        args = (
            x2, numpy.int64(stride), y,
            _NULL if w is None else w, _NULL if b is None else b,
            mean, rstd, numpy.int64(m), numpy.int32(n), acc.type(eps),
        )  # fmt: skip
        k((grid,), (plan.block,), args, shared_mem=plan.smem)
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
        computed deterministically (the same inputs give bitwise-identical results).
    """
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

    cupy = _cupy()
    with _OnDevice(dev):
        dx, dw, db = outs if outs is not None else (None, None, None)
        dx = cupy.empty(x.shape, x.dtype) if dx is None else dx
        dw = None if w is None else (cupy.empty(n, wdt) if dw is None else dw)
        db = cupy.empty(n, db_dtype) if db is None else db
        m = dx.size // n
        if m == 0:
            if dw is not None:
                dw.fill(0)
            db.fill(0)
            return dx, dw, db
        x2, xs = _rows(x)
        dy2, gs = _rows(dy)
        mean = cupy.ascontiguousarray(mean)
        rstd = cupy.ascontiguousarray(rstd)
        w = _aligned_vector(w)
        vec = _launch.vector_width(
            x.itemsize, n, (xs, gs), (x2.data.ptr, dy2.data.ptr, dx.data.ptr)
        )
        k, plan, cap, red, cols = _backward_launch(dev, n, x.dtype, wdt, db_dtype, vec)
        wp = _NULL if w is None else w
        if plan.tier == "reg":
            g = _launch.grid_size(m, plan.rows, cap)
            part = cupy.empty((2, g, n), acc)
            dw_part = _NULL if w is None else part[0]
            k((g,), (plan.block,),
              (dy2, numpy.int64(gs), x2, numpy.int64(xs), wp, mean, rstd, dx,
               dw_part, part[1], numpy.int64(m), numpy.int32(n)))  # fmt: skip
        else:
            grid = _launch.grid_size(m, 1, cap)
            k((grid,), (plan.block,),
              (dy2, numpy.int64(gs), x2, numpy.int64(xs), wp, mean, rstd, dx,
               numpy.int64(m), numpy.int32(n)), shared_mem=plan.smem)  # fmt: skip
            g, per = _launch.dwdb_slices(m, n, _device(dev).sm_count)
            part = cupy.empty((2, g, n), acc)
            dw_part = _NULL if w is None else part[0]
            cols((-(-n // 32), g), _launch.REDUCE_BLOCK,
                 (dy2, numpy.int64(gs), x2, numpy.int64(xs), mean, rstd, dw_part, part[1],
                  numpy.int64(m), numpy.int32(n), numpy.int64(per)))  # fmt: skip
        red((-(-n // 32),), _launch.REDUCE_BLOCK,
            (dw_part, part[1], numpy.int32(g), numpy.int32(n), _NULL if dw is None else dw,
             db))  # fmt: skip
    return dx, dw, db
