"""quant= in the torch bridge: the op ``torch.ops.cupyln.norm_fwd_q`` (every dense norm with y
quantized in its pass, forward only) with its fake implementation, and ``quantized``, which the
public functions call. Autograd never records it: a call on tensors that require grad, with
grad enabled, is refused by name (``cupyln.torch.forward`` keeps the statistics for a user's
own autograd.Function).

Outputs in torch's dtypes: elements ``float8_e4m3fn`` / ``float8_e5m2`` (NVFP4:
``float4_e2m1fn_x2``, two a byte), scales float32, ``float8_e8m0fnu`` (MXFP8) or
``float8_e4m3fn`` (NVFP4); "fp8"'s scale is the caller's.
"""

import math

import torch

from .. import _formats
from .._dtypes import BYTES
from .._formats import Quantized
from ._glue import _check, _ptr, _shapes
from ._ops import _fwd_fake, define, fwd_checks, fwd_run, needs_grad

_FP4 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
_E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)


def _is_tensor(a) -> bool:
    return isinstance(a, torch.Tensor)


def _dtypes(s) -> tuple:
    """(elements' torch dtype, scales' torch dtype or None) of a checked spec."""
    if s.name == "nvfp4":
        return _FP4, torch.float8_e4m3fn
    data = torch.float8_e5m2 if s.dtype == _formats.E5M2 else torch.float8_e4m3fn
    if s.name == "fp8":
        return data, None
    return data, _E8M0 if s.name == "mxfp8" else torch.float32


def _spec(n: int, quant: str, block: int, pow2_scale: bool, scale_ub: float, scale_layout: str,
          fp8_dtype: str):  # fmt: skip
    return _formats.spec(quant, n, fp8_dtype=fp8_dtype, block=block or None,
                         pow2_scale=pow2_scale, scale_ub=scale_ub or None,
                         scale_layout=scale_layout)  # fmt: skip


def _outputs(x, s, zeros: bool):
    """(data, scale or an empty tensor) of x's rows quantized by ``s``, from torch's allocator."""
    (dshape, _), sc = _formats.outputs(s, tuple(x.shape))
    ddt, sdt = _dtypes(s)
    data = torch.empty(dshape, dtype=torch.uint8, device=x.device).view(ddt)
    if sc is None:
        return data, x.new_empty(0, dtype=torch.float32)
    make = torch.zeros if zeros else torch.empty
    scale = make(sc[0], dtype=torch.uint8 if sc[1] == BYTES else torch.float32, device=x.device)
    return data, scale.view(sdt) if sc[1] == BYTES else scale


def _fwd_q_impl(x, residual, weight, bias, eps: float, rms: bool, residual_dtype,
                weight_offset: float, quant: str, block: int, pow2_scale: bool, scale_ub: float,
                scale_layout: str, fp8_dtype: str, given, given_value: float,
                want_amax: bool):  # fmt: skip
    """(data, scale, mean, rstd, h, amax) of the norm of x (or of h = x + residual), y
    quantized; amax (0-d, "fp8" with ``want_amax``, else empty) is max|y|."""
    eps, offset, hdt = fwd_checks(x, residual, weight, bias, eps, residual_dtype, weight_offset)
    s = _spec(x.shape[-1], quant, block, pow2_scale, scale_ub, scale_layout, fp8_dtype)
    if given is not None:
        name = _formats.GIVEN[s.name]
        _check(given, name, x)
        _formats.zero_d(given, name, "tensor", _is_tensor)
    data, scale = _outputs(x, s, s.scale_layout == "cublas")
    want_amax = want_amax and s.name == "fp8"
    amax = torch.zeros((), dtype=torch.float32, device=x.device) if want_amax else None
    q = (scale.data_ptr() if scale.numel() else 0, _ptr(given), _ptr(amax),
         _formats.launch_value(s, given_value))  # fmt: skip
    mean, rstd, h = fwd_run(x, residual, weight, bias, eps, offset, rms, hdt, data, BYTES, s, q)
    return data, scale, mean, rstd, h, x.new_empty(0, dtype=torch.float32) if amax is None else amax


def _fwd_q_fake(x, residual, weight, bias, eps, rms, residual_dtype, weight_offset, quant,
                block, pow2_scale, scale_ub, scale_layout, fp8_dtype, given, given_value,
                want_amax):  # fmt: skip
    s = _spec(x.shape[-1], quant, block, pow2_scale, scale_ub, scale_layout, fp8_dtype)
    (dshape, _), sc = _formats.outputs(s, tuple(x.shape))
    ddt, sdt = _dtypes(s)
    data = x.new_empty(dshape, dtype=ddt)
    scale = x.new_empty(0, dtype=torch.float32) if sc is None else x.new_empty(sc[0], dtype=sdt)
    _, mean, rstd, h = _fwd_fake(x, residual, weight, bias, eps, rms, residual_dtype,
                                 weight_offset)  # fmt: skip
    amax = x.new_empty(() if want_amax and s.name == "fp8" else 0, dtype=torch.float32)
    return data, scale, mean, rstd, h, amax


def _fwd_q_autograd(x, residual, weight, bias, *rest):
    if needs_grad(x, residual, weight, bias):
        raise ValueError("quant= is forward-only: autograd would record this call (inputs that "
                         "require grad); run it under torch.no_grad(), or use "
                         "cupyln.torch.forward, which returns the statistics for a backward "
                         "of your own")  # fmt: skip
    with torch._C._AutoDispatchBelowAutograd():
        return _FWD_Q(x, residual, weight, bias, *rest)


_FWD_Q = define(
    "norm_fwd_q(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, bool rms, "
    "ScalarType? residual_dtype, float weight_offset, str quant, int block, bool pow2_scale, "
    "float scale_ub, str scale_layout, str fp8_dtype, Tensor? given, float given_value, "
    "bool want_amax) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fwd_q_impl, _fwd_q_fake, _fwd_q_autograd,
)  # fmt: skip


def quantized(x, residual, weight, bias, eps, normalized_shape, *, rms, residual_dtype=None,
              weight_offset=0.0, quant, options) -> tuple:  # fmt: skip
    """(Quantized(data, scale), mean, rstd, h) of a norm over the trailing ``normalized_shape``
    (flattened to one width) with y quantized; ``options``: quant='s keywords."""
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        raise ValueError("quant= needs CUDA tensors (the kernels quantize); got input on the CPU")
    _check(x, "input")
    shape = _shapes(x, normalized_shape, weight, bias, residual)
    n = math.prod(shape)
    s, ops = _formats.checked(quant, options, n)
    _, given, value = _formats.scalar_operand(s, ops, _is_tensor, "tensor")
    amax = ops.get("amax")
    if amax is not None:
        _formats.zero_d(amax, "amax", "tensor", _is_tensor, TypeError)
    k = len(shape)
    lead = x.shape[: x.dim() - k]
    if k > 1:
        x = x.reshape(*lead, n)
        residual = None if residual is None else residual.reshape(x.shape)
        weight = None if weight is None else weight.reshape(n)
        bias = None if bias is None else bias.reshape(n)
    data, scale, mean, rstd, h, got = _FWD_Q(
        x, residual, weight, bias, eps, rms, residual_dtype, weight_offset, quant,
        s.block if s.name == "fp8_block" else 0, s.pow2_scale, s.scale_ub or 0.0, s.scale_layout,
        "e5m2" if s.dtype == _formats.E5M2 else "e4m3", given, value, amax is not None,
    )  # fmt: skip
    if amax is not None:  # an output of the op, not a mutation: torch.compile keeps it simple
        amax.copy_(got)
    if s.name == "fp8":
        scale = ops["scale"]
    if k > 1 and h.numel():
        h = h.reshape(*lead, *shape)
    return Quantized(data, scale), mean, rstd, h
