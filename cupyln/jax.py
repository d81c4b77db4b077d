"""JAX bridge: cupyln's kernels on JAX GPU arrays, differentiable, eagerly and under jax.jit
(a program placed on the CPU computes the same function with JAX's own ops).

    import cupyln.jax
    y = cupyln.jax.layer_norm(x, weight, bias, eps)   # over the last dimension
    y = cupyln.jax.rms_norm(x, weight, eps)
    y, h = cupyln.jax.add_rms_norm(x, residual, weight, eps)       # h = x + residual
    y, h = cupyln.jax.add_layer_norm(x, residual, weight, bias, eps)
    jax.jit(jax.grad(loss))(...)                       # dx, dw, db from cupyln's backward

Forward and backward are ``jax.experimental.buffer_callback`` calls (JAX >= 0.6.2) inside a
``jax.custom_vjp``: XLA hands the callback its device buffers and its compute stream, and the
kernels launch there by raw pointer, in order with the work that produced x and the work that
uses y, eagerly and inside jitted programs alike (an eager call is a one-op program, so both
paths are the same code and neither copies nor synchronizes). Under ``jax.vmap`` the call runs
once per batch element (``vmap_method="sequential"``); vmapping over rows of x alone is just a
bigger x.

Under ``jax.jit`` with arrays split over a mesh, each call is partitioned by rows
(``_jax_rows``): every device normalizes its own rows, dw and db are summed across devices;
inside ``jax.shard_map`` the calls take the local rows, typed as JAX's own ops are.

Scratch memory (the backward's dw/db partial sums, and a copy of a weight or bias whose buffer
is not 64-byte aligned) comes from CuPy's memory pool on XLA's stream, so leave CuPy room:
set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or a ``XLA_PYTHON_CLIENT_MEM_FRACTION`` below 1)
before JAX starts, as the tests do.
"""

from __future__ import annotations

import math
from functools import lru_cache, partial

try:
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "cupyln.jax needs JAX >= 0.6.2: pip install 'cupyln[jax-cuda12]' (or "
        "'cupyln[jax-cuda13]'; 'cupyln[jax]' for JAX on the CPU alone)"
    ) from err

import numpy

from . import _checks, _launcher, _runtime
from ._dtypes import acc_dtype
from ._jax_rows import ROWS, SUM, WHOLE, by_rows, devices, psum_wide
from ._jax_rows import given as _given
from ._jax_rows import taken as _taken
from ._problem import Problem

__all__ = ["layer_norm", "rms_norm", "add_rms_norm", "add_layer_norm", "precompile"]


# ------------------------------------------------------------------ inside the callbacks
def _ptr(buf) -> int:
    try:
        return buf.__cuda_array_interface__["data"][0]
    except Exception as err:  # a buffer on another platform: JAX raises its own error type
        raise ValueError(
            "cupyln.jax runs on GPU arrays; this computation was placed on a device whose "
            "buffers have no __cuda_array_interface__ (a CPU device?)"
        ) from err


def _dtype(a) -> numpy.dtype:
    return numpy.dtype(a.dtype)


# ------------------------------------------------------------------ differentiable function
# Inside jax.shard_map, values carry the mesh axes they vary over. A callback's outputs come back
# typed as varying over none, so they are marked varying over every axis an input varies over,
# and a cotangent takes its primal's axes: a weight whole on every device (varying over none)
# gets the sum of the devices' dw, as JAX's own ops give it.
def _vma(a) -> frozenset:
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)  # (newer JAX; earlier: aval.vma)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def _cast(a, axes: frozenset):
    if not axes:
        return a
    pcast = getattr(jax.lax, "pcast", None)
    names = tuple(sorted(axes))
    return pcast(a, names, to="varying") if pcast else jax.lax.pvary(a, names)


def _varying(outs, inputs) -> tuple:
    axes = frozenset().union(*(_vma(a) for a in inputs))
    return tuple(_cast(o, axes - _vma(o)) for o in outs)


def _cotangent(ct, primal):
    extra = tuple(sorted(_vma(ct) - _vma(primal)))
    if extra:
        ct = psum_wide(ct, extra)
    return _cast(ct, _vma(primal) - _vma(ct))


def _summed(given) -> str:
    """dw's or db's kind: summed over the row shards where its w or b was given, else unused."""
    return WHOLE if given is None else SUM


def _check(a, name: str, n: int | None = None):
    if a is None:
        return None
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a JAX array; got {type(a).__name__}")
    _checks.dtype(numpy.dtype(a.dtype), name)
    if n is not None:
        _checks.vector(a.shape, name, n)
    return jnp.asarray(a)


def _held(a):
    """The devices holding array ``a``, or those of the concrete value under an eager grad or
    vmap (run op by op, where a platform-dependent branch would take the default backend's);
    None for a tracer of a traced program."""
    while a is not None:
        held = devices(a)
        if held is not None:
            return held
        inner = getattr(a, "primal", None)  # jax.grad's, jax.jvp's
        a = getattr(a, "val", None) if inner is None else inner  # jax.vmap's
    return None


def _check_devices(named) -> str | None:
    """The platform of the concrete arrays of (array, name) pairs: "gpu" or "cpu", one for all;
    None where all are tracers (under jit XLA places them, and the program's platform picks
    the path)."""
    seen = {}
    for a, name in named:
        held = None if a is None else _held(a)
        if held is None:
            continue
        platforms = {d.platform for d in held}
        if not platforms <= {"gpu", "cpu"} or len(platforms) > 1:
            raise ValueError(f"{name} must be on a GPU or the CPU; got an array on "
                             f"{sorted(platforms)}")  # fmt: skip
        seen.setdefault(platforms.pop(), name)
    if len(seen) > 1:
        raise ValueError(f"{seen['cpu']} is on the CPU and {seen['gpu']} on a GPU; put the "
                         "arrays of a call on one platform")  # fmt: skip
    return next(iter(seen), None)


# ------------------------------------------------------------------ on the CPU
# Kernels run on GPUs; a program placed on the CPU computes the same function with JAX's own
# ops (the kernels' arithmetic: float32, float64 for float64 rows; y rounded once), and JAX
# differentiates it. lax.platform_dependent picks the branch when the program is lowered, so
# a GPU program holds the kernels alone. The tests that compile the kernels' partitioning on
# CPU devices set _KERNELS_ON_CPU.
_KERNELS_ON_CPU = False


def _norm_on_cpu(x2, r2, w, b, eps, rms, h_dtype, y_dtype):
    acc = acc_dtype(_dtype(x2))
    if r2 is None:
        src, h = x2, jnp.zeros((0,), x2.dtype)  # as the kernels' call: no h
    else:
        src = h = (x2.astype(acc) + r2.astype(acc)).astype(h_dtype)
    v = src.astype(acc)
    if rms:
        v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    else:
        d = v - jnp.mean(v, axis=-1, keepdims=True)
        v = d * jax.lax.rsqrt(jnp.mean(d * d, axis=-1, keepdims=True) + eps)
    if w is not None:
        v = v * w.astype(acc)
    if b is not None:
        v = v + b.astype(acc)
    # typed as the kernels' outputs are inside jax.shard_map (varying as the inputs)
    return _varying((v.astype(y_dtype or x2.dtype), h), _given((x2, r2, w, b))[0])


def _by_platform(platform, cpu, kernels, *arrays):
    """``kernels(*arrays)`` on a GPU, ``cpu(*arrays)`` (JAX's ops) on the CPU: chosen here for
    concrete arrays (``platform``), when the program is lowered for tracers (None)."""
    if platform == "gpu" or _KERNELS_ON_CPU:
        return kernels(*arrays)
    if platform == "cpu":
        return cpu(*arrays)
    return jax.lax.platform_dependent(*arrays, cpu=cpu, default=kernels)


def layer_norm(x: jax.Array, weight: jax.Array | None = None, bias: jax.Array | None = None,
               eps: float = 1e-5, *, weight_offset: float = 0.0, out_dtype=None, quant=None,
               **quant_options) -> jax.Array:  # fmt: skip
    """LayerNorm over the last dimension of ``x`` with cupyln's kernels (differentiable).

    Args:
        x: JAX array (..., N) on a GPU (or the CPU: JAX's ops), float32, float16, bfloat16
            (or float64 with x64 on).
        weight, bias: optional arrays of shape (N,), each with its own dtype from that list.
        eps: added to the biased variance; finite and >= 0.
        weight_offset: the scale is weight + weight_offset; dw is unchanged by it.
        out_dtype: y's dtype, of x's precision (default x's): float32 in, bfloat16 out.

        quant: y quantized in the same pass (forward only), as ``rms_norm``'s.

    Returns:
        y of x's shape and dtype (or ``out_dtype``; with ``quant`` a ``cupyln.Quantized``).
        Gradients (``jax.grad``, ``jax.vjp``) come from cupyln's backward: dw/db in the
        weight's/bias's dtype, deterministic.
    """
    if quant is not None or quant_options:
        return _apply_quant(x, None, weight, bias, eps, rms=False, weight_offset=weight_offset,
                            out_dtype=out_dtype, quant=quant, options=quant_options)[0]  # fmt: skip
    return _apply(x, None, weight, bias, eps, rms=False, weight_offset=weight_offset,
                  out_dtype=out_dtype)[0]  # fmt: skip


# ------------------------------------------------------------------ the norms
@lru_cache(maxsize=1024)
def _forward_call(m, n, x_dtype, r_dtype, h_dtype, w_dtype, b_dtype, eps, rms, y_dtype):
    """buffer_callback computing (y, mean, rstd, h) of RMSNorm (``rms``; mean empty) or
    LayerNorm of M rows of N, of h = x + residual where r_dtype is not None (else h empty), y
    of y_dtype (None: x's)."""
    acc = acc_dtype(x_dtype)
    shapes = (
        jax.ShapeDtypeStruct((m, n), y_dtype or x_dtype),
        jax.ShapeDtypeStruct((0 if rms else m,), acc),
        jax.ShapeDtypeStruct((m,), acc),
        jax.ShapeDtypeStruct((m, n) if r_dtype is not None else (0,), h_dtype or x_dtype),
    )
    residual = None if r_dtype is None else (r_dtype, h_dtype)
    p = Problem(m, n, x_dtype, w_dtype, b_dtype, rms, residual, x_stride=n,
                r_stride=0 if r_dtype is None else n, y_dtype=y_dtype)  # fmt: skip

    def callback(ctx, out, x, *rest):
        y, mean, rstd, h = out
        rest = list(rest)
        r = rest.pop(0) if r_dtype is not None else None
        w = rest.pop(0) if w_dtype is not None else None
        b = rest.pop(0) if b_dtype is not None else None
        x_ptr = _ptr(x)
        dev = _runtime.device_of(x_ptr)
        keep: list = []
        aligned = _runtime.aligned_copy
        with _runtime.OnDevice(dev), _runtime.external_stream(dev, ctx.stream):
            w_ptr = 0 if w is None else aligned(_ptr(w), n * w_dtype.itemsize, keep)
            b_ptr = 0 if b is None else aligned(_ptr(b), n * b_dtype.itemsize, keep)
            ptrs = (x_ptr, _ptr(y), w_ptr, b_ptr, 0 if rms else _ptr(mean), _ptr(rstd),
                    0 if r is None else _ptr(r), 0 if r is None else _ptr(h))  # fmt: skip
            _launcher.launch_forward(dev, p, ptrs, eps, ctx.stream)

    return buffer_callback(callback, shapes, vmap_method="sequential")


@lru_cache(maxsize=1024)
def _backward_call(m, n, h_dtype, w_dtype, db_dtype, rms, has_dh):
    """buffer_callback computing (dx, dw, db) of the family's backward at the saved statistics,
    dh added to dx where ``has_dh`` (db empty for RMSNorm)."""
    wdt = w_dtype or h_dtype
    shapes = (
        jax.ShapeDtypeStruct((m, n), h_dtype),
        jax.ShapeDtypeStruct((n,), wdt),
        jax.ShapeDtypeStruct((0 if rms else n,), db_dtype),
    )
    p = Problem(m, n, h_dtype, w_dtype, db_dtype, rms, dh=has_dh, x_stride=n, dy_stride=n,
                dh_stride=n if has_dh else 0)  # fmt: skip

    def callback(ctx, out, dy, h, mean, rstd, *rest):
        dx, dw, db = out
        rest = list(rest)
        dh = rest.pop(0) if has_dh else None
        w = rest.pop(0) if w_dtype is not None else None
        h_ptr = _ptr(h)
        dev = _runtime.device_of(h_ptr)
        keep: list = []
        aligned = _runtime.aligned_copy
        with _runtime.OnDevice(dev), _runtime.external_stream(dev, ctx.stream):
            w_ptr = 0 if w is None else aligned(_ptr(w), n * wdt.itemsize, keep)
            ptrs = (_ptr(dy), h_ptr, w_ptr, 0 if rms else _ptr(mean), _ptr(rstd), _ptr(dx),
                    0 if w is None else _ptr(dw), 0 if rms else _ptr(db),
                    0 if dh is None else _ptr(dh))  # fmt: skip
            _launcher.launch_backward(dev, p, ptrs, _runtime.pool_workspace, ctx.stream)
            del keep

    return buffer_callback(callback, shapes, vmap_method="sequential")


def _forward_local(static, x2, *rest):
    eps, rms, h_dtype, y_dtype, present = static
    r2, w, b = _taken(present, rest)
    m, n = x2.shape
    call = _forward_call(
        m, n, _dtype(x2), None if r2 is None else _dtype(r2), h_dtype,
        None if w is None else _dtype(w), None if b is None else _dtype(b), eps, rms=rms,
        y_dtype=y_dtype,
    )  # fmt: skip
    return call(x2, *rest)


_forward_rows = by_rows(_forward_local)


def _forward(x2, r2, w, b, eps, rms, h_dtype, y_dtype):
    rest, present = _given((r2, w, b))
    kinds_in = (ROWS,) + tuple(k for k, p in zip((ROWS, WHOLE, WHOLE), present) if p)
    kinds_out = (ROWS, WHOLE if rms else ROWS, ROWS, ROWS if present[0] else WHOLE)
    outs = _forward_rows((eps, rms, h_dtype, y_dtype, present), kinds_in, kinds_out, x2, *rest)
    return _varying(outs, (x2, *rest))


def _backward_local(static, dy, src, mean, rstd, *rest):
    db_dtype, rms, present = static
    dh, w = _taken(present, rest)
    m, n = src.shape
    w_dtype = None if w is None else _dtype(w)
    call = _backward_call(m, n, _dtype(src), w_dtype, db_dtype, rms, dh is not None)
    return call(dy, src, mean, rstd, *rest)


_backward_rows = by_rows(_backward_local)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _norm(x2, r2, w, b, eps, rms, h_dtype, y_dtype):
    y, _, _, h = _forward(x2, r2, w, b, eps, rms, h_dtype, y_dtype)
    return y, h


def _norm_fwd(x2, r2, w, b, eps, rms, h_dtype, y_dtype):
    y, mean, rstd, h = _forward(x2, r2, w, b, eps, rms, h_dtype, y_dtype)
    kinds = tuple(None if a is None else a[:0] for a in (x2, r2, b))  # dtypes and mesh axes
    return (y, h), (h if r2 is not None else x2, w, mean, rstd, kinds)


def _norm_bwd(eps, rms, h_dtype, y_dtype, res, grads):
    src, w, mean, rstd, (x_kind, r_kind, b_kind) = res
    dy, dh = grads
    s_dtype = _dtype(src)
    w_dtype = None if w is None else _dtype(w)
    db_dtype = _dtype(b_kind) if b_kind is not None else (w_dtype or s_dtype)
    rest, present = _given((dh.astype(s_dtype) if r_kind is not None else None, w))
    kinds_in = (ROWS, ROWS, WHOLE if rms else ROWS, ROWS) + tuple(
        k for k, p in zip((ROWS, WHOLE), present) if p)  # fmt: skip
    dx, dw, db = _backward_rows((db_dtype, rms, present), kinds_in,
                                       (ROWS, _summed(w), _summed(b_kind)),
                                       dy.astype(s_dtype), src, mean, rstd, *rest)  # fmt: skip
    dx, dw, db = _varying((dx, dw, db), (dy, src, mean, rstd, *rest))
    return (
        _cotangent(dx.astype(x_kind.dtype), x_kind),
        None if r_kind is None else _cotangent(dx.astype(r_kind.dtype), r_kind),
        None if w is None else _cotangent(dw, w),
        None if b_kind is None else _cotangent(db, b_kind),
    )


_norm.defvjp(_norm_fwd, _norm_bwd)


def _operands(x, residual, weight, bias, eps, residual_dtype, weight_offset) -> tuple:
    """(x, N, residual, weight, bias, eps, h's dtype or None, the arrays' platform) of a family
    call, checked; the weight is weight + weight_offset in the arithmetic type where an offset
    is given (dw passes through the add)."""
    x = _check(x, "x")
    n = _checks.width(x.shape, "x")
    weight = _check(weight, "weight", n)
    bias = _check(bias, "bias", n)
    eps = _checks.eps(eps)
    offset = _checks.weight_offset(weight_offset, weight is not None)
    h_dtype = None
    if residual is not None:
        residual = _check(residual, "residual")
        h_dtype = _checks.residual(residual.shape, _dtype(residual), residual_dtype, x.shape,
                                   _dtype(x))  # fmt: skip
    elif residual_dtype is not None:
        raise ValueError("residual_dtype needs a residual; got residual=None")
    if offset:
        weight = weight.astype(acc_dtype(_dtype(x))) + offset
    platform = _check_devices(((x, "x"), (residual, "residual"), (weight, "weight"),
                               (bias, "bias")))  # fmt: skip
    return x, n, residual, weight, bias, eps, h_dtype, platform


def _apply(x, residual, weight, bias, eps, *, rms, residual_dtype=None, weight_offset=0.0,
           out_dtype=None):  # fmt: skip
    """(y, h) of a family member over the last dimension of x (h None without a residual), y
    in ``out_dtype`` (default x's)."""
    x, n, residual, weight, bias, eps, h_dtype, platform = _operands(
        x, residual, weight, bias, eps, residual_dtype, weight_offset
    )
    y_dtype = _checks.out_dtype(out_dtype, _dtype(x))
    m = math.prod(x.shape[:-1])
    if m == 0:
        h = None if residual is None else jnp.zeros(x.shape, h_dtype)
        return jnp.zeros(x.shape, y_dtype or _dtype(x)), h
    r2 = None if residual is None else residual.reshape(m, n)
    static = (eps, rms, h_dtype, y_dtype)
    cpu, kernels = (lambda *a: _norm_on_cpu(*a, *static)), (lambda *a: _norm(*a, *static))
    y, h = _by_platform(platform, cpu, kernels, x.reshape(m, n), r2, weight, bias)
    return y.reshape(x.shape), None if residual is None else h.reshape(x.shape)


def _apply_quant(x, residual, weight, bias, eps, *, rms, residual_dtype=None,
                 weight_offset=0.0, out_dtype=None, quant, options):  # fmt: skip
    """(Quantized(elements, scales), h) of a family member with y quantized (forward only):
    the kernels on a GPU, JAX's ops on the CPU (_jax_quant)."""
    from . import _formats
    from . import _jax_quant as Q

    x = _check(x, "x")
    s, ops = _formats.checked(quant, options, _checks.width(x.shape, "x"), out_dtype)
    if ops.get("amax") is not None:
        raise ValueError("amax= is CuPy's and torch's (an array written in place); JAX arrays "
                         "are immutable: take max|y| from the plain norm")  # fmt: skip
    # a number is the kernels' constant, an array an input of the program
    name, given, value = _formats.scalar_operand(s, ops, lambda a: hasattr(a, "shape"), "array")
    given = None if given is None else _check(given, name)
    x, n, residual, weight, bias, eps, h_dtype, platform = _operands(
        x, residual, weight, bias, eps, residual_dtype, weight_offset
    )
    lead = x.shape[:-1]
    m = math.prod(lead)
    r2 = None if residual is None else residual.reshape(m, n)
    acc = acc_dtype(_dtype(x))

    def ops_path(x2, r2, w, b, g):
        v, h = _norm_on_cpu(x2, r2, w, b, eps, rms, h_dtype, acc)
        data, scale = Q.quantize_ops(v, s, value if g is None else g)
        return data, Q.layout(scale, s, m), h

    def kernels(*arrays):
        return Q.quantize_kernels(*arrays, eps, rms, h_dtype, s, value)

    def fn(*arrays):  # nothing to launch without rows: JAX's ops on any platform
        return ops_path(*arrays) if m == 0 else _by_platform(platform, ops_path, kernels, *arrays)

    data, scale, h = Q.forward_only(fn, x.reshape(m, n), r2, weight, bias, given)
    data = data.reshape(*lead, data.shape[-1])
    if scale is None:
        scale = ops["scale"]
    elif s.scale_layout == "rows":
        scale = scale.reshape(*lead, scale.shape[-1])
    return _formats.Quantized(data, scale), None if residual is None else h.reshape(x.shape)


def rms_norm(x: jax.Array, weight: jax.Array | None = None, eps: float = 1e-6, *,
             weight_offset: float = 0.0, out_dtype=None, quant=None,
             **quant_options) -> jax.Array:  # fmt: skip
    """RMSNorm over the last dimension of ``x`` (y = x * rstd * (weight + weight_offset), rstd =
    1 / sqrt(mean(x^2) + eps) in float32), differentiable, as ``layer_norm``. ``quant``: y
    quantized in the same pass, a ``cupyln.Quantized(data, scale)`` (forward only; the formats
    and keywords of ``cupyln.rms_forward``, but ``amax=``)."""
    if quant is not None or quant_options:
        return _apply_quant(x, None, weight, None, eps, rms=True, weight_offset=weight_offset,
                            out_dtype=out_dtype, quant=quant, options=quant_options)[0]  # fmt: skip
    return _apply(x, None, weight, None, eps, rms=True, weight_offset=weight_offset,
                  out_dtype=out_dtype)[0]  # fmt: skip


def add_rms_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None = None,
                 eps: float = 1e-6, *, residual_dtype=None, weight_offset: float = 0.0,
                 out_dtype=None, quant=None, **quant_options) -> tuple:  # fmt: skip
    """``(y, h)``: h = x + residual (added in float32, stored in ``residual_dtype``, default
    residual's dtype), y = rms_norm(h) in x's dtype (or ``out_dtype``, or ``quant``'s, as
    ``rms_norm``'s); differentiable in x, residual, weight."""
    if quant is not None or quant_options:
        return _apply_quant(x, residual, weight, None, eps, rms=True,
                            residual_dtype=residual_dtype, weight_offset=weight_offset,
                            out_dtype=out_dtype, quant=quant, options=quant_options)  # fmt: skip
    return _apply(x, residual, weight, None, eps, rms=True, residual_dtype=residual_dtype,
                  weight_offset=weight_offset, out_dtype=out_dtype)  # fmt: skip


def add_layer_norm(x: jax.Array, residual: jax.Array, weight: jax.Array | None = None,
                   bias: jax.Array | None = None, eps: float = 1e-5, *, residual_dtype=None,
                   weight_offset: float = 0.0, out_dtype=None, quant=None,
                   **quant_options) -> tuple:  # fmt: skip
    """``(y, h)`` as ``add_rms_norm``, y = layer_norm(h)."""
    if quant is not None or quant_options:
        return _apply_quant(x, residual, weight, bias, eps, rms=False,
                            residual_dtype=residual_dtype, weight_offset=weight_offset,
                            out_dtype=out_dtype, quant=quant, options=quant_options)  # fmt: skip
    return _apply(x, residual, weight, bias, eps, rms=False, residual_dtype=residual_dtype,
                  weight_offset=weight_offset, out_dtype=out_dtype)  # fmt: skip


def precompile(n: int, dtype, *, device: jax.Device | None = None, **kwargs) -> int:
    """Compile ahead every kernel that rows of ``n`` elements of ``dtype`` (a JAX or NumPy
    dtype) can take at any number of rows, on a JAX GPU ``device`` (default: the first GPU):
    ``cupyln.precompile`` with its keywords (``w_dtype``, ``b_dtype``, ``rms``,
    ``residual_dtype``...). A jitted program whose XLA build captures CUDA graphs (command
    buffers) then compiles nothing inside one. Returns the number of kernels."""
    from ._problem import for_precompile

    device = jax.devices("gpu")[0] if device is None else device
    if device.platform != "gpu":
        raise ValueError(f"device must be a JAX GPU device; got {device}")
    backward = kwargs.pop("backward", True)
    p, db = for_precompile(n, numpy.dtype(dtype), **kwargs)
    index = device.local_hardware_id
    with _runtime.OnDevice(index):
        return len(_launcher.precompile(index, p, db, bool(backward)))
