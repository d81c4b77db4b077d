"""Array API of the norm family: RMSNorm, the residual add fused in front of either norm, and
``weight_offset``, on CuPy arrays.

The same checks, layouts and launcher as LayerNorm's ``forward``/``backward`` (``_api``); these
calls take the checked path every time (no per-attribute call cache). ``weight_offset`` is
applied on the host side of the launch: the kernels read the scale ``w + weight_offset``,
formed once per call in the arithmetic type (as a kernel would form it), and dw, which does not
depend on the scale, is cast back to w's dtype.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from . import _checks, _launcher, _runtime
from ._api import aligned_vector, ptr, rows
from ._dtypes import acc_dtype

if TYPE_CHECKING:
    from cupy import ndarray


def _scale(w, offset: float, acc):
    """The array the kernels read as w (None without one): ``w + offset`` in the arithmetic
    type where an offset (checked) is given."""
    if w is None or not offset:
        return aligned_vector(w)
    return w.astype(acc) + acc.type(offset)


def norm_forward(x, w, b, eps, rms: bool, residual, residual_dtype, weight_offset, out=None):
    """LayerNorm (``rms`` False: (y, mean, rstd)) or RMSNorm ((y, rstd)) of x, or with a
    ``residual`` of h = x + residual ((..., h) appended)."""
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.vector_array(w, "w", n, dev)
    if not rms:
        _checks.vector_array(b, "b", n, dev)
    eps = _checks.eps(eps)
    weight_offset = _checks.weight_offset(weight_offset, w is not None)
    acc = acc_dtype(x.dtype)
    h_dtype = None
    if residual is not None:
        _checks.array(residual, "residual", dev)
        h_dtype = _checks.residual(residual.shape, residual.dtype, residual_dtype, x.shape, x.dtype)
    elif residual_dtype is not None:
        raise ValueError("residual_dtype needs a residual; got residual=None")
    lead = x.shape[:-1]
    names = ("y", "rstd") if rms else ("y", "mean", "rstd")
    specs = ((x.shape, x.dtype),) + ((lead, acc),) * (len(names) - 1)
    inputs = (("x", x), ("w", w), ("b", None if rms else b), ("residual", residual))
    outs = _checks.outputs(out, names, specs, dev, inputs, ("y", "x"))
    m = math.prod(lead)
    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        scale = _scale(w, weight_offset, acc)
        b2 = None if rms else aligned_vector(b)
        x2, stride = rows(x)
        made = [cupy.empty(s, d) for s, d in specs] if outs is None else [
            cupy.empty(s, d) if a is None else a for a, (s, d) in zip(outs, specs)
        ]  # fmt: skip
        y, stats = made[0], made[1:]
        mean, rstd = (None, stats[0]) if rms else stats
        h = None
        res_ptr = res_stride = 0
        if residual is not None:
            h = cupy.empty(x.shape, h_dtype)
            r2, res_stride = rows(residual)
            res_ptr = r2.data.ptr
        if m:
            wdt = x.dtype if scale is None else scale.dtype
            bdt = x.dtype if b2 is None else b2.dtype
            _launcher.launch_forward(
                dev, m, n, x2.data.ptr, stride, x.dtype, y.data.ptr, ptr(scale), wdt, ptr(b2),
                bdt, ptr(mean), rstd.data.ptr, eps, None, rms, res_ptr, res_stride,
                None if residual is None else residual.dtype, ptr(h), h_dtype,
                _runtime.pool_workspace,
            )  # fmt: skip
    return tuple(made) + (() if h is None else (h,))


def norm_backward(dy, x, w, mean, rstd, dh, weight_offset, bias_dtype=None, out=None,
                  rms: bool = False):  # fmt: skip
    """LayerNorm's (dx, dw, db) or, ``rms``, RMSNorm's (dx, dw) of the forward's input x (h
    with a residual), with ``dh`` (h's shape; None: zero) added to dx."""
    n = _checks.input_array(x)
    dev = x.data.device_id
    _checks.array(dy, "dy", dev)
    _checks.like(dy.shape, x.dtype, "dy", x.shape, x.dtype, "x")  # the shape; dtype converted
    if dh is not None:
        _checks.array(dh, "dh", dev)
        _checks.like(dh.shape, dh.dtype, "dh", x.shape, x.dtype, "x")
    _checks.vector_array(w, "w", n, dev)
    weight_offset = _checks.weight_offset(weight_offset, w is not None)
    acc = acc_dtype(x.dtype)
    if acc_dtype(dy.dtype) != acc:
        raise TypeError(f"dy must be of x's precision ({x.dtype}); got {dy.dtype}")
    lead = x.shape[:-1]
    stats = (("rstd", rstd),) if rms else (("mean", mean), ("rstd", rstd))
    for name, a in stats:
        _checks.array(a, name, dev)
        _checks.statistics(a.shape, a.dtype, name, lead, acc, x.dtype)
    wdt = x.dtype if w is None else w.dtype
    db_dtype = _checks.bias_dtype(bias_dtype, wdt)
    names = ("dx", "dw") if rms else ("dx", "dw", "db")
    specs = ((x.shape, x.dtype), ((n,), wdt), ((n,), db_dtype))[: len(names)]
    inputs = (("dy", dy), ("x", x), ("w", w), ("dh", dh)) + stats
    outs = _checks.outputs(out, names, specs, dev, inputs, ("y", "x"))
    m = math.prod(lead)
    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        scale = _scale(w, weight_offset, acc)
        x2, xs = rows(x)
        dy2, gs = rows(dy if dy.dtype == x.dtype else dy.astype(x.dtype))
        dh2, hs = rows(dh) if dh is not None else (None, 0)
        mean2 = None if rms else cupy.ascontiguousarray(mean)
        rstd2 = cupy.ascontiguousarray(rstd)
        got = list(outs) if outs is not None else [None] * len(names)
        dx = cupy.empty(x.shape, x.dtype) if got[0] is None else got[0]
        dw = None
        if w is not None:
            dw = got[1] if got[1] is not None and scale.dtype == wdt else cupy.empty(n, scale.dtype)
        db = None
        if not rms:
            db = cupy.empty(n, db_dtype) if got[2] is None else got[2]
        if m == 0:
            for a in (dw, db):
                if a is not None:
                    a.fill(0)
        else:
            _launcher.launch_backward(
                dev, m, n, dy2.data.ptr, gs, x2.data.ptr, xs, x.dtype, ptr(scale),
                x.dtype if scale is None else scale.dtype, ptr(mean2), rstd2.data.ptr,
                dx.data.ptr, ptr(dw), ptr(db), db_dtype, _runtime.pool_workspace, None, rms,
                ptr(dh2), hs,
            )  # fmt: skip
        if dw is not None and dw.dtype != wdt:  # the scale's dtype: back to w's
            if got[1] is None:
                dw = dw.astype(wdt)
            else:
                cupy.copyto(got[1], dw, casting="unsafe")
                dw = got[1]
    return (dx, dw) if rms else (dx, dw, db)


# ------------------------------------------------------------------------------ public
def rms_forward(
    x: ndarray,
    w: ndarray | None = None,
    eps: float = 1e-6,
    *,
    residual: ndarray | None = None,
    residual_dtype=None,
    weight_offset: float = 0.0,
    out: tuple | None = None,
) -> tuple:
    """RMSNorm over the last dimension of ``x``: y = x * rstd * (w + weight_offset), rstd =
    1 / sqrt(mean(x^2) + eps) in float32 (float64 for float64 x).

    Args: as ``cupyln.forward`` (no bias); ``out``: optional (y, rstd).

    Returns:
        (y, rstd); with a ``residual``, (y, rstd, h): h = x + residual, added in float32 and
        stored in ``residual_dtype`` (default residual's dtype), is what is normalized.
    """
    return norm_forward(x, w, None, eps, True, residual, residual_dtype, weight_offset, out)


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
    residual)."""
    return norm_backward(dy, x, w, None, rstd, dh, weight_offset, None, out, rms=True)


def rms_norm(
    x: ndarray, w: ndarray | None = None, eps: float = 1e-6, *, weight_offset: float = 0.0
) -> ndarray:
    """``rms_forward(x, w, eps)[0]``: the normalized array only."""
    return rms_forward(x, w, eps, weight_offset=weight_offset)[0]
