"""quant= in the JAX bridge: y quantized in the norm's own pass, forward only (a gradient through
it is refused by name).

On a GPU a ``buffer_callback`` launches the quantizing Store (kernels/policy.cuh); a program on
the CPU computes the same rules with JAX's ops from the float32 y (float64 for float64 rows):
scales from max|y| in float32, elements ``y * (1 / s)`` rounded to nearest even and saturating,
as the kernels form them. Outputs: elements ``float8_e4m3fn`` / ``float8_e5m2`` (NVFP4: uint8
pairs, the first element in the low nibble), scales float32, ``float8_e8m0fnu`` (MXFP8) or
``float8_e4m3fn`` (NVFP4), in the rows or the cuBLAS layout (``_formats``).
"""

from __future__ import annotations

from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy
from jax.experimental.buffer_callback import buffer_callback

from . import _formats, _launcher, _runtime
from ._dtypes import BYTES, acc_dtype
from ._jax_rows import ROWS, WHOLE, by_rows, taken
from ._jax_rows import given as given_of
from ._problem import Problem

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1's magnitudes, by code
E8M0 = getattr(jnp, "float8_e8m0fnu", jnp.uint8)


def dtypes(s) -> tuple:
    """(elements' JAX dtype, scales' JAX dtype) of a checked spec."""
    if s.name == "nvfp4":
        return jnp.uint8, jnp.float8_e4m3fn
    data = jnp.float8_e5m2 if s.dtype == _formats.E5M2 else jnp.float8_e4m3fn
    return data, E8M0 if s.name == "mxfp8" else jnp.float32


# ------------------------------------------------------------------ JAX's ops (the CPU)
def _fp8(v, s):
    return jnp.clip(v, -s.max, s.max).astype(dtypes(s)[0])


def _e2m1_codes(v):
    """e2m1 codes (uint8, sign in bit 3) of float32 v: nearest even, saturating at 6."""
    q = jnp.clip(v, -6.0, 6.0).astype(jnp.float4_e2m1fn).astype(jnp.float32)
    mag = jnp.searchsorted(jnp.asarray(E2M1, jnp.float32), jnp.abs(q)).astype(jnp.uint8)
    return mag | jnp.where(jnp.signbit(q), jnp.uint8(8), jnp.uint8(0))


def _e8m0(amax, top_exp: int):
    """The E8M0 byte of block maxima (float32): 2^ceil(log2(amax / top)) biased, from the bits
    (kernels/quant.cuh e8m0_of)."""
    u = jax.lax.bitcast_convert_type(amax, jnp.uint32)
    e = (u >> 23).astype(jnp.int32) - 127 + 1 - top_exp + ((u & 0x7FFFFF) > 0x600000)
    byte = jnp.clip(e, -127, 127) + 127
    byte = jnp.where(u < 0x00800000, 0, byte)
    byte = jnp.where(u == 0x7F800000, 254, byte)
    return jnp.where(u > 0x7F800000, 255, byte).astype(jnp.uint8)


def quantize_ops(v, s, given):
    """(elements, scales [M, blocks] or None for "fp8") of y rows ``v`` [M, N] by ``s`` with
    JAX's ops; ``given``: fp8's scale or nvfp4's global amax (a float or a 0-d array)."""
    f32 = jnp.float32
    m, n = v.shape
    if s.name == "fp8":
        return _fp8(v.astype(f32) * (f32(1) / jnp.asarray(given, f32)), s), None
    width = s.block or n
    pad = jnp.pad(v, ((0, 0), (0, -n % width))).reshape(m, -1, width)
    amax = jnp.abs(pad).astype(f32).max(axis=-1)
    if s.name == "mxfp8":
        byte = _e8m0(amax, 16 if s.dtype == _formats.E5M2 else 9)
        inv = jax.lax.bitcast_convert_type(
            ((254 - jnp.minimum(byte, 253).astype(jnp.uint32)) << 23), f32
        )
        scaled = pad.astype(f32) * inv[..., None]
        scale = jax.lax.bitcast_convert_type(byte, E8M0) if E8M0 != jnp.uint8 else byte
    elif s.name == "nvfp4":
        g = jnp.asarray(given, f32)
        big = jnp.where(g != 0, f32(2688.0) / jnp.where(g != 0, g, 1), f32(1))
        sb = jnp.clip(amax / f32(6) * big, -448, 448).astype(jnp.float8_e4m3fn)
        sv = sb.astype(f32)
        factor = jnp.where(sv > 0, big / jnp.where(sv > 0, sv, 1), 0)
        scaled = jnp.where(sv[..., None] > 0, pad.astype(f32) * factor[..., None], 0)
        scale = sb
    else:
        a = amax if s.scale_ub is None else jnp.minimum(amax, f32(s.scale_ub))
        sc = jnp.maximum(a, f32(_formats.MIN_AMAX)) / f32(s.max)
        if s.pow2_scale:
            mant, exp = jnp.frexp(sc)
            sc = jnp.ldexp(f32(1), jnp.where(mant == 0.5, exp - 1, exp)).astype(f32)
        scaled = pad.astype(f32) * (f32(1) / sc)[..., None]
        scale = sc
    scaled = scaled.reshape(m, -1)[:, :n]
    if s.name == "nvfp4":
        codes = _e2m1_codes(scaled)
        return codes[:, 0::2] | (codes[:, 1::2] << 4), scale
    return _fp8(scaled, s), scale


def layout(scale, s, m: int):
    """[M, blocks] scales in the call's layout: [M, blocks], or cuBLAS's 128x4 tiles (2-D,
    padding zero)."""
    if scale is None or s.scale_layout == "rows":
        return scale
    blocks = scale.shape[1]
    r, c = numpy.indices((m, blocks))
    at = _formats.cublas_offset(r, c, blocks).reshape(-1)
    byte = scale.dtype.itemsize == 1  # padding of zero bytes (E8M0 has no zero value)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint8) if byte else scale
    flat = jnp.zeros(numpy.prod(_formats.cublas_shape(m, blocks)), bits.dtype)
    out = flat.at[at].set(bits.reshape(-1)).reshape(_formats.cublas_shape(m, blocks))
    return jax.lax.bitcast_convert_type(out, scale.dtype) if byte else out


# ------------------------------------------------------------------ the kernels (a GPU)
def _ptr(buf) -> int:
    return buf.__cuda_array_interface__["data"][0]


@lru_cache(maxsize=1024)
def _call(m, n, x_dtype, r_dtype, h_dtype, w_dtype, b_dtype, eps, rms, s, has_given, value):
    """buffer_callback computing (elements, scales, mean, rstd, h) as bytes and float32, y
    quantized by spec ``s`` (the caller's scalar a (1,) input where ``has_given``)."""
    (dshape, _), sc = _formats.outputs(s, (m, n))
    acc = acc_dtype(x_dtype)
    scale_shape = (0,) if sc is None else sc[0]
    scale_dtype = numpy.float32 if sc is None else sc[1]
    shapes = (
        jax.ShapeDtypeStruct(dshape, BYTES),
        jax.ShapeDtypeStruct(scale_shape, scale_dtype),
        jax.ShapeDtypeStruct((0 if rms else m,), acc),
        jax.ShapeDtypeStruct((m,), acc),
        jax.ShapeDtypeStruct((m, n) if r_dtype is not None else (0,), h_dtype or x_dtype),
    )
    residual = None if r_dtype is None else (r_dtype, h_dtype)
    p = Problem(m, n, x_dtype, w_dtype, b_dtype, rms, residual, x_stride=n,
                r_stride=0 if r_dtype is None else n, y_dtype=BYTES, quant=s)  # fmt: skip
    zeros = s.scale_layout == "cublas"

    def callback(ctx, out, x, *rest):
        data, scale, mean, rstd, h = out
        rest = list(rest)
        r = rest.pop(0) if r_dtype is not None else None
        w = rest.pop(0) if w_dtype is not None else None
        b = rest.pop(0) if b_dtype is not None else None
        given = rest.pop(0) if has_given else None
        x_ptr = _ptr(x)
        dev = _runtime.device_of(x_ptr)
        keep: list = []
        aligned = _runtime.aligned_copy
        with _runtime.OnDevice(dev), _runtime.external_stream(dev, ctx.stream):
            if zeros:  # the cuBLAS layout's padding
                nbytes = int(numpy.prod(scale_shape)) * numpy.dtype(scale_dtype).itemsize
                _runtime.memset(_ptr(scale), nbytes, ctx.stream)
            w_ptr = 0 if w is None else aligned(_ptr(w), n * w_dtype.itemsize, keep)
            b_ptr = 0 if b is None else aligned(_ptr(b), n * b_dtype.itemsize, keep)
            ptrs = (x_ptr, _ptr(data), w_ptr, b_ptr, 0 if rms else _ptr(mean), _ptr(rstd),
                    0 if r is None else _ptr(r), 0 if r is None else _ptr(h))  # fmt: skip
            q = (0 if sc is None else _ptr(scale), 0 if given is None else _ptr(given), 0, value)
            _launcher.launch_forward(dev, p, ptrs, eps, ctx.stream, q)

    return buffer_callback(callback, shapes, vmap_method="sequential")


def _local(static, x2, *rest):
    """The kernels' call on the rows at hand (a device's under a mesh): (elements, scales,
    mean, rstd, h) as bytes and float32."""
    eps, rms, h_dtype, s, value, present = static
    r2, w, b, given = taken(present, rest)
    m, n = x2.shape
    dt = lambda a: None if a is None else numpy.dtype(a.dtype)  # noqa: E731
    call = _call(m, n, dt(x2), dt(r2), h_dtype, dt(w), dt(b), eps, rms, s, given is not None,
                 value)  # fmt: skip
    return call(x2, *rest)


_rows = by_rows(_local)


def quantize_kernels(x2, r2, w, b, given, eps, rms, h_dtype, s, value):
    """(elements, scales in the call's layout, h) by the kernels, as ``quantize_ops``'s;
    ``given``: the scalar operand as a 0-d array (an input of the call), or None and ``value``
    the number given. Under jax.jit on a mesh each device quantizes its own rows (_jax_rows);
    scales in the cuBLAS layout, whose tiles span 128 rows, come from one call over all."""
    g = None if given is None else given.reshape(1)
    rest, present = given_of((r2, w, b, g))
    static = (eps, rms, h_dtype, s, _formats.launch_value(s, value), present)
    if s.scale_layout == "cublas":
        data, scale, _, _, h = _local(static, x2, *rest)
    else:
        kinds_in = (ROWS,) + tuple(k for k, p in zip((ROWS, WHOLE, WHOLE, WHOLE), present) if p)
        kinds_out = (ROWS, WHOLE if s.name == "fp8" else ROWS, WHOLE if rms else ROWS, ROWS,
                     ROWS if r2 is not None else WHOLE)  # fmt: skip
        data, scale, _, _, h = _rows(static, kinds_in, kinds_out, x2, *rest)
    ddt, sdt = dtypes(s)
    if ddt != jnp.uint8:
        data = jax.lax.bitcast_convert_type(data, ddt)
    if sdt not in (jnp.float32, jnp.uint8):  # byte scales in JAX's float8 dtypes
        scale = jax.lax.bitcast_convert_type(scale, sdt)
    return data, None if s.name == "fp8" else scale, h


# ------------------------------------------------------------------ forward only
@partial(jax.custom_vjp, nondiff_argnums=(0,))
def forward_only(fn, *args):
    return fn(*args)


def _fwd(fn, *args):
    return fn(*args), None


def _bwd(fn, res, grads):
    raise ValueError("quant= is forward-only: its elements and scales carry no gradient; "
                     "differentiate the plain norm (without quant=)")  # fmt: skip


forward_only.defvjp(_fwd, _bwd)
