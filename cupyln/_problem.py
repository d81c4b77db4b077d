"""The problem record: one dense norm call as the plans and the launcher see it, built once
by a front end (the CuPy API, the torch and JAX bridges) from its checked arguments.

A ``Problem`` is a NamedTuple: frozen, and hashed as fast as the tuple key the launcher's
caches look it up by, on every call. A new operand is a new field with a default, not a new
argument at every call site.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy

from . import _checks
from ._dtypes import BYTES, acc_dtype


class Problem(NamedTuple):
    """M rows of N of a norm, with the dtypes and row strides of its operands.

    Forward: ``dtype`` is x's, ``b_dtype`` the bias's, ``residual`` the (residual's, h's)
    dtypes of an add in front (h = x + residual is normalized). Backward: ``dtype`` is the
    normalized input's (x, or h with a residual), ``b_dtype`` db's, ``dh`` whether a gradient
    along the residual stream is added to dx. ``w_dtype`` is the scale's dtype as the kernels
    read it (w + weight_offset formed in float32 where an offset is given); None: no weight,
    likewise no bias. ``y_dtype`` is y's where not x's (forward: the Store's), and ``quant`` the
    format y is quantized to (its bytes then y's). Row strides are in elements (N for contiguous
    rows; 0 for an absent operand)."""

    m: int
    n: int
    dtype: numpy.dtype
    w_dtype: numpy.dtype | None = None
    b_dtype: numpy.dtype | None = None
    rms: bool = False
    residual: tuple | None = None  # forward: (residual's dtype, h's dtype)
    dh: bool = False  # backward: dh added to dx
    x_stride: int = 0
    r_stride: int = 0  # forward: the residual's
    dy_stride: int = 0  # backward: dy's
    dh_stride: int = 0  # backward: dh's
    y_dtype: numpy.dtype | None = None  # forward: y's, None: x's (uint8: a quantized y's)
    quant: tuple | None = None  # forward: a quantized y's checked _formats.Spec

    @property
    def tw(self) -> numpy.dtype:
        """The weight's dtype as a kernel template takes it (the input's without a weight)."""
        return self.dtype if self.w_dtype is None else self.w_dtype

    @property
    def tb(self) -> numpy.dtype:
        """The bias's (forward) or db's (backward) dtype as a kernel template takes it."""
        return self.dtype if self.b_dtype is None else self.b_dtype

    @property
    def ty(self) -> numpy.dtype:
        """y's dtype (x's unless ``y_dtype`` says otherwise)."""
        return self.dtype if self.y_dtype is None else self.y_dtype

    @property
    def affine(self) -> tuple[bool, bool]:
        """(weight given, bias given)."""
        return self.w_dtype is not None, self.b_dtype is not None


def for_precompile(n, dtype, *, w_dtype=None, b_dtype=None, db_dtype=None,
                   affine=(True, True), rms=False, residual=None, residual_dtype=None,
                   weight_offset=False, out_dtype=None, quant=None,
                   **quant_options) -> tuple[Problem, numpy.dtype]:  # fmt: skip
    """(the problem, db's dtype) that rows of ``n`` of ``dtype`` pose at any number of rows,
    from ``cupyln.precompile``'s keywords (checked): the dtypes of a call's arguments;
    ``quant`` and its options (``fp8_dtype``, ``block``, ``pow2_scale``, ``scale_layout``):
    a quantized y's format, as the forward's."""
    from . import _formats

    x = _checks.dtype_arg(dtype, None, "dtype")
    if x is None:
        raise TypeError("dtype must be a dtype; got None")
    if isinstance(n, bool) or not isinstance(n, (int, numpy.integer)):
        raise TypeError(f"n must be an int; got {type(n).__name__}")
    if not 1 <= n <= _checks.MAX_N:
        raise ValueError(f"n must be in [1, {_checks.MAX_N}]; got {n}")
    w = _checks.dtype_arg(w_dtype, x, "w_dtype")
    b = _checks.dtype_arg(b_dtype, w, "b_dtype")
    has_w, has_b = bool(affine[0]), bool(affine[1]) and not rms
    db = _checks.dtype_arg(db_dtype, w if has_w else x, "db_dtype")
    if weight_offset and has_w:  # the kernels read w + offset, formed in the arithmetic type
        w = acc_dtype(x)
    res = None
    if residual is not None or residual_dtype is not None:
        r = _checks.dtype_arg(residual, None, "residual")
        h = _checks.dtype_arg(residual_dtype, None, "residual_dtype")
        r = h if r is None else r
        res = (r, _checks.residual((), r, h, (), x))
    y = _checks.out_dtype(out_dtype, x)
    if quant is not None or quant_options:
        if quant is None:
            raise TypeError(f"{next(iter(quant_options))}= needs quant= (a format name)")
        opts, operands = _formats.split_options(quant_options)
        if operands:
            raise TypeError(f"precompile takes no {next(iter(operands))}= (a call's operand)")
        quant = _formats.spec(quant, int(n), **opts)
        if out_dtype is not None:
            raise ValueError("out_dtype does not apply with quant=: the format is y's type")
        y = BYTES
    p = Problem(0, int(n), x, w if has_w else None, b if has_b else None, bool(rms), res,
                y_dtype=y, quant=quant)  # fmt: skip
    return p, db
