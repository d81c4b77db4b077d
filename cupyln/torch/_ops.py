"""The torch ops of every dense norm: ``torch.ops.cupyln.norm_fwd`` / ``norm_bwd`` (RMSNorm or
LayerNorm, with or without a residual add in front, with a weight offset): their schema, the
implementations that launch the kernels, the fake implementations and autograd.

The ops are defined with torch.library's lower-level API rather than torch.library.custom_op:
the same schema, fake and autograd registrations, without custom_op's generic wrappers around
each call (an aliasing check of the outputs, an argument-flattening autograd kernel), which
cost host time on every call. The kernels below the autograd key are the implementations
themselves, at CompositeExplicitAutograd as custom_op registers them, so a tensor off the GPU
reaches _check's error."""

import torch

from .. import _checks, _launcher
from .._launcher import NO_QUANT
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

_TORCH = {v: k for k, v in _NP.items()}  # NumPy dtype -> torch dtype


def _scale(weight, offset: float, acc):
    """What the kernels read as w: the weight, or weight + offset (checked) in ``acc``."""
    if weight is None or not offset:
        return _vector(weight)
    return weight.to(acc) + offset


def fwd_checks(x, residual, weight, bias, eps, residual_dtype, weight_offset) -> tuple:
    """(eps, weight offset, h's dtype or None) of a forward's arguments, checked (every dense
    forward of the bridge: norm_fwd, norm_fwd_q)."""
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
    return eps, offset, hdt


def fwd_run(x, residual, weight, bias, eps, offset, rms, hdt, y, y_dtype=None, quant=None,
            q=NO_QUANT) -> tuple:  # fmt: skip
    """(mean, rstd, h) of a checked forward launched into y (mean empty for RMSNorm, h empty
    without a residual); ``y_dtype``, ``quant`` and ``q``: as the launcher's problem and
    launch_forward take them."""
    acc = _acc(x.dtype)
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
                    r_stride=rs, y_dtype=y_dtype, quant=quant)  # fmt: skip
        ptrs = (x2.data_ptr(), y.data_ptr(), _ptr(w), _ptr(b), 0 if rms else mean.data_ptr(),
                rstd.data_ptr(), _ptr(r2), _ptr(h) if hdt is not None else 0)  # fmt: skip
        index = x.get_device()
        _on_device(index, _launcher.launch_forward, p, ptrs, eps, _stream(index), q)
    return mean, rstd, h


def _fwd_impl(x, residual, weight, bias, eps: float, rms: bool, residual_dtype,
              weight_offset: float, out_dtype=None):  # fmt: skip
    """(y, mean, rstd, h): the norm of x, or of h = x + residual; y in ``out_dtype`` (default
    x's); mean has no elements for RMSNorm, h none without a residual."""
    eps, offset, hdt = fwd_checks(x, residual, weight, bias, eps, residual_dtype, weight_offset)
    ydt = None if out_dtype is None else _checks.out_dtype(_NP.get(out_dtype, out_dtype),
                                                           _NP[x.dtype])  # fmt: skip
    y = torch.empty_like(x, memory_format=torch.contiguous_format,
                         dtype=x.dtype if ydt is None else out_dtype)  # fmt: skip
    return (y, *fwd_run(x, residual, weight, bias, eps, offset, rms, hdt, y, ydt))


def fwd_args(x, residual, weight, bias, eps, rms, residual_dtype=None, weight_offset=0.0,
             out_dtype=None) -> tuple:  # fmt: skip
    """norm_fwd's arguments in its schema's order, its options by keyword at their defaults
    (a new option of the norms is a keyword here and in the schema); the dtype options must
    be torch dtypes or None."""
    if residual_dtype is not None or out_dtype is not None:  # (most calls pass neither)
        for value, name in ((residual_dtype, "residual_dtype"), (out_dtype, "out_dtype")):
            if value is not None and not isinstance(value, torch.dtype):
                raise TypeError(f"{name} must be a torch.dtype or None; got "
                                f"{type(value).__name__}")  # fmt: skip
    return x, residual, weight, bias, eps, rms, residual_dtype, weight_offset, out_dtype


def _fwd_fake(x, residual, weight, bias, eps, rms, residual_dtype, weight_offset, out_dtype=None):
    acc = _acc(x.dtype)
    h = x.new_empty(0)
    if residual is not None:
        h = x.new_empty(x.shape, dtype=residual.dtype if residual_dtype is None else residual_dtype)
    mean = x.new_empty(0 if rms else x.shape[:-1], dtype=acc)
    y = x.new_empty(x.shape, dtype=x.dtype if out_dtype is None else out_dtype)
    return y, mean, x.new_empty(x.shape[:-1], dtype=acc), h


def _bwd_impl(dy, dh, h, weight, mean, rstd, rms: bool, weight_offset: float):
    """(dx, dw, db) of the norm of h (x without a residual) at the saved statistics, dh (or
    nothing) added to dx; dx has h's dtype, dw and db the weight's (no elements without a
    weight; db none for RMSNorm)."""
    _check_input(h)
    _check(dy, "grad_output", h)
    _checks.gradient(dy.shape, _NP[dy.dtype], "grad_output", h.shape, _NP[h.dtype], "input")
    if dh is not None:
        _check(dh, "grad_h", h)
        _checks.like(dh.shape, dh.dtype, "grad_h", h.shape, h.dtype, "h")
    _check_vector(weight, "weight", h)
    for t, name in ((rstd, "rstd"),) if rms else ((mean, "mean"), (rstd, "rstd")):
        _check(t, name, h)
        _checks.statistics(t.shape, t.dtype, name, h.shape[:-1], None, h.dtype, "input")
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


_lib = torch.library.Library("cupyln", "DEF")
_below_autograd = torch._C._AutoDispatchBelowAutograd


def define(schema: str, impl, fake, autograd):
    """The op ``torch.ops.cupyln.NAME`` of ``schema``: ``impl`` below the autograd key,
    ``fake`` for tracing, ``autograd`` at the Autograd key (an impl's signature, deciding
    whether autograd records the call). Every op of the bridge is registered this way."""
    name = schema.split("(", 1)[0]
    _lib.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"cupyln::{name}", fake, lib=_lib)
    _lib.impl(name, autograd, "Autograd")
    return getattr(torch.ops.cupyln, name).default


def _fwd_autograd(x, residual, weight, bias, *rest):
    if needs_grad(x, residual, weight, bias):
        return _FwdOp.apply(x, residual, weight, bias, *rest)
    with _below_autograd():
        return _FWD(x, residual, weight, bias, *rest)


def _bwd_autograd(dy, dh, h, weight, *rest):
    if needs_grad(dy, dh, h, weight):
        return _BwdOp.apply(dy, dh, h, weight, *rest)
    with _below_autograd():
        return _BWD(dy, dh, h, weight, *rest)


_FWD = define(
    "norm_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool rms, "
    "ScalarType? residual_dtype, float weight_offset, ScalarType? out_dtype=None) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    _fwd_impl, _fwd_fake, _fwd_autograd,
)  # fmt: skip
_BWD = define(
    "norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, "
    "bool rms, float weight_offset) -> (Tensor, Tensor, Tensor)",
    _bwd_impl, _bwd_fake, _bwd_autograd,
)  # fmt: skip


def _grads(ctx, dx, dw, db):
    """The gradients of (x, residual, weight, bias), each in its input's dtype."""
    need = ctx.needs_input_grad
    gx = dx.to(ctx.dtypes[0]) if need[0] else None
    gr = dx.to(ctx.dtypes[1]) if need[1] and ctx.dtypes[1] is not None else None
    gw = dw if need[2] else None
    gb = db.to(ctx.dtypes[3]) if need[3] and db.numel() else None
    return gx, gr, gw, gb


def setup(ctx, inputs, output) -> None:
    """What the backward of norm_fwd keeps: the normalized input (h with a residual), the
    weight, the statistics, and the inputs' dtypes."""
    x, residual, weight, bias, _eps, rms, _rdt, offset, *_ = inputs
    _y, mean, rstd, h = output
    ctx.options = len(inputs) - 4  # the arguments after the four tensors
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.rms, ctx.offset, ctx.has_residual = rms, offset, residual is not None
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype, None,
                  None if bias is None else bias.dtype)  # fmt: skip
    ctx.mark_non_differentiable(mean, rstd)


def backward(ctx, dy, dh, bwd) -> tuple:
    """The gradients of norm_fwd's inputs through ``bwd`` (the op, or its implementation
    where no graph is recorded); dy of y's dtype is converted to the input's."""
    src, weight, mean, rstd = ctx.saved_tensors
    dh = dh if ctx.has_residual else None
    grads = bwd(dy, dh, src, weight, mean, rstd, ctx.rms, ctx.offset)
    return _grads(ctx, *grads) + (None,) * ctx.options


class _FwdOp(torch.autograd.Function):
    """norm_fwd's autograd: mean and rstd are not differentiable, the backward is norm_bwd."""

    @staticmethod
    def forward(ctx, *args):
        with _below_autograd():
            out = _FWD(*args)
        setup(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd, dh):
        return backward(ctx, dy, dh, _BWD)


def once(name: str):
    """The autograd.Function of a backward op ``torch.ops.cupyln.NAME``, differentiable once:
    a second backward through it is refused (the kernels' results carry no graph)."""

    class Once(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            with _below_autograd():
                return getattr(torch.ops.cupyln, name).default(*args)

        @staticmethod
        def backward(ctx, *grads):
            raise RuntimeError(f"cupyln's {name} backward is not differentiable (no double "
                               "backward); torch's own functions support it")  # fmt: skip

    return Once


_BwdOp = once("norm_bwd")


def needs_grad(*tensors) -> bool:
    """Autograd records a call on these tensors (or None). A loop, not any() over a generator:
    it runs on every eager call."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False
