"""The jagged LayerNorm on torch tensors: the CuPy API on zero-copy DLPack views, on torch's
current stream, with autograd."""

import torch

from .. import _runtime
from ._glue import _check, _stream


class _OnTorchStream:
    """torch's current stream (and the tensor's device) as CuPy's current ones in the block:
    the jagged bridge calls the CuPy API on zero-copy DLPack views."""

    def __init__(self, device: torch.device):
        import cupy

        self._device = cupy.cuda.Device(device.index)
        self._index = device.index

    def __enter__(self):
        self._device.__enter__()
        self._stream = _runtime.external_stream(self._index, _stream(self._index))
        self._stream.__enter__()

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


def _cp(t):
    import cupy

    return None if t is None else cupy.from_dlpack(t.detach())


class _Jagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, weight, bias, eps, max_seqlen):
        with _OnTorchStream(values.device):
            y, mean, rstd = _api_jagged().jagged_forward(
                _cp(values), _cp(offsets), _cp(weight), _cp(bias), eps, max_seqlen=max_seqlen
            )
            y, mean, rstd = (torch.from_dlpack(a) for a in (y, mean, rstd))
        ctx.save_for_backward(values, offsets, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.max_seqlen = max_seqlen
        return y

    @staticmethod
    def backward(ctx, dy):
        values, offsets, weight, mean, rstd = ctx.saved_tensors
        with _OnTorchStream(values.device):
            dx, dw, db = _api_jagged().jagged_backward(
                _cp(dy.contiguous()), _cp(values), _cp(offsets), _cp(weight), _cp(mean),
                _cp(rstd), max_seqlen=ctx.max_seqlen, check_offsets=False,
            )  # fmt: skip
            dx, db = torch.from_dlpack(dx), torch.from_dlpack(db)
            dw = None if dw is None else torch.from_dlpack(dw)
        gb = None
        if ctx.needs_input_grad[3]:
            gb = db if db.dtype == ctx.bias_dtype else db.to(ctx.bias_dtype)
        gx = dx if ctx.needs_input_grad[0] else None
        return gx, None, dw if ctx.needs_input_grad[2] else None, gb, None, None


def _api_jagged():
    from .. import _jagged

    return _jagged


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
    gives the values', weight's and bias's gradients from cupyln's backward; offsets are
    checked on the GPU in the forward.
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
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, values)
    if not isinstance(offsets, torch.Tensor) or offsets.device != values.device:
        raise ValueError(f"offsets must be a tensor on {values.device}")
    y = _Jagged.apply(values, offsets, weight, bias, float(eps), max_seqlen)
    if nested:
        return torch.nested.nested_tensor_from_jagged(y, offsets)
    return y
