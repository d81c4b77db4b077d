"""Array API: every dense norm on CuPy arrays — LayerNorm (``forward``/``backward``) and
RMSNorm (``rms_forward``/``rms_backward``), either with a residual add in front and any
``weight_offset`` — through one checked path a direction.

Every check runs before anything is allocated or launched, so a call that raises has written
nothing. Kernels run on the device that holds ``x``, on that device's current CuPy stream.
``weight_offset`` is applied on the host side of the launch: the kernels read the scale
``w + weight_offset``, formed once per call in the arithmetic type (as a kernel would form it),
and dw, which does not depend on the scale, is cast back to w's dtype.

The hot path: a plain call (no residual, no offset, no ``out``) whose arrays have the shapes,
strides, dtypes and device of an earlier valid call reuses that call's checks and launch (a
dictionary lookup on those attributes), allocates its outputs with one pool allocation and
launches through the driver with a packed argument buffer (``_launcher``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy

from . import _checks, _formats, _launcher, _runtime
from ._dtypes import BYTES, acc_dtype
from ._launcher.cache import table
from ._layout import aligned_vector, ptr, round_up, rows
from ._problem import Problem

if TYPE_CHECKING:
    from cupy import ndarray

# cached plain calls on CuPy arrays (_Call), [LayerNorm, RMSNorm] a direction
_forward_calls = (table(), table())
_backward_calls = (table(), table())
_MAX_CALLS = 4096  # distinct attribute sets remembered; past that, new ones are not cached


# ------------------------------------------------------------------------------ cached calls
class _Call(NamedTuple):
    """What a valid call found for one set of array attributes (see the module docstring)."""

    dev: int
    problem: Problem
    shape: tuple  # of y / dx
    lead: tuple  # of mean, rstd
    offsets: tuple  # byte offsets of the outputs after the first in their allocation, its size
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
    if w is None or mean is None:
        return (_akey(dy), _akey(x), _vkey(w), _vkey(mean), _akey(rstd))
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


def _zero(offset) -> bool:
    """A weight_offset of 0 (the plain call), told without comparing other types."""
    return (type(offset) is float or type(offset) is int) and offset == 0


def _pieces(specs) -> tuple:
    """Byte offsets of the outputs of ``specs`` ((shape, dtype) each) after the first in one
    allocation, then its size."""
    sizes = [round_up(math.prod(s) * numpy.dtype(d).itemsize) for s, d in specs]
    return tuple(sum(sizes[: i + 1]) for i in range(len(sizes)))


def _allocate(specs, outs):
    """The outputs of ``specs``: ``outs``' entries where given, the rest new. Without ``outs``,
    one allocation holds them all; returns (arrays, _pieces or None where ``outs`` came or
    nothing has elements)."""
    cupy = _runtime.cupy()
    if outs is not None or not math.prod(specs[0][0]):
        got = outs if outs is not None else (None,) * len(specs)
        return [cupy.empty(s, d) if a is None else a for a, (s, d) in zip(got, specs)], None
    offsets = _pieces(specs)
    mem = _runtime.allocate(offsets[-1])
    starts = (0,) + offsets[:-1]
    made = [cupy.ndarray(s, d, mem + o if o else mem) for (s, d), o in zip(specs, starts)]
    return made, offsets


def _scale(w, offset: float, acc):
    """The array the kernels read as w (None without one): ``w + offset`` in the arithmetic
    type where an offset (checked) is given."""
    if w is None or not offset:
        return aligned_vector(w)
    return w.astype(acc) + acc.type(offset)


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
    out_dtype=None,
    out: tuple | None = None,
    quant: str | None = None,
    **quant_options,
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
        out_dtype: y's dtype, of x's precision (default x's): float32 rows in, bfloat16 y out
            for the next GEMM, in the same pass.
        out: optional (y, mean, rstd) preallocated outputs (C-contiguous; entries may be None),
            sharing no memory with the inputs, but y may be x itself (in place).
        quant: y quantized in the same pass for the next low-precision GEMM: "fp8" (the
            static ``scale=``, optional 0-d float32 ``amax=`` overwritten with max|y|),
            "fp8_row" (``scale_ub=``), "fp8_block" (``block=`` 128 or 64, ``pow2_scale=``),
            "mxfp8", "nvfp4" (``global_amax=``); ``fp8_dtype=`` "e4m3" or "e5m2",
            ``scale_layout=`` "rows" or "cublas" (docs/guide.md has the rules and layouts).

    Returns:
        (y, mean, rstd): y of x's shape and dtype (or ``out_dtype``); mean and rstd of shape
        x.shape[:-1], float32 (float64 for float64 x), rstd = 1 / sqrt(var + eps). Without
        ``out``, the three share one allocation. With a residual: (y, mean, rstd, h). With
        ``quant``, y is a ``cupyln.Quantized(data, scale)``.
    """
    plain = residual is None and residual_dtype is None and out is None and out_dtype is None
    if plain and quant is None and not quant_options and _zero(weight_offset):
        got = _forward_cached(False, x, w, b, eps)
        if got is not None:
            return got
    return _forward_checked(
        x,
        w,
        b,
        eps,
        rms=False,
        residual=residual,
        residual_dtype=residual_dtype,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
        out=out,
        quant=quant,
        quant_options=quant_options,
    )


def rms_forward(
    x: ndarray,
    w: ndarray | None = None,
    eps: float = 1e-6,
    *,
    residual: ndarray | None = None,
    residual_dtype=None,
    weight_offset: float = 0.0,
    out_dtype=None,
    out: tuple | None = None,
    quant: str | None = None,
    **quant_options,
) -> tuple:
    """RMSNorm over the last dimension of ``x``: y = x * rstd * (w + weight_offset), rstd =
    1 / sqrt(mean(x^2) + eps) in float32 (float64 for float64 x).

    Args: as ``cupyln.forward`` (no bias); ``out``: optional (y, rstd).

    Returns:
        (y, rstd); with a ``residual``, (y, rstd, h): h = x + residual, added in float32 and
        stored in ``residual_dtype`` (default residual's dtype), is what is normalized. With
        ``quant``, y is a ``cupyln.Quantized(data, scale)``.
    """
    plain = residual is None and residual_dtype is None and out is None and out_dtype is None
    if plain and quant is None and not quant_options and _zero(weight_offset):
        got = _forward_cached(True, x, w, None, eps)
        if got is not None:
            return got
    return _forward_checked(
        x,
        w,
        None,
        eps,
        rms=True,
        residual=residual,
        residual_dtype=residual_dtype,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
        out=out,
        quant=quant,
        quant_options=quant_options,
    )


def _forward_cached(rms: bool, x, w, b, eps):
    """The outputs of a plain forward through the cached call of these arrays' attributes, or
    None where there is none (or the pointers' alignment or the device differ)."""
    try:
        call = _forward_calls[rms].get(_forward_key(x, w, b))
    except AttributeError:  # not arrays: the checks say what came
        return None
    if call is None:
        return None
    eps = _checks.eps(eps)
    cuda = _runtime.loaded[1]  # loaded by the call that was cached
    x_ptr = x.data.ptr
    w_ptr = 0 if w is None else w.data.ptr
    b_ptr = 0 if b is None else b.data.ptr
    if (w_ptr | b_ptr) & 63 or x_ptr & call.x_align or cuda.device() != call.dev:
        return None
    if not cuda.context():
        return None
    *stats, size = call.offsets
    mem = cuda.alloc(size)
    y_ptr = mem.ptr
    p = call.problem
    mean_ptr = 0 if rms else y_ptr + stats[0]
    call.launch(call.grid, call.block, call.smem, cuda.stream().ptr, x_ptr, p.x_stride, y_ptr,
                w_ptr, b_ptr, mean_ptr, y_ptr + stats[-1], p.m, p.n, eps, 0, 0, 0, 0, 0, 0,
                0.0)  # fmt: skip
    nd, (y_dtype, stat_dtype) = cuda.ndarray, call.dtype_args
    y = nd(call.shape, y_dtype, mem)
    if rms:
        return y, nd(call.lead, stat_dtype, mem + stats[0])
    return y, nd(call.lead, stat_dtype, mem + stats[0]), nd(call.lead, stat_dtype, mem + stats[1])


def _quant_checked(quant, options: dict, n: int, dev: int, out, out_dtype):
    """(spec, (input pointer, amax array or None, value), the scalar operand as given) of a
    call's quant= and its keywords, checked before anything is allocated; (None, None, None)
    without quant=."""
    if quant is None:
        if options:
            raise TypeError(f"{next(iter(options))}= needs quant= (a format name)")
        return None, None, None
    spec, operands = _formats.checked(quant, options, n, out_dtype)
    if out is not None:
        raise ValueError("out= does not take a quantized y: quant= allocates its outputs")
    cupy = _runtime.cupy()

    def is_array(a):
        return isinstance(a, cupy.ndarray)

    name, given, value = _formats.scalar_operand(spec, operands, is_array, "array")
    amax = operands.get("amax")
    if amax is not None:
        _formats.zero_d(amax, "amax", "cupy.ndarray", is_array, TypeError)
    for a, what in ((given, name), (amax, "amax")):
        if a is not None and a.data.device_id != dev:
            raise ValueError(f"{what} must be on x's device cuda:{dev}; got "
                             f"cuda:{a.data.device_id}")  # fmt: skip
    value = _formats.launch_value(spec, value)
    return spec, (0 if given is None else given.data.ptr, amax, value), operands.get(name)


def _forward_checked(x, w, b, eps, *, rms, residual, residual_dtype, weight_offset, out_dtype,
                     out, quant=None, quant_options=None):  # fmt: skip
    """Every dense forward after its checks: the outputs (y, mean, rstd) or (y, rstd), h
    appended with a residual; y a Quantized(data, scale) with ``quant``."""
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.vector_array(w, "w", n, dev)
    _checks.vector_array(b, "b", n, dev)
    eps = _checks.eps(eps)
    offset = _checks.weight_offset(weight_offset, w is not None)
    qspec, qops, given = _quant_checked(quant, quant_options or {}, n, dev, out, out_dtype)
    y_dtype = _checks.out_dtype(out_dtype, x.dtype) if qspec is None else BYTES
    acc = acc_dtype(x.dtype)
    h_dtype = None
    if residual is not None:
        _checks.array(residual, "residual", dev)
        h_dtype = _checks.residual(residual.shape, residual.dtype, residual_dtype, x.shape, x.dtype)
    elif residual_dtype is not None:
        raise ValueError("residual_dtype needs a residual; got residual=None")
    lead = x.shape[:-1]
    names = ("y", "rstd") if rms else ("y", "mean", "rstd")
    y_spec = (x.shape, y_dtype or x.dtype)
    scale_spec = None
    if qspec is not None:
        y_spec, scale_spec = _formats.outputs(qspec, x.shape)
    specs = (y_spec,) + ((lead, acc),) * (len(names) - 1)
    inputs = (("x", x), ("w", w), ("b", b), ("residual", residual))
    outs = _checks.outputs(out, names, specs, dev, inputs, ("y", "x"))
    m = math.prod(lead)
    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        scale = _scale(w, offset, acc)
        b2 = aligned_vector(b)
        x2, stride = rows(x)
        made, offsets = _allocate(specs, outs)
        y, stats = made[0], made[1:]
        quant_args = _launcher.NO_QUANT
        if qspec is not None:  # the cuBLAS layout's padding stays zero
            zeros = qspec.scale_layout == "cublas"
            sc = given if scale_spec is None else (cupy.zeros if zeros else cupy.empty)(*scale_spec)
            made[0] = _formats.Quantized(y, sc)
            ptr_in, amax, value = qops
            if amax is not None:
                amax.fill(0)
            quant_args = (0 if scale_spec is None else sc.data.ptr, ptr_in, ptr(amax), value)
        mean, rstd = (None, stats[0]) if rms else stats
        h = r2 = None
        r_stride = 0
        if residual is not None:
            h = cupy.empty(x.shape, h_dtype)
            r2, r_stride = rows(residual)
        if not m:
            return (*made, h) if h is not None else tuple(made)
        p = Problem(m, n, x.dtype, None if scale is None else scale.dtype,
                    None if b2 is None else b2.dtype, rms,
                    None if h is None else (residual.dtype, h_dtype), x_stride=stride,
                    r_stride=r_stride, y_dtype=y_dtype, quant=qspec)  # fmt: skip
        plain = h is None and not offset and y_dtype is None and offsets is not None
        calls = _forward_calls[rms]
        if plain and x2 is x and scale is w and b2 is b and len(calls) < _MAX_CALLS:
            k, grid, block, smem, vec, _ = _launcher.forward_launch_at(dev, p, x.data.ptr & 15)
            calls[_forward_key(x, w, b)] = _Call(
                dev, p, x.shape, lead, offsets, (_dtype_arg(x.dtype), _dtype_arg(acc)), launch=k,
                grid=grid, block=block, smem=smem, x_align=vec * x.itemsize - 1,
            )  # fmt: skip
        ptrs = (x2.data.ptr, y.data.ptr, ptr(scale), ptr(b2), ptr(mean), rstd.data.ptr, ptr(r2),
                ptr(h))  # fmt: skip
        _launcher.launch_forward(dev, p, ptrs, eps, quant=quant_args)
    return (*made, h) if h is not None else tuple(made)


def layer_norm(
    x: ndarray,
    w: ndarray | None = None,
    b: ndarray | None = None,
    eps: float = 1e-5,
    *,
    weight_offset: float = 0.0,
    out_dtype=None,
    quant: str | None = None,
    **quant_options,
) -> ndarray:
    """``forward(x, w, b, eps)[0]``: the normalized array only (a Quantized with ``quant``)."""
    return forward(x, w, b, eps, weight_offset=weight_offset, out_dtype=out_dtype, quant=quant,
                   **quant_options)[0]  # fmt: skip


def rms_norm(
    x: ndarray,
    w: ndarray | None = None,
    eps: float = 1e-6,
    *,
    weight_offset: float = 0.0,
    out_dtype=None,
    quant: str | None = None,
    **quant_options,
) -> ndarray:
    """``rms_forward(x, w, eps)[0]``: the normalized array only (a Quantized with ``quant``)."""
    return rms_forward(x, w, eps, weight_offset=weight_offset, out_dtype=out_dtype, quant=quant,
                       **quant_options)[0]  # fmt: skip


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
    db_dtype=None,
    bias_dtype=None,
    out: tuple | None = None,
) -> tuple[ndarray, ndarray | None, ndarray]:
    """Gradients of LayerNorm given the forward's saved mean and rstd.

    Args:
        dy: gradient of y, x's shape, of x's precision (another dtype of it is converted);
            rows may be strided, as x's.
        x: the forward's input.
        w: the forward's weight, or None (then dw is None).
        mean, rstd: the forward's statistics, shape x.shape[:-1], float32 (float64 for float64 x).
        dh: with a residual add in front (x is then the forward's h), the gradient reaching h
            along the residual stream, added to dx; dx is then the gradient of both x and
            residual, of h's dtype, and dy may have y's dtype where h's differs.
        weight_offset: the forward's (the scale is w + weight_offset).
        db_dtype: dtype of db (default: w's dtype, or x's without w). ``bias_dtype`` is its
            old, deprecated name.
        out: optional (dx, dw, db) preallocated outputs (entries may be None; dw must be None
            without w), sharing no memory with each other or with the inputs.

    Returns:
        (dx, dw, db): dx like x; dw (w's dtype, None without w) and db (column sum of dy),
        computed deterministically (the same inputs give bitwise-identical results). Without
        ``out``, the three share one allocation.
    """
    if bias_dtype is not None:
        db_dtype = _checks.renamed("bias_dtype", bias_dtype, "db_dtype", db_dtype)
    if dh is None and out is None and db_dtype is None and _zero(weight_offset):
        got = _backward_cached(False, dy, x, w, mean, rstd)
        if got is not None:
            return got
    return _backward_checked(
        dy,
        x,
        w,
        mean,
        rstd,
        rms=False,
        dh=dh,
        weight_offset=weight_offset,
        db_dtype=db_dtype,
        out=out,
    )


def rms_backward(
    dy: ndarray,
    x: ndarray,
    w: ndarray | None,
    rstd: ndarray,
    *,
    dh: ndarray | None = None,
    weight_offset: float = 0.0,
    out: tuple | None = None,
) -> tuple:
    """Gradients of RMSNorm given the forward's rstd: (dx, dw), dw None without w, computed
    deterministically. With a residual add in front, ``x`` is the forward's h and ``dh`` the
    gradient reaching h along the residual stream (added to dx, the gradient of both x and
    residual). Args otherwise as ``backward``; ``out``: optional (dx, dw)."""
    if dh is None and out is None and _zero(weight_offset):
        got = _backward_cached(True, dy, x, w, None, rstd)
        if got is not None:
            return got
    return _backward_checked(
        dy, x, w, None, rstd, rms=True, dh=dh, weight_offset=weight_offset, db_dtype=None, out=out
    )


def _backward_cached(rms: bool, dy, x, w, mean, rstd):
    """The gradients of a plain backward through the cached call, or None (as
    _forward_cached)."""
    try:
        call = _backward_calls[rms].get(_backward_key(dy, x, w, mean, rstd))
    except AttributeError:  # not arrays: the checks say what came
        return None
    if call is None:
        return None
    cuda = _runtime.loaded[1]  # loaded by the call that was cached
    if ptr(w) & 63 or cuda.device() != call.dev or not cuda.context():
        return None
    return _backward_launch_call(call, dy, x, w, mean, rstd)


def _backward_launch_call(call, dy, x, w, mean, rstd):
    """Allocate dx, dw, db in one block (the workspace in another) and launch."""
    o_dw, o_db, size = call.offsets
    cuda = _runtime.loaded[1]
    mem = cuda.alloc(size)
    dx_ptr = mem.ptr
    dw_ptr = dx_ptr + o_dw if w is not None else 0
    db_ptr = dx_ptr + o_db if o_db else 0
    ptrs = (dy.data.ptr, x.data.ptr, ptr(w), ptr(mean), rstd.data.ptr, dx_ptr, dw_ptr, db_ptr, 0)
    _launcher.launch_backward(call.dev, call.problem, ptrs, _runtime.pool_workspace)
    nd, (dx_dtype, dw_dtype, db_dtype) = cuda.ndarray, call.dtype_args
    n = (call.problem.n,)
    dx = nd(call.shape, dx_dtype, mem)
    dw = None if w is None else nd(n, dw_dtype, mem + o_dw)
    if not o_db:
        return dx, dw
    return dx, dw, nd(n, db_dtype, mem + o_db)


def _backward_checked(dy, x, w, mean, rstd, *, rms, dh, weight_offset, db_dtype, out):
    """Every dense backward after its checks: (dx, dw, db), or (dx, dw) for RMSNorm."""
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.array(dy, "dy", dev)
    acc = acc_dtype(x.dtype)
    _checks.gradient(dy.shape, dy.dtype, "dy", x.shape, x.dtype)
    if dh is not None:
        _checks.array(dh, "dh", dev)
        _checks.like(dh.shape, dh.dtype, "dh", x.shape, x.dtype, "x")
    _checks.vector_array(w, "w", n, dev)
    offset = _checks.weight_offset(weight_offset, w is not None)
    lead = x.shape[:-1]
    stats = (("rstd", rstd),) if rms else (("mean", mean), ("rstd", rstd))
    for name, a in stats:
        _checks.array(a, name, dev)
        _checks.statistics(a.shape, a.dtype, name, lead, acc, x.dtype)
    wdt = x.dtype if w is None else w.dtype
    db_dtype = _checks.dtype_arg(db_dtype, wdt, "db_dtype")
    names = ("dx", "dw") if rms else ("dx", "dw", "db")
    specs = ((x.shape, x.dtype), ((n,), wdt), ((n,), db_dtype))[: len(names)]
    inputs = (("dy", dy), ("x", x), ("w", w), ("dh", dh)) + stats
    outs = _checks.outputs(out, names, specs, dev, inputs)
    if outs is not None and w is None and outs[1] is not None:
        raise ValueError("out's dw must be None without w: there is no dw; got an array")
    m = math.prod(lead)
    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        scale = _scale(w, offset, acc)
        x2, xs = rows(x)
        dy2, gs = rows(dy if dy.dtype == x.dtype else dy.astype(x.dtype))
        dh2, hs = rows(dh) if dh is not None else (None, 0)
        mean2 = None if rms else cupy.ascontiguousarray(mean)
        rstd2 = cupy.ascontiguousarray(rstd)
        kdt = None if scale is None else scale.dtype  # dw's dtype in the kernels
        p = Problem(m, n, x.dtype, kdt, db_dtype, rms, dh=dh is not None, x_stride=xs,
                    dy_stride=gs, dh_stride=hs)  # fmt: skip
        plain = dh is None and not offset and outs is None and m
        if plain:  # one allocation, and the call cached where the arrays are used in place
            if w is None:
                specs = (specs[0], ((0,), wdt)) + specs[2:]
            offsets = _pieces(specs)
            dtype_args = tuple(_dtype_arg(d) for _, d in specs) + (None,) * rms
            if rms:  # (dw, no db, size)
                offsets = (offsets[0], 0, offsets[1])
            call = _Call(dev, p, x.shape, lead, offsets, dtype_args)
            in_place = x2 is x and dy2 is dy and rstd2 is rstd and scale is w
            calls = _backward_calls[rms]
            if in_place and (rms or mean2 is mean) and len(calls) < _MAX_CALLS:
                calls[_backward_key(dy, x, w, mean, rstd)] = call
            return _backward_launch_call(call, dy2, x2, scale, mean2, rstd2)
        got = list(outs) if outs is not None else [None] * len(names)
        dx = cupy.empty(x.shape, x.dtype) if got[0] is None else got[0]
        dw = None
        if w is not None:
            dw = got[1] if got[1] is not None and kdt == wdt else cupy.empty(n, kdt)
        db = None
        if not rms:
            db = cupy.empty(n, db_dtype) if got[2] is None else got[2]
        if m == 0:
            for a in (dw, db):
                if a is not None:
                    a.fill(0)
        else:
            ptrs = (dy2.data.ptr, x2.data.ptr, ptr(scale), ptr(mean2), rstd2.data.ptr, dx.data.ptr,
                    ptr(dw), ptr(db), ptr(dh2))  # fmt: skip
            _launcher.launch_backward(dev, p, ptrs, _runtime.pool_workspace)
        if dw is not None and dw.dtype != wdt:  # the scale's dtype: back to w's
            if got[1] is None:
                dw = dw.astype(wdt)
            else:
                cupy.copyto(got[1], dw, casting="unsafe")
                dw = got[1]
    return (dx, dw) if rms else (dx, dw, db)


def describe(x: ndarray, w: ndarray | None = None, b: ndarray | None = None) -> dict[str, str]:
    """Which kernels ``forward(x, w, b)`` and ``backward`` run for these arrays, with their
    launch shape, registers per thread and resident blocks on the device (for benchmarks)."""
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.vector_array(w, "w", n, dev)
    _checks.vector_array(b, "b", n, dev)
    x2, stride = rows(x)
    m = max(1, math.prod(x.shape[:-1]))  # (an empty x launches nothing; the plans of one row)
    p = Problem(m, n, x.dtype, None if w is None else w.dtype, None if b is None else b.dtype,
                x_stride=stride)  # fmt: skip
    with _runtime.OnDevice(dev):
        return _launcher.describe_kernels(dev, p, x2.data.ptr & 15)
