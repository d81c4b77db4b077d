"""The torch ops ``torch.ops.cupyln.layer_norm_fwd`` / ``layer_norm_bwd`` (schema, fake
implementations, autograd) and the eager path that skips the dispatcher."""

import torch

from .. import _checks
from ._glue import (
    _acc,
    _backward_into,
    _check,
    _check_input,
    _check_vector,
    _forward_into,
    _row_stats,
)


def _fwd_impl(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) of LayerNorm over the last dimension of x (see cupyln.forward)."""
    _check_input(x)
    _check_vector(weight, "weight", x)
    _check_vector(bias, "bias", x)
    eps = _checks.eps(eps)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    acc = _acc(x.dtype)
    mean, rstd = _row_stats(x, acc), _row_stats(x, acc)
    if y.numel():
        _forward_into(x, weight, bias, eps, y, mean.data_ptr(), rstd.data_ptr())
    return y, mean, rstd


def _fwd_fake(x, weight, bias, eps):
    acc = _acc(x.dtype)
    return (
        x.new_empty(x.shape),
        x.new_empty(x.shape[:-1], dtype=acc),
        x.new_empty(x.shape[:-1], dtype=acc),
    )


def _bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) at the saved statistics (see cupyln.backward). dw has no elements when
    there is no weight; db has the weight's dtype (x's without a weight)."""
    _check_input(x)
    _check(dy, "grad_output", x)
    _checks.like(dy.shape, dy.dtype, "grad_output", x.shape, x.dtype, "input")
    _check_vector(weight, "weight", x)
    for t, name in ((mean, "mean"), (rstd, "rstd")):
        _check(t, name, x)
        _checks.statistics(t.shape, t.dtype, name, x.shape[:-1], None, x.dtype, "input")
    n = x.shape[-1]
    wdt = x.dtype if weight is None else weight.dtype
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dw = torch.empty(0 if weight is None else n, dtype=wdt, device=x.device)
    db = torch.empty(n, dtype=wdt, device=x.device)
    m = dx.numel() // n
    if m == 0:
        dw.zero_()
        db.zero_()
        return dx, dw, db
    acc = _acc(x.dtype)
    mean = mean.to(acc).contiguous()
    rstd = rstd.to(acc).contiguous()
    _backward_into(dy, x, weight, mean.data_ptr(), rstd.data_ptr(), dx, dw, db)
    return dx, dw, db


def _bwd_fake(dy, x, weight, mean, rstd):
    n = x.shape[-1]
    wdt = x.dtype if weight is None else weight.dtype
    return (
        x.new_empty(x.shape),
        x.new_empty(0 if weight is None else n, dtype=wdt),
        x.new_empty(n, dtype=wdt),
    )


def _grads(ctx, dx, dw, db):
    """The gradients autograd asked for, db in the bias's dtype."""
    gx = dx if ctx.needs_input_grad[0] else None
    gw = dw if ctx.needs_input_grad[1] else None
    gb = None
    if ctx.needs_input_grad[2]:
        gb = db if db.dtype == ctx.bias_dtype else db.to(ctx.bias_dtype)
    return gx, gw, gb, None


def _needs_grad(a, b, c) -> bool:
    """Autograd records a call on a (tensor) and b, c (tensors or None)."""
    return torch.is_grad_enabled() and (
        a.requires_grad or (b is not None and b.requires_grad)
        or (c is not None and c.requires_grad)
    )  # fmt: skip


# The ops are defined with torch.library's lower-level API rather than torch.library.custom_op:
# the same schema, fake and autograd registrations, without custom_op's generic wrappers
# around each call (an aliasing check of the outputs, an argument-flattening autograd kernel),
# which cost host time on every call. The kernels below the autograd key are the
# implementations themselves, at CompositeExplicitAutograd as custom_op registers them, so a
# tensor off the GPU reaches _check's error.
_lib = torch.library.Library("cupyln", "DEF")
_lib.define(
    "layer_norm_fwd(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.define(
    "layer_norm_bwd(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd) "
    "-> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.impl("layer_norm_fwd", _fwd_impl, "CompositeExplicitAutograd")
_lib.impl("layer_norm_bwd", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("cupyln::layer_norm_fwd", _fwd_fake, lib=_lib)
torch.library.register_fake("cupyln::layer_norm_bwd", _bwd_fake, lib=_lib)
_FWD = torch.ops.cupyln.layer_norm_fwd.default
_BWD = torch.ops.cupyln.layer_norm_bwd.default
_below_autograd = torch._C._AutoDispatchBelowAutograd


class _FwdOp(torch.autograd.Function):
    """layer_norm_fwd's autograd: mean and rstd are not differentiable, the backward is
    layer_norm_bwd."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        with _below_autograd():
            y, mean, rstd = _FWD(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd):
        x, weight, mean, rstd = ctx.saved_tensors
        return _grads(ctx, *_BWD(dy, x, weight, mean, rstd))


class _BwdOp(torch.autograd.Function):
    """layer_norm_bwd is differentiable once: a second backward through it is refused."""

    @staticmethod
    def forward(ctx, dy, x, weight, mean, rstd):
        with _below_autograd():
            return _BWD(dy, x, weight, mean, rstd)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "cupyln's LayerNorm backward is not differentiable (no double backward); "
            "torch.nn.functional.layer_norm supports it"
        )


def _fwd_autograd(x, weight, bias, eps):
    if _needs_grad(x, weight, bias):
        return _FwdOp.apply(x, weight, bias, eps)
    with _below_autograd():
        return _FWD(x, weight, bias, eps)


def _bwd_autograd(dy, x, weight, mean, rstd):
    if _needs_grad(dy, x, weight):
        return _BwdOp.apply(dy, x, weight, mean, rstd)
    with _below_autograd():
        return _BWD(dy, x, weight, mean, rstd)


_lib.impl("layer_norm_fwd", _fwd_autograd, "Autograd")
_lib.impl("layer_norm_bwd", _bwd_autograd, "Autograd")


class _Eager(torch.autograd.Function):
    """The same forward and backward as the custom ops, for eager calls: an autograd.Function
    skips the dispatcher's round trips through the op registry (host time on every call).
    torch.compile and functorch transforms see the ops."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, stats = _eager_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, stats)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, stats = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: through the op, whose own backward
            m = stats.numel() // 2  # is refused (the kernels' results carry no graph)
            mean, rstd = stats[:m].view(x.shape[:-1]), stats[m:].view(x.shape[:-1])
            return _grads(ctx, *_BWD(dy, x, weight, mean, rstd))
        n = x.shape[-1]
        wdt = x.dtype if weight is None else weight.dtype
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dw = torch.empty(n, dtype=wdt, device=x.device) if weight is not None else None
        db = torch.empty(n, dtype=wdt, device=x.device)
        if dx.numel():
            m = stats.numel() // 2
            ptr = stats.data_ptr()
            _backward_into(dy, x, weight, ptr, ptr + m * stats.element_size(), dx, dw, db)
        else:
            db.zero_()
            if dw is not None:
                dw.zero_()
        return _grads(ctx, dx, dw, db)


# Function.apply less its Python prologue (argument binding, a generator over the arguments):
# the C++ apply of torch's autograd, called after the same unwrapping of dead functorch wrappers
_apply = super(torch.autograd.Function, _Eager).apply
_unwrap = torch._C._functorch.unwrap_if_dead


def _eager_apply(x, weight, bias, eps):
    return _apply(
        _unwrap(x),
        None if weight is None else _unwrap(weight),
        None if bias is None else _unwrap(bias),
        eps,
    )


def _eager_forward(x, weight, bias, eps):
    """(y, statistics): y like x (contiguous), mean and rstd one after the other in one tensor
    (two allocations per call instead of three)."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    n = x.shape[-1]
    m = x.numel() // n if n else 0
    stats = torch.empty(2 * m, dtype=_acc(x.dtype), device=x.device)
    if m:
        ptr = stats.data_ptr()
        _forward_into(x, weight, bias, eps, y, ptr, ptr + m * stats.element_size())
    return y, stats


def _inference(x, weight, bias, eps):
    """y alone: without autograd the statistics are not stored (one allocation per call)."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if y.numel():
        _forward_into(x, weight, bias, eps, y, 0, 0)
    return y


def _eager() -> bool:
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())
