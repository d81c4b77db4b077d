"""The norm family on torch tensors: the ops ``torch.ops.cupyln.norm_fwd`` / ``norm_bwd``
(RMSNorm or LayerNorm, with or without a residual add in front, with a weight offset), their
fake implementations and autograd, and the eager path that skips the dispatcher."""

import math

import torch

from .. import _checks, _launcher
from .._problem import Problem
from ._glue import (
    _NP,
    _acc,
    _check,
    _check_input,
    _check_vector,
    _on_device,
    _ptr,
    _row_stats,
    _rows,
    _stream,
    _vector,
    _workspace,
)
from ._ops import _eager

_TORCH = {v: k for k, v in _NP.items()}  # NumPy dtype -> torch dtype


def _scale(weight, offset: float, acc):
    """What the kernels read as w: the weight, or weight + offset (checked) in ``acc``."""
    if weight is None or not offset:
        return _vector(weight)
    return weight.to(acc) + offset


def _fwd_impl(x, residual, weight, bias, eps: float, rms: bool, residual_dtype,
              weight_offset: float):  # fmt: skip
    """(y, mean, rstd, h): the norm of x, or of h = x + residual; mean has no elements for
    RMSNorm, h none without a residual."""
    _check_input(x)
    _check_vector(weight, "weight", x)
    _check_vector(bias, "bias", x)
    eps = _checks.eps(eps)
    offset = _checks.weight_offset(weight_offset, weight is not None)
    hdt = None
    if residual is not None:
        _check(residual, "residual", x)
        rdt = None if residual_dtype is None else _NP.get(residual_dtype, residual_dtype)
        hdt = _checks.residual(tuple(residual.shape), _NP[residual.dtype], rdt, tuple(x.shape),
                               _NP[x.dtype])  # fmt: skip
    elif residual_dtype is not None:
        raise ValueError("residual_dtype needs a residual; got residual=None")
    acc = _acc(x.dtype)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mean = x.new_empty(0, dtype=acc) if rms else _row_stats(x, acc)
    rstd = _row_stats(x, acc)
    h = x.new_empty(0) if hdt is None else torch.empty(x.shape, dtype=_TORCH[hdt], device=x.device)
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    if m:
        w = _scale(weight, offset, acc)
        b = _vector(bias)
        x2, stride = _rows(x)
        r2, rs = _rows(residual) if residual is not None else (None, 0)
        p = Problem(m, n, _NP[x.dtype], None if w is None else _NP[w.dtype],
                    None if b is None else _NP[b.dtype], rms,
                    None if r2 is None else (_NP[r2.dtype], hdt), x_stride=stride,
                    r_stride=rs)  # fmt: skip
        ptrs = (x2.data_ptr(), y.data_ptr(), _ptr(w), _ptr(b), 0 if rms else mean.data_ptr(),
                rstd.data_ptr(), _ptr(r2), _ptr(h) if hdt is not None else 0)  # fmt: skip
        index = x.get_device()
        _on_device(index, _launcher.launch_forward, p, ptrs, eps, _stream(index),
                   _workspace(index))  # fmt: skip
    return y, mean, rstd, h


def _fwd_fake(x, residual, weight, bias, eps, rms, residual_dtype, weight_offset):
    acc = _acc(x.dtype)
    h = x.new_empty(0)
    if residual is not None:
        h = x.new_empty(x.shape, dtype=residual.dtype if residual_dtype is None else residual_dtype)
    mean = x.new_empty(0 if rms else x.shape[:-1], dtype=acc)
    return x.new_empty(x.shape), mean, x.new_empty(x.shape[:-1], dtype=acc), h


def _bwd_impl(dy, dh, h, weight, mean, rstd, rms: bool, weight_offset: float):
    """(dx, dw, db) of the norm of h (x without a residual) at the saved statistics, dh (or
    nothing) added to dx; dx has h's dtype, dw and db the weight's (no elements without a
    weight; db none for RMSNorm)."""
    _check_input(h)
    _check(dy, "grad_output", h)
    if tuple(dy.shape) != tuple(h.shape):
        raise ValueError(f"grad_output must have the input's shape {list(h.shape)}; "
                         f"got {list(dy.shape)}")  # fmt: skip
    if dh is not None:
        _check(dh, "grad_h", h)
        _checks.like(dh.shape, dh.dtype, "grad_h", h.shape, h.dtype, "h")
    _check_vector(weight, "weight", h)
    offset = _checks.weight_offset(weight_offset, weight is not None)
    n = h.shape[-1]
    wdt = h.dtype if weight is None else weight.dtype
    dx = torch.empty_like(h, memory_format=torch.contiguous_format)
    dw = torch.empty(0 if weight is None else n, dtype=wdt, device=h.device)
    db = torch.empty(0 if rms else n, dtype=wdt, device=h.device)
    m = dx.numel() // n if n else 0
    if m == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    acc = _acc(h.dtype)
    w = _scale(weight, offset, acc)
    dw_k = dw if w is None or w.dtype == wdt else torch.empty(n, dtype=w.dtype, device=h.device)
    if dy.dtype != h.dtype:
        dy = dy.to(h.dtype)
    x2, xs = _rows(h)
    dy2, gs = _rows(dy)
    dh2, hs = _rows(dh) if dh is not None else (None, 0)
    rstd = rstd.to(acc).contiguous()
    mean = None if rms else mean.to(acc).contiguous()
    p = Problem(m, n, _NP[h.dtype], None if w is None else _NP[w.dtype], _NP[wdt], rms,
                dh=dh2 is not None, x_stride=xs, dy_stride=gs, dh_stride=hs)  # fmt: skip
    ptrs = (
        dy2.data_ptr(),
        x2.data_ptr(),
        _ptr(w),
        _ptr(mean),
        rstd.data_ptr(),
        dx.data_ptr(),
        _ptr(dw_k) if w is not None else 0,
        0 if rms else db.data_ptr(),
        _ptr(dh2),
    )
    index = h.get_device()
    _on_device(index, _launcher.launch_backward, p, ptrs, _workspace(index), _stream(index))
    if dw_k is not dw:
        dw.copy_(dw_k)
    return dx, dw, db


def _bwd_fake(dy, dh, h, weight, mean, rstd, rms, weight_offset):
    n = h.shape[-1]
    wdt = h.dtype if weight is None else weight.dtype
    return (
        h.new_empty(h.shape),
        h.new_empty(0 if weight is None else n, dtype=wdt),
        h.new_empty(0 if rms else n, dtype=wdt),
    )


_lib = torch.library.Library("cupyln", "FRAGMENT")
_lib.define(
    "norm_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool rms, "
    "ScalarType? residual_dtype, float weight_offset) -> (Tensor, Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.define(
    "norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, "
    "bool rms, float weight_offset) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.impl("norm_fwd", _fwd_impl, "CompositeExplicitAutograd")
_lib.impl("norm_bwd", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("cupyln::norm_fwd", _fwd_fake, lib=_lib)
torch.library.register_fake("cupyln::norm_bwd", _bwd_fake, lib=_lib)
_FWD = torch.ops.cupyln.norm_fwd.default
_BWD = torch.ops.cupyln.norm_bwd.default


def _grads(ctx, dx, dw, db):
    """The gradients of (x, residual, weight, bias), each in its input's dtype."""
    need = ctx.needs_input_grad
    gx = dx.to(ctx.dtypes[0]) if need[0] else None
    gr = dx.to(ctx.dtypes[1]) if need[1] and ctx.dtypes[1] is not None else None
    gw = dw if need[2] else None
    gb = db.to(ctx.dtypes[3]) if need[3] and db.numel() else None
    return gx, gr, gw, gb


def _setup(ctx, inputs, output):
    x, residual, weight, bias, _eps, rms, _rdt, offset = inputs
    y, mean, rstd, h = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.rms, ctx.offset, ctx.has_residual = rms, offset, residual is not None
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype, None,
                  None if bias is None else bias.dtype)  # fmt: skip
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd, dh):
    src, weight, mean, rstd = ctx.saved_tensors
    dh = dh if ctx.has_residual else None
    return _grads(ctx, *_BWD(dy, dh, src, weight, mean, rstd, ctx.rms, ctx.offset)) + (None,) * 4


torch.library.register_autograd("cupyln::norm_fwd", _backward, setup_context=_setup, lib=_lib)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "cupyln's norm backward is not differentiable (no double backward); "
        "torch.nn.functional.rms_norm and layer_norm support it"
    )


torch.library.register_autograd(
    "cupyln::norm_bwd", _no_double_backward, setup_context=lambda ctx, inputs, output: None,
    lib=_lib,
)  # fmt: skip


class _Eager(torch.autograd.Function):
    """The same forward and backward for eager calls, without the dispatcher's round trips."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, residual_dtype, weight_offset):
        out = _fwd_impl(x, residual, weight, bias, eps, rms, residual_dtype, weight_offset)
        _setup(ctx, (x, residual, weight, bias, eps, rms, residual_dtype, weight_offset), out)
        return out

    @staticmethod
    def backward(ctx, dy, dmean, drstd, dh):
        src, weight, mean, rstd = ctx.saved_tensors
        dh = dh if ctx.has_residual else None
        if torch.is_grad_enabled():
            out = _BWD(dy, dh, src, weight, mean, rstd, ctx.rms, ctx.offset)
        else:
            out = _bwd_impl(dy, dh, src, weight, mean, rstd, ctx.rms, ctx.offset)
        return _grads(ctx, *out) + (None,) * 4


def norm(x, residual, weight, bias, eps, rms, residual_dtype, weight_offset, normalized_shape):
    """(y, h) of a family member over the trailing ``normalized_shape`` of x (flattened to one
    width), by the op under torch.compile and functorch, by _Eager otherwise."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    _check(x, "input")
    k = len(shape)
    if k == 0 or x.dim() < k or tuple(x.shape[-k:]) != shape:
        raise ValueError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(x.shape)}"
        )
    if residual is not None:
        _check(residual, "residual", x)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"residual must have the shape of input {tuple(x.shape)}; "
                             f"got {tuple(residual.shape)}")  # fmt: skip
    if residual_dtype is not None and not isinstance(residual_dtype, torch.dtype):
        raise TypeError(f"residual_dtype must be a torch.dtype or None; got "
                        f"{type(residual_dtype).__name__}")  # fmt: skip
    offset = _checks.weight_offset(weight_offset, weight is not None)
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, x)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    n = math.prod(shape)
    if n > _checks.MAX_N:
        raise ValueError(f"normalized_shape must hold at most {_checks.MAX_N} elements; got {n}")
    if k > 1:
        x = x.reshape(*x.shape[: x.dim() - k], n)
        residual = None if residual is None else residual.reshape(x.shape)
        weight = None if weight is None else weight.reshape(n)
        bias = None if bias is None else bias.reshape(n)
    args = (x, residual, weight, bias, eps, rms, residual_dtype, offset)
    if not _eager():
        y, _, _, h = _FWD(*args)
    elif torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, residual, weight, bias)
    ):
        y, _, _, h = _Eager.apply(*args)
    else:
        y, _, _, h = _fwd_impl(*args)
    if k > 1:
        y = y.reshape(*y.shape[:-1], *shape)
        h = h.reshape(y.shape) if h.numel() else h
    return y, h
