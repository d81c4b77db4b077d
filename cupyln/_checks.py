"""The argument checks of the CuPy API and of both bridges: each raises a TypeError or
ValueError that names the argument, what was expected and what came, before anything is
allocated or launched. The framework-neutral checks take shapes, dtypes and numbers; the
bridges check that a tensor is theirs and on a GPU, then call these."""

from __future__ import annotations

import math
import warnings

import numpy

from . import _runtime
from ._dtypes import SUPPORTED_NAMES, TABLE

MAX_N = 2**31 - 2**16  # columns are int32 in the kernels, with room for one block's stride


def eps(value) -> float:
    """eps as a float: a finite real number >= 0."""
    if type(value) is float and 0.0 <= value < math.inf:  # the usual case, one test
        return value
    if isinstance(value, bool) or not isinstance(
        value, (int, float, numpy.integer, numpy.floating)
    ):
        raise TypeError(f"eps must be a real number; got {type(value).__name__}")
    value = _finite(value, "eps", " and >= 0")
    if not value >= 0.0:
        raise ValueError(f"eps must be finite and >= 0; got {value}")
    return value


def _finite(value, name: str, also: str = "") -> float:
    """A real number as a finite float: ValueError for an inf, a NaN or an int past float's
    range."""
    try:
        f = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite{also}; got an int past float's range") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite{also}; got {f}")
    return f


def width(shape, name: str) -> int:
    """N of an input of this shape: rows of 1 to MAX_N elements."""
    if len(shape) == 0:
        raise ValueError(f"{name} must have at least one dimension (..., N); got a 0-d array")
    n = shape[-1]
    if not 1 <= n <= MAX_N:
        raise ValueError(f"{name}.shape[-1] (N) must be in [1, {MAX_N}]; got {n}")
    return n


def dtype(dt, name: str) -> None:
    """``dt`` (a NumPy dtype) is one the kernels take."""
    if dt not in TABLE:
        raise TypeError(f"{name} must have dtype {', '.join(SUPPORTED_NAMES)}; got {dt}")


def vector(shape, name: str, n: int) -> None:
    """A weight or bias of shape (N,)."""
    if tuple(shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},); got {tuple(shape)}")


def statistics(shape, dt, name: str, lead: tuple, acc, x_dtype, input_name: str = "x") -> None:
    """mean or rstd as the forward returned them: shape ``lead`` (the input's rows), dtype
    ``acc`` (the arithmetic type of ``x_dtype``; None: any, converted by the caller)."""
    if acc is not None and dt != acc:
        raise TypeError(f"{name} must be {acc.name} for {x_dtype} {input_name}; got {dt}")
    if tuple(shape) != tuple(lead):
        raise ValueError(f"{name} must have shape {input_name}.shape[:-1] = {tuple(lead)}; "
                         f"got {tuple(shape)}")  # fmt: skip


def _same_shape(shape, name: str, ref_shape, ref_name: str) -> None:
    if tuple(shape) != tuple(ref_shape):
        raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref_shape)}; "
                         f"got {tuple(shape)}")  # fmt: skip


def like(shape, dt, name: str, ref_shape, ref_dt, ref_name: str) -> None:
    """A gradient with the shape and dtype of the input it belongs to."""
    _same_shape(shape, name, ref_shape, ref_name)
    if dt != ref_dt:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref_dt}); got {dt}")


def gradient(shape, dt, name: str, ref_shape, ref_dt, ref_name: str = "x") -> None:
    """A gradient with the shape of the input it belongs to, of its precision (another dtype
    of that precision is converted by the caller)."""
    _same_shape(shape, name, ref_shape, ref_name)
    _same_precision(dt, name, ref_dt, ref_name)


def _same_precision(dt, name: str, ref_dt, ref_name: str = "x") -> None:
    """dt is of ref_dt's precision: float64 with float64 only, else any of the others."""
    if TABLE[dt][1] != TABLE[ref_dt][1]:
        raise TypeError(f"{name} must be of {ref_name}'s precision ({ref_dt}: float64 only with "
                        f"float64, else float32, float16 or bfloat16); got {dt}")  # fmt: skip


def weight_offset(value, has_weight: bool = True) -> float:
    """weight_offset as a float: a finite real number, nonzero only with a weight."""
    if isinstance(value, bool) or not isinstance(
        value, (int, float, numpy.integer, numpy.floating)
    ):
        raise TypeError(f"weight_offset must be a real number; got {type(value).__name__}")
    value = _finite(value, "weight_offset")
    if value and not has_weight:
        raise ValueError("weight_offset needs a weight; got weight=None")
    return value


def out_dtype(value, x_dtype) -> numpy.dtype | None:
    """y's dtype where ``out_dtype`` asks for one other than x's (of x's precision), else None."""
    if value is None:
        return None
    dt = dtype_arg(value, x_dtype, "out_dtype")
    _same_precision(dt, "out_dtype", x_dtype)
    return None if dt == x_dtype else dt


def residual(shape, dt, residual_dtype, x_shape, x_dtype) -> numpy.dtype:
    """The residual: x's shape, a dtype of x's precision (float64 with float64 only); returns
    h's dtype, ``residual_dtype`` (of x's precision too) or the residual's."""
    if tuple(shape) != tuple(x_shape):
        raise ValueError(f"residual must have the shape of x {tuple(x_shape)}; got {tuple(shape)}")
    h_dtype = dtype_arg(residual_dtype, dt, "residual_dtype")
    _same_precision(dt, "residual", x_dtype)
    _same_precision(h_dtype, "residual_dtype", x_dtype)
    return h_dtype


def max_seqlen(value) -> int | None:
    """The jagged calls' max_seqlen: None, or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, numpy.integer)):
        raise TypeError(f"max_seqlen must be a positive int or None; got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"max_seqlen must be a positive int or None; got {value}")
    return int(value)


def renamed(old: str, value, new: str, given):
    """A deprecated keyword's value under its new name, with a DeprecationWarning."""
    if given is not None:
        raise TypeError(f"{old} is the old name of {new}; pass {new} alone")
    warnings.warn(f"{old} is deprecated; it is now called {new}", DeprecationWarning, 3)
    return value


def dtype_arg(value, default, name: str) -> numpy.dtype:
    """A dtype argument ``name``: ``value`` if given (one the kernels take), else ``default``."""
    if value is None:
        return default
    try:
        dt = numpy.dtype(value)
    except (TypeError, ValueError):
        dt = value
    try:
        known = dt in TABLE
    except TypeError:  # unhashable
        known = False
    if not known:
        raise TypeError(f"{name} must be one of {', '.join(SUPPORTED_NAMES)}; got {value}")
    return dt


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


# ------------------------------------------------------------------------------ CuPy arrays
def array(a, name: str, device_id: int | None = None) -> None:
    """A CuPy array of a supported dtype (on device ``device_id``)."""
    cupy = _runtime.cupy()
    if not isinstance(a, cupy.ndarray):
        kind = f"{type(a).__module__}.{type(a).__qualname__}"
        raise TypeError(
            f"{name} must be a cupy.ndarray on a GPU; got {kind} (use cupy.asarray for NumPy "
            "data, cupy.from_dlpack for torch/JAX tensors, or cupyln.torch / cupyln.jax)"
        )
    dtype(a.dtype, name)
    if device_id is not None and a.data.device_id != device_id:
        raise ValueError(
            f"{name} must be on the same device as x (cuda:{device_id}); "
            f"got cuda:{a.data.device_id}"
        )


def input_array(x, name: str = "x") -> int:
    """The input: a CuPy array (..., N); returns N."""
    array(x, name)
    return width(x.shape, name)


def vector_array(a, name: str, n: int, device_id: int) -> None:
    """None, or a CuPy vector of shape (N,) on the input's device."""
    if a is not None:
        array(a, name, device_id)
        vector(a.shape, name, n)


def extent(a) -> tuple[int, int]:
    """[first, last) bytes of device memory an array's elements span (empty where it has none)."""
    lo = hi = a.data.ptr
    if a.size == 0:
        return lo, lo
    for d, s in zip(a.shape, a.strides):
        lo, hi = lo + min(0, (d - 1) * s), hi + max(0, (d - 1) * s)
    return lo, hi + a.itemsize


def outputs(out, names, specs, device_id, inputs=(), in_place=None):
    """None, or a tuple of preallocated outputs (entries may be None): each C-contiguous, of
    the (shape, dtype) of its spec, and sharing no memory with another output or with any of
    ``inputs`` ((name, array or None) pairs): some kernels read an input again after writing
    their outputs. ``in_place``: a pair (output, input) of names where the output may be the
    input itself (the same memory, shape and strides: the forward's y written over x, each row
    read whole before its y is written)."""
    if out is None:
        return None
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"out must be a tuple ({', '.join(names)}); got {type(out).__name__}")
    if len(out) != len(names):
        raise ValueError(f"out must be a tuple ({', '.join(names)}) of {len(names)}; "
                         f"got {len(out)} entries")  # fmt: skip
    for a, name, (shape, dt) in zip(out, names, specs):
        if a is None:
            continue
        array(a, name, device_id)
        if a.shape != tuple(shape) or a.dtype != dt:
            raise ValueError(
                f"{name} must be a {numpy.dtype(dt).name} array of shape {tuple(shape)}; "
                f"got {a.dtype} {a.shape}"
            )
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
    given = [(name, a) for name, a in zip(names, out) if a is not None]
    others = given + [(name, a) for name, a in inputs if a is not None]
    for i, (name, a) in enumerate(given):
        lo, hi = extent(a)
        for other, b in others[i + 1 :]:
            blo, bhi = extent(b)
            same = (a.data.ptr, a.shape, a.strides) == (b.data.ptr, b.shape, b.strides)
            if same and (name, other) == in_place:
                continue
            if lo < bhi and blo < hi:
                raise ValueError(f"out's {name} must not overlap {other}: it shares memory "
                                 f"[{max(lo, blo):#x}, {min(hi, bhi):#x})")  # fmt: skip
    return out
