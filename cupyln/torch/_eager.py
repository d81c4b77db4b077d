"""The eager paths of the torch bridge: autograd.Functions that skip the dispatcher's round
trips through the op registry (host time on every call), and ``norm``, which picks the op
(under torch.compile and functorch transforms) or an eager path. LayerNorm without a residual
or offset takes the leanest path (the statistics in one tensor, the Function's C++ apply)."""

import math

import torch

from .. import _checks
from ._glue import _acc, _backward_into, _check, _forward_into, _shapes
from ._ops import _BWD, _FWD, _bwd_impl, _fwd_impl, backward, fwd_args, needs_grad, setup


def eager() -> bool:
    """Whether this call runs eagerly (not traced by torch.compile or a functorch transform)."""
    return not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active())


def _ln_grads(ctx, dx, dw, db):
    """The gradients autograd asked for, db in the bias's dtype."""
    gx = dx if ctx.needs_input_grad[0] else None
    gw = dw if ctx.needs_input_grad[1] else None
    gb = None
    if ctx.needs_input_grad[2]:
        gb = db if db.dtype == ctx.bias_dtype else db.to(ctx.bias_dtype)
    return gx, gw, gb, None


class _LayerNorm(torch.autograd.Function):
    """LayerNorm's forward and backward as the ops compute them, for eager calls: an
    autograd.Function skips the dispatcher's round trips through the op registry (host time on
    every call). torch.compile and functorch transforms see the ops."""

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
            return _ln_grads(ctx, *_BWD(dy, None, x, weight, mean, rstd, False, 0.0)[:3])
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
        return _ln_grads(ctx, dx, dw, db)


# Function.apply less its Python prologue (argument binding, a generator over the arguments):
# the C++ apply of torch's autograd, called after the same unwrapping of dead functorch wrappers
_apply = super(torch.autograd.Function, _LayerNorm).apply
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


class _Norm(torch.autograd.Function):
    """norm_fwd's forward and backward for eager calls, without the dispatcher's round trips."""

    @staticmethod
    def forward(ctx, *args):
        out = _fwd_impl(*args)
        setup(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, dy, _dmean, _drstd, dh):
        # create_graph=True: through the op, whose own backward is refused
        return backward(ctx, dy, dh, _BWD if torch.is_grad_enabled() else _bwd_impl)


def norm(x, residual, weight, bias, eps, normalized_shape, *, rms, weight_offset, **options):
    """(y, h) of a family member over the trailing ``normalized_shape`` of x (flattened to one
    width), by the op under torch.compile and functorch, by _Norm otherwise. ``options``:
    norm_fwd's keyword arguments (``fwd_args``)."""
    _check(x, "input")
    for t, name in ((residual, "residual"), (weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, x)
    shape = _shapes(x, normalized_shape, weight, bias, residual)
    k = len(shape)
    offset = _checks.weight_offset(weight_offset, weight is not None)
    n = math.prod(shape)
    if k > 1:
        x = x.reshape(*x.shape[: x.dim() - k], n)
        residual = None if residual is None else residual.reshape(x.shape)
        weight = None if weight is None else weight.reshape(n)
        bias = None if bias is None else bias.reshape(n)
    args = fwd_args(x, residual, weight, bias, eps, rms, weight_offset=offset, **options)
    if not eager():
        y, _, _, h = _FWD(*args)
    elif needs_grad(x, residual, weight, bias):
        y, _, _, h = _Norm.apply(*args)
    else:
        y, _, _, h = _fwd_impl(*args)
    if k > 1:
        y = y.reshape(*y.shape[:-1], *shape)
        h = h.reshape(y.shape) if h.numel() else h
    return y, h
