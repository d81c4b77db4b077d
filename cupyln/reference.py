"""Float64 reference LayerNorm, for tests, ``python -m cupyln check`` and the benchmarks.

Works on NumPy or CuPy arrays (the result lives where the input does) and computes everything
in float64 from the inputs' exact values, with the textbook two-pass formulas:

    mean = sum(x) / N,  var = sum((x - mean)^2) / N,  rstd = 1 / sqrt(var + eps)
    y  = (x - mean) * rstd * w + b
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  g = dy * w,  xhat = (x - mean) * rstd
    dw = sum_rows(dy * xhat),  db = sum_rows(dy)

``quantize`` is the reference of the quantized outputs (``_formats``): float64 y in each
format, elements rounded once. Also what every check shares: the bfloat16 conversions NumPy
lacks (``to_float64``, ``from_float32``: exact bit manipulations, round to nearest even), the
seeds' input distribution (``sample``) and the one tolerance table (``TOLERANCE``,
``assert_close``).
"""

from __future__ import annotations

import numpy

from ._dtypes import BFLOAT16


def _xp(a):
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return numpy


def to_float64(a):
    """Exact float64 copy of a float16/bfloat16/float32/float64 array (NumPy or CuPy)."""
    xp = _xp(a)
    if BFLOAT16 is not None and a.dtype == BFLOAT16:
        bits = a.view(xp.uint16).astype(xp.uint32) << 16
        return bits.view(xp.float32).astype(xp.float64)
    return a.astype(xp.float64)


def from_float32(a, dtype):
    """``a`` (float32/float64) rounded to nearest even in ``dtype`` (bfloat16 included)."""
    xp = _xp(a)
    dtype = numpy.dtype(dtype)
    if BFLOAT16 is not None and dtype == BFLOAT16:
        a = xp.ascontiguousarray(a, dtype=xp.float32)
        out = xp.empty(a.shape, xp.uint16)
        flat, bits = a.reshape(-1).view(xp.uint32), out.reshape(-1)
        step = 2**26  # in pieces: the uint32 temporaries of a 2**31-element array are 8 GB each
        for i in range(0, flat.size, step):
            u = flat[i : i + step]
            rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
            nan = (u & 0x7FFFFFFF) > 0x7F800000
            bits[i : i + step] = xp.where(nan, (u >> 16) | 0x40, rounded)
        return out.view(dtype)
    return a.astype(dtype)


#: |out - ref| <= atol + rtol * |ref|, by the output's dtype. The reference is exact float64 on
#: the same (already rounded) inputs, so the error is the kernel's float32 arithmetic plus one
#: rounding of the result: half an ulp is 2^-9 relative for bfloat16, 2^-12 for float16, 2^-25
#: for float32; the table leaves a margin of 2-5x over that. Sums over rows (dw, db) scale atol
#: by sqrt(M): their magnitude and rounding error grow with the number of rows.
TOLERANCE = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-4, 1e-4),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1e-2, 1e-2),
}


def assert_close(out, ref, what, atol_scale=1.0, arithmetic="float32"):
    """Raise AssertionError naming ``what`` unless ``out`` matches the float64 ``ref`` within
    the looser of TOLERANCE[out.dtype] and TOLERANCE[arithmetic] (the dtype the kernels compute
    in: float64 output from float32 arithmetic is only float32-accurate), atol times
    ``atol_scale``. NaN must match NaN position for position."""
    xp = _xp(ref)
    atol, rtol = (max(p) for p in zip(TOLERANCE[out.dtype.name], TOLERANCE[arithmetic]))
    o = to_float64(out)
    if _xp(o) is not xp:
        o = xp.asarray(o)
    if o.shape != ref.shape:
        raise AssertionError(f"{what}: shape {o.shape} != reference {ref.shape}")
    nan_o, nan_r = xp.isnan(o), xp.isnan(ref)
    if not bool((nan_o == nan_r).all()):
        raise AssertionError(
            f"{what}: NaN in {int(nan_o.sum())} elements, reference has {int(nan_r.sum())}"
        )
    ok = ~nan_r
    err = xp.where(ok, xp.abs(o - ref), 0.0)
    allow = atol * atol_scale + rtol * xp.abs(xp.where(ok, ref, 0.0))
    bad = err > allow
    if bool(bad.any()):
        i = int(xp.argmax(err / allow))
        raise AssertionError(
            f"{what} ({out.dtype}): {int(bad.sum())} of {o.size} elements off; worst "
            f"|out - ref| = {float(err.ravel()[i]):.3g} at flat index {i} "
            f"(ref {float(ref.ravel()[i]):.6g}, allowed {float(allow.ravel()[i]):.3g})"
        )


def poison_pool(nbytes: int) -> None:
    """Leave a NaN-filled block of ``nbytes`` in CuPy's memory pool, so that the next allocation
    of that size (an output) starts out as NaN rather than as stale results: an element a
    kernel leaves unwritten then fails the comparison."""
    import cupy

    block = cupy.empty(max(nbytes, 1), cupy.uint8)
    block.fill(0xFF)  # NaN in every float format
    del block


def sample(shape, dtype, loc=-2.3, scale=0.5, seed=None, xp=None):
    """``loc + scale * randn`` rounded to ``dtype`` (the seeds' inputs: nonzero mean, no zeros).
    CuPy arrays unless ``xp`` says otherwise."""
    if xp is None:
        import cupy as xp
    dtype = numpy.dtype(dtype)
    wide = xp.float64 if dtype.itemsize == 8 else xp.float32
    a = xp.random.default_rng(seed).standard_normal(shape, dtype=wide)
    a *= scale
    a += loc
    return from_float32(a, dtype)


def forward(x, w=None, b=None, eps=1e-5):
    """(y, mean, rstd) in float64 for x (..., N); w, b optional of shape (N,)."""
    x = to_float64(x)
    mean = x.mean(axis=-1)
    xc = x - mean[..., None]
    var = (xc * xc).mean(axis=-1)
    rstd = 1.0 / _xp(x).sqrt(var + eps)
    y = xc * rstd[..., None]
    if w is not None:
        y = y * to_float64(w)
    if b is not None:
        y = y + to_float64(b)
    return y, mean, rstd


def backward(dy, x, w=None, eps=1e-5, mean=None, rstd=None):
    """(dx, dw, db) in float64; dw is None when w is None.

    Without ``mean``/``rstd`` they are recomputed exactly from x (the true gradient). With them
    (e.g. the float32 statistics a forward saved), the result is the gradient formula evaluated
    at those statistics: what a backward given them must return. The two differ where rows are
    nearly constant: there rstd is large and the rounding of a saved float32 mean is amplified."""
    dy = to_float64(dy)
    if mean is None or rstd is None:
        _, mean, rstd = forward(x, eps=eps)
    else:
        mean, rstd = to_float64(mean), to_float64(rstd)
    x = to_float64(x)
    n = x.shape[-1]
    xhat = (x - mean[..., None]) * rstd[..., None]
    g = dy * to_float64(w) if w is not None else dy
    c1 = (g * xhat).sum(axis=-1, keepdims=True) / n
    c2 = g.sum(axis=-1, keepdims=True) / n
    dx = (g - xhat * c1 - c2) * rstd[..., None]
    rows = tuple(range(x.ndim - 1))
    dw = (dy * xhat).sum(axis=rows) if w is not None else None
    db = dy.sum(axis=rows)
    return dx, dw, db


def rms_forward(x, w=None, eps=1e-6, weight_offset=0.0):
    """(y, rstd) of RMSNorm in float64: rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd *
    (w + weight_offset)."""
    x = to_float64(x)
    rstd = 1.0 / _xp(x).sqrt((x * x).mean(axis=-1) + eps)
    y = x * rstd[..., None]
    if w is not None:
        y = y * (to_float64(w) + weight_offset)
    return y, rstd


def rms_backward(dy, x, w=None, rstd=None, eps=1e-6, weight_offset=0.0, dh=None):
    """(dx, dw) of RMSNorm in float64 (dw None without w), at the given rstd (else exact),
    with dh added to dx."""
    dy, x = to_float64(dy), to_float64(x)
    rstd = rms_forward(x, eps=eps)[1] if rstd is None else to_float64(rstd)
    xhat = x * rstd[..., None]
    g = dy * (to_float64(w) + weight_offset) if w is not None else dy
    c1 = (g * xhat).sum(axis=-1, keepdims=True) / x.shape[-1]
    dx = (g - xhat * c1) * rstd[..., None]
    if dh is not None:
        dx = dx + to_float64(dh)
    rows = tuple(range(x.ndim - 1))
    return dx, (dy * xhat).sum(axis=rows) if w is not None else None


def add(x, residual, dtype):
    """h = x + residual, added exactly and rounded to ``dtype`` (as the kernels store it: the
    float32 sum of two 16-bit or float32 values, rounded once)."""
    h = to_float64(x) + to_float64(residual)
    if numpy.dtype(dtype) != numpy.float64:
        h = h.astype(_xp(h).float32)
    return from_float32(h, dtype)


def _segments(offsets, total, xp):
    """(sequence index of every row, rows per sequence) for jagged offsets [B + 1]."""
    o = xp.asarray(offsets).astype(xp.int64)
    seg = xp.searchsorted(o[1:], xp.arange(total), side="right")
    return seg, o[1:] - o[:-1]


def jagged_forward(values, offsets, w=None, b=None, eps=1e-6):
    """LayerNorm of a jagged batch in float64 (the Helion example's semantics).

    ``values`` [total_L, M], ``offsets`` [B + 1]: sequence i is rows offsets[i]:offsets[i+1],
    normalized over all of its L_i * M elements; ``w``, ``b`` optional [M] (per feature).
    Returns (y [total_L, M], mean [B], rstd [B]); an empty sequence normalizes nothing and
    reports mean 0 and rstd 1 / sqrt(eps) (the statistics of no elements, taken as zero)."""
    xp = _xp(values)
    x = to_float64(values)
    seg, lengths = _segments(offsets, x.shape[0], xp)
    count = xp.maximum(lengths * x.shape[1], 1).astype(xp.float64)
    mean = xp.bincount(seg, weights=x.sum(axis=1), minlength=lengths.size) / count
    xc = x - mean[seg][:, None]
    var = xp.bincount(seg, weights=(xc * xc).sum(axis=1), minlength=lengths.size) / count
    rstd = 1.0 / xp.sqrt(var + eps)
    y = xc * rstd[seg][:, None]
    if w is not None:
        y = y * to_float64(w)
    if b is not None:
        y = y + to_float64(b)
    return y, mean, rstd


def jagged_backward(dy, values, offsets, w=None, eps=1e-6):
    """(dx, dw, db) of ``jagged_forward`` in float64; dw is None when w is None. Each sequence
    is one LayerNorm over its L_i * M elements, so dx uses per-sequence means of g = dy * w and
    of g * xhat; dw and db sum over all rows."""
    xp = _xp(values)
    x = to_float64(values)
    dy = to_float64(dy)
    seg, lengths = _segments(offsets, x.shape[0], xp)
    count = xp.maximum(lengths * x.shape[1], 1).astype(xp.float64)
    _, mean, rstd = jagged_forward(values, offsets, eps=eps)
    xhat = (x - mean[seg][:, None]) * rstd[seg][:, None]
    g = dy * to_float64(w) if w is not None else dy
    n = lengths.size
    c1 = xp.bincount(seg, weights=(g * xhat).sum(axis=1), minlength=n) / count
    c2 = xp.bincount(seg, weights=g.sum(axis=1), minlength=n) / count
    dx = (g - c2[seg][:, None] - xhat * c1[seg][:, None]) * rstd[seg][:, None]
    dw = (dy * xhat).sum(axis=0) if w is not None else None
    return dx, dw, dy.sum(axis=0)


# ------------------------------------------------------------------------ quantized output
def quantize(y, quant, *, scale=None, global_amax=None, **options):
    """(data, scale) of float64 ``y`` (NumPy or CuPy; NumPy results) in the format ``quant``,
    by the rules of ``cupyln._formats`` (``options``: its ``spec`` keywords). Scales come from
    the float32 rounding of max|y| and float32 arithmetic, as the kernels form them; elements
    are ``y`` divided by the stored scale in float64, rounded once to nearest even,
    saturating. ``scale=``: "fp8"'s static scale; ``global_amax=``: "nvfp4"'s."""
    from . import _formats as F

    y = numpy.asarray(y.get() if _xp(y) is not numpy else y, dtype=numpy.float64)
    n = y.shape[-1]
    s = F.spec(quant, n, **options)
    rows = y.reshape(-1, n)
    f32 = numpy.float32
    if s.name == "fp8":
        if scale is None:
            raise ValueError("quant='fp8' needs scale=")
        sc = f32(scale)
        return _cast(y / float(sc), s), numpy.asarray(sc)
    if s.name == "nvfp4":
        if global_amax is None:
            raise ValueError("quant='nvfp4' needs global_amax=")
        g = f32(global_amax)
        big = f32(448.0 * 6.0) / g if g else f32(1.0)
        amax = _amax(rows, s.block)
        sb = numpy.minimum(amax / f32(6.0) * big, f32(448.0)).astype(F.E4M3)  # saturating
        sv = sb.astype(numpy.float64)
        v = _blocked(rows, s.block) * float(big)
        with numpy.errstate(divide="ignore", invalid="ignore"):
            v = numpy.where(sv[..., None] > 0, v / sv[..., None], 0.0)
        codes = _cast(v.reshape(rows.shape), s).view(numpy.uint8)
        data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(numpy.uint8)
        return data.reshape(*y.shape[:-1], n // 2), _layout(sb, y.shape, s)
    amax = _amax(rows, s.block)
    if s.scale_ub is not None:
        amax = numpy.minimum(amax, f32(s.scale_ub))
    if s.name == "mxfp8":
        with numpy.errstate(divide="ignore"):
            exp = _ceil_log2(amax.astype(numpy.float64) / s.max)
        exp = numpy.clip(numpy.where(numpy.isinf(amax), 127, exp), -127, 127)
        sv = numpy.ldexp(1.0, exp)
        byte = numpy.where(amax > 0, exp + F.E8M0_BIAS, 0).astype(numpy.uint8)
    else:
        sc = numpy.maximum(amax, f32(F.MIN_AMAX)) / f32(s.max)
        if s.pow2_scale:
            sc = numpy.ldexp(1.0, _ceil_log2(sc.astype(numpy.float64))).astype(f32)
        sv, byte = sc.astype(numpy.float64), sc
    v = _blocked(rows, s.block) / sv[..., None]
    data = _cast(v.reshape(len(rows), -1)[:, :n], s).reshape(y.shape)  # zero blocks: s = 1
    return data, _layout(byte, y.shape, s)


def _blocked(rows, block):
    """[M, N] rows as [M, blocks, block] (0: the whole row), the last block padded with 0."""
    n = rows.shape[1]
    width = block or n
    return numpy.pad(rows, ((0, 0), (0, -n % width))).reshape(len(rows), -1, width)


def _amax(rows, block):
    """max|y| of each block of ``block`` along the rows (0: the whole row) as float32, the
    last block partial: [M, blocks]."""
    return numpy.abs(_blocked(rows, block)).max(axis=2).astype(numpy.float32)


def _ceil_log2(a):
    """ceil(log2(a)) of positive float64 values, exactly (from their exponents)."""
    mant, exp = numpy.frexp(a)
    return numpy.where(mant == 0.5, exp - 1, exp)


def _cast(v, s):
    """``v`` (float64) to the format's elements: nearest even, saturating at its largest."""
    return numpy.clip(v, -s.max, s.max).astype(s.dtype)


def _layout(scales, shape, s):
    """[M, blocks] scales as the call returns them: [..., blocks] ("rows"), or the 2-D
    128x4-tiled layout ("cublas", padding zero)."""
    if s.scale_layout == "rows":
        return scales.reshape(*shape[:-1], scales.shape[1])
    from . import _formats as F

    m, blocks = scales.shape
    out = numpy.zeros(F.cublas_shape(m, blocks), scales.dtype)
    r, c = numpy.indices((m, blocks))
    out.reshape(-1)[F.cublas_offset(r, c, blocks)] = scales
    return out


def dequantize(data, scale, quant, n: int, *, global_amax=None, **options):
    """float64 values of a quantized y of rows of ``n`` (NumPy, CuPy or torch arrays, in the
    dtypes cupyln returns or as their bytes): elements times their scales ("nvfp4": divided
    by S = 448 * 6 / ``global_amax``); ``options``: ``spec``'s keywords of the call."""
    from . import _formats as F

    s = F.spec(quant, n, **options)
    codes = _host(data).view(numpy.uint8)
    if s.name == "nvfp4":
        pairs = numpy.empty((*codes.shape[:-1], n), numpy.uint8)
        pairs[..., 0::2], pairs[..., 1::2] = codes & 0xF, codes >> 4
        values = pairs.view(F.E2M1).astype(numpy.float64)
    else:
        values = codes.view(s.dtype).astype(numpy.float64)
    rows = values.reshape(-1, n)
    m = len(rows)
    if s.name == "fp8":
        given = scale if isinstance(scale, (int, float)) else _host(scale)
        return values * float(numpy.float32(given))
    sc = _host(scale)
    nb = s.blocks(n)
    if s.scale_layout == "cublas":
        r, c = numpy.indices((m, nb))
        sc = sc.reshape(-1)[F.cublas_offset(r, c, nb)]
    sc = sc.reshape(m, nb)
    if s.name == "mxfp8":
        sv = numpy.ldexp(1.0, sc.view(numpy.uint8).astype(numpy.int32) - F.E8M0_BIAS)
    elif s.name == "nvfp4":
        g = numpy.float32(global_amax)
        big = float(numpy.float32(448.0 * 6.0) / g) if g else 1.0
        sv = sc.view(numpy.uint8).view(F.E4M3).astype(numpy.float64) / big
    else:
        sv = sc.astype(numpy.float64)
    width = s.block or n
    blocked = numpy.pad(rows, ((0, 0), (0, -n % width))).reshape(m, -1, width)
    out = (blocked * sv[..., None]).reshape(m, -1)[:, :n]
    return out.reshape(values.shape)


def _host(a):
    """A NumPy array of ``a``'s values (float32) or bytes (its 1-byte dtypes), on the host."""
    if hasattr(a, "detach"):  # torch
        a = a.detach().cpu()
        if a.element_size() == 1:
            import torch

            a = a.view(torch.uint8)
        return a.numpy()
    return numpy.asarray(a.get() if _xp(a) is not numpy else a)
