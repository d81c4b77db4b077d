"""The jagged LayerNorm on torch tensors: the ops ``torch.ops.cupyln.jagged_fwd`` /
``jagged_bwd`` (fake implementations, autograd), which launch the jagged kernels on the
tensors' pointers through the launcher, on torch's current stream, into memory from torch's
allocator.

Outside a CUDA-graph capture the forward checks the offsets on the GPU (one synchronization);
inside one, and in the backward, the kernels read the offsets clamped on the GPU instead (no
synchronization). Either way the kernels are planned from ``max_seqlen`` alone, so a capture
takes the kernels an eager call compiled."""

import numpy
import torch

from .. import _checks, _launcher
from .._launcher.jagged import Jagged
from ._glue import _NP, _acc, _check, _on_device, _ptr, _stream, _workspace
from ._ops import _below_autograd, define, needs_grad, once

_INDEX = {torch.int32: numpy.dtype(numpy.int32), torch.int64: numpy.dtype(numpy.int64)}


def _np(t):
    return None if t is None else _NP[t.dtype]


def _aligned(t):
    """t, or a copy at a 64-byte aligned address (the kernels read w in packs)."""
    return t if t is None or not t.data_ptr() & 63 else t.clone()


def _fwd_impl(values, offsets, weight, bias, eps: float, max_seqlen):
    """(y, mean, rstd) of the jagged LayerNorm (see cupyln.jagged_forward)."""
    values, offsets = values.contiguous(), offsets.contiguous()
    acc = _acc(values.dtype)
    nseq = offsets.shape[0] - 1
    y = torch.empty_like(values)
    mean = values.new_empty(nseq, dtype=acc)
    rstd = values.new_empty(nseq, dtype=acc)
    check = not torch.cuda.is_current_stream_capturing()
    weight, bias = _aligned(weight), _aligned(bias)
    p = Jagged(values.shape[0], values.shape[1], nseq, _NP[values.dtype], _INDEX[offsets.dtype],
               _np(weight), _np(bias), max_seqlen)  # fmt: skip
    ptrs = (values.data_ptr(), offsets.data_ptr(), y.data_ptr(), _ptr(weight), _ptr(bias),
            mean.data_ptr(), rstd.data_ptr())  # fmt: skip
    index = values.device.index
    _on_device(index, _launcher.launch_jagged_forward, p, ptrs, eps, check, _workspace(index),
               _stream(index), False)  # fmt: skip
    return y, mean, rstd


def _fwd_fake(values, offsets, weight, bias, eps, max_seqlen):
    acc = _acc(values.dtype)
    nseq = offsets.shape[0] - 1
    return (
        values.new_empty(values.shape),
        values.new_empty(nseq, dtype=acc),
        values.new_empty(nseq, dtype=acc),
    )


def _bwd_impl(dy, values, offsets, weight, mean, rstd, max_seqlen):
    """(dx, dw, db) at the forward's statistics; dw has no elements without a weight, db has
    the weight's dtype (values' without one)."""
    dy, values, offsets = dy.contiguous(), values.contiguous(), offsets.contiguous()
    d = values.shape[1]
    wdt = values.dtype if weight is None else weight.dtype
    dx = torch.empty_like(values)
    dw = values.new_empty(0 if weight is None else d, dtype=wdt)
    db = values.new_empty(d, dtype=wdt)
    weight = _aligned(weight)
    mean, rstd = mean.contiguous(), rstd.contiguous()
    p = Jagged(values.shape[0], d, offsets.shape[0] - 1, _NP[values.dtype], _INDEX[offsets.dtype],
               _np(weight), _NP[wdt], max_seqlen)  # fmt: skip
    ptrs = (
        dy.data_ptr(),
        values.data_ptr(),
        offsets.data_ptr(),
        _ptr(weight),
        mean.data_ptr(),
        rstd.data_ptr(),
        dx.data_ptr(),
        _ptr(dw) if weight is not None else 0,
        db.data_ptr(),
    )
    index = values.device.index
    _on_device(index, _launcher.launch_jagged_backward, p, ptrs, False, _workspace(index),
               _stream(index), False)  # fmt: skip
    return dx, dw, db


def _bwd_fake(dy, values, offsets, weight, mean, rstd, max_seqlen):
    d = values.shape[1]
    wdt = values.dtype if weight is None else weight.dtype
    return (
        values.new_empty(values.shape),
        values.new_empty(0 if weight is None else d, dtype=wdt),
        values.new_empty(d, dtype=wdt),
    )


class _FwdOp(torch.autograd.Function):
    """jagged_fwd's autograd: mean and rstd are not differentiable, the backward is
    jagged_bwd."""

    @staticmethod
    def forward(ctx, values, offsets, weight, bias, eps, max_seqlen):
        with _below_autograd():
            y, mean, rstd = _FWD(values, offsets, weight, bias, eps, max_seqlen)
        ctx.save_for_backward(values, offsets, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.max_seqlen = max_seqlen
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    def backward(ctx, dy, _mean, _rstd):
        values, offsets, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _BWD(dy, values, offsets, weight, mean, rstd, ctx.max_seqlen)
        need = ctx.needs_input_grad
        gb = None
        if need[3]:
            gb = db if db.dtype == ctx.bias_dtype else db.to(ctx.bias_dtype)
        return dx if need[0] else None, None, dw if need[2] else None, gb, None, None


_BwdOp = once("jagged_bwd")


def _fwd_autograd(values, offsets, weight, bias, eps, max_seqlen):
    if needs_grad(values, weight, bias):
        return _FwdOp.apply(values, offsets, weight, bias, eps, max_seqlen)
    with _below_autograd():
        return _FWD(values, offsets, weight, bias, eps, max_seqlen)


def _bwd_autograd(dy, values, offsets, weight, *rest):
    if needs_grad(dy, values, weight):
        return _BwdOp.apply(dy, values, offsets, weight, *rest)
    with _below_autograd():
        return _BWD(dy, values, offsets, weight, *rest)


_FWD = define(
    "jagged_fwd(Tensor values, Tensor offsets, Tensor? weight, Tensor? bias, float eps, "
    "int? max_seqlen) -> (Tensor, Tensor, Tensor)",
    _fwd_impl, _fwd_fake, _fwd_autograd,
)  # fmt: skip
_BWD = define(
    "jagged_bwd(Tensor dy, Tensor values, Tensor offsets, Tensor? weight, Tensor mean, "
    "Tensor rstd, int? max_seqlen) -> (Tensor, Tensor, Tensor)",
    _bwd_impl, _bwd_fake, _bwd_autograd,
)  # fmt: skip


def jagged_layer_norm(
    input: torch.Tensor,
    offsets: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Jagged LayerNorm (each sequence normalized over all its elements) on torch tensors.

    ``input`` is either a nested tensor of layout ``torch.jagged`` ([B, j, D]; ``offsets``
    None), returned as the same kind, or a values tensor [total_L, D] with ``offsets`` [B+1]
    (int32/int64), returned as a values tensor. ``weight``/``bias``: optional [D]. Autograd
    gives the values', weight's and bias's gradients from cupyln's backward. Outside a CUDA-graph
    capture the forward checks the offsets on the GPU; inside one they are clamped instead.
    ``max_seqlen`` (a bound on the sequences' rows) plans faster kernels for short sequences.
    """
    nested = getattr(input, "is_nested", False)
    if nested:
        if offsets is not None:
            raise ValueError("offsets must be None for a nested tensor (it carries its own)")
        if input.layout != torch.jagged:
            raise ValueError(f"a nested input must have layout torch.jagged; got {input.layout}")
        values, offsets = input.values(), input.offsets()
    else:
        if offsets is None:
            raise ValueError("offsets [B + 1] are needed with a values tensor [total_L, D]")
        values = input
    _check(values, "values")
    if values.dim() != 2:
        raise ValueError(f"values must be 2-D [total_L, D]; got shape {tuple(values.shape)}")
    _checks.width(values.shape, "values")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, values)
            _checks.vector(t.shape, name, values.shape[1])
    if not isinstance(offsets, torch.Tensor) or offsets.device != values.device:
        raise ValueError(f"offsets must be a tensor on {values.device}")
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1 or not len(offsets):
        raise TypeError(f"offsets must be a 1-D int32 or int64 tensor of B + 1 >= 1 values; got "
                        f"{offsets.dtype} "
                        f"of shape {tuple(offsets.shape)}")  # fmt: skip
    max_seqlen = _checks.max_seqlen(max_seqlen)
    eps = _checks.eps(eps)
    y = _FWD(values, offsets, weight, bias, eps, max_seqlen)[0]
    if nested:
        return torch.nested.nested_tensor_from_jagged(y, offsets)
    return y
