"""torch bridge: cupyln's kernels on torch CUDA tensors, with autograd.

    import cupyln.torch
    y = cupyln.torch.layer_norm(x, (N,), weight, bias, eps)  # as torch.nn.functional.layer_norm
    ln = cupyln.torch.LayerNorm(N)                            # as torch.nn.LayerNorm
    cupyln.torch.replace_layer_norms(model)                   # every nn.LayerNorm of a model
    y = cupyln.torch.rms_norm(x, (N,), weight, eps)           # as torch.nn.functional.rms_norm
    rms = cupyln.torch.RMSNorm(N)                             # as torch.nn.RMSNorm
    y, h = cupyln.torch.add_rms_norm(x, residual, (N,), weight)        # h = x + residual
    y, h = cupyln.torch.add_layer_norm(x, residual, (N,), weight, bias)
    cupyln.torch.replace_norms(model)                         # nn.LayerNorm and nn.RMSNorm
    y, mean, rstd = cupyln.torch.forward(x, weight, bias)     # no autograd: the statistics
    q = cupyln.torch.rms_norm(x, (N,), weight, quant="mxfp8")  # y quantized (forward only)
    dx, dw, db = cupyln.torch.backward(dy, x, weight, mean, rstd)  # for your own backward

Every norm is one ``torch.library`` op pair, ``torch.ops.cupyln.norm_fwd`` / ``norm_bwd``
(LayerNorm or RMSNorm, a residual add in front or not, a weight offset), with fake
implementations and autograd, so ``torch.compile(fullgraph=True)`` keeps it in its graph; eager
calls skip the dispatcher. Kernels launch by raw pointers on
torch's current stream of the input's device; every output comes from torch's caching
allocator. Each new row width or dtype compiles its kernels on first use (cached on disk by
CuPy): run a model once before capturing it in a CUDA graph, or ``precompile`` the widths and
dtypes it will see, which covers every number of rows.

Under ``torch.autocast`` the layer behaves as ``torch.nn.functional.layer_norm`` does there: the
input, weight and bias are taken in float32 and the output is float32. On CPU tensors
``layer_norm`` and ``LayerNorm`` are ``torch.nn.functional.layer_norm`` itself, so a model whose
norms were replaced still runs on the CPU; so are ``rms_norm``, ``RMSNorm``, ``add_rms_norm`` and
``add_layer_norm`` torch's own ``rms_norm`` / ``layer_norm`` after the add in float32.
``weight_offset`` (keyword) scales by ``weight + weight_offset``.
"""

import math

import torch

from .. import _checks
from ._eager import _eager_apply, _inference, eager, norm
from ._glue import _check, _shapes
from ._jagged import jagged_layer_norm
from ._ops import _BWD, _FWD, _bwd_impl, _fwd_impl, needs_grad
from ._quant import quantized

__all__ = ["layer_norm", "LayerNorm", "replace_layer_norms", "forward", "backward",
           "jagged_layer_norm", "rms_norm", "RMSNorm", "add_rms_norm", "add_layer_norm",
           "replace_norms", "precompile"]  # fmt: skip


def precompile(normalized_shape, dtype: torch.dtype, *, weight_dtype=None, bias_dtype=None,
               weight: bool = True, bias: bool = True, rms: bool = False, residual=None,
               residual_dtype=None, weight_offset: bool = False, out_dtype=None,
               backward: bool = True, device=None, quant: str | None = None,
               **quant_options) -> int:  # fmt: skip
    """Compile ahead every kernel that rows of ``normalized_shape`` of ``dtype`` can take at
    any number of rows (``cupyln.precompile`` with torch dtypes): warm up with it before a CUDA
    graph is captured at shapes not run before. ``weight``/``bias``: whether the calls pass
    them (``weight_dtype``/``bias_dtype``: theirs, default ``dtype``); ``rms``: RMSNorm;
    ``residual``: the residual's dtype of an add in front, ``residual_dtype``: h's, as
    ``add_rms_norm``'s keyword (default the residual's; alone it stands for both);
    ``weight_offset``: whether the calls pass one; ``out_dtype``: y's, as the norms' keyword;
    ``device``: a CUDA device (default torch's current one); ``quant`` and its options: a
    quantized y's format, as the norms'. Returns the number of kernels."""
    from .. import _launcher, _runtime
    from .._problem import for_precompile
    from ._glue import _NP

    n = math.prod(_shape(normalized_shape))
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index

    def np_dtype(d, name):
        if d is None:
            return None
        if not isinstance(d, torch.dtype) or d not in _NP:
            raise TypeError(f"{name} must be a torch floating dtype cupyln takes; got {d}")
        return _NP[d]

    x = np_dtype(dtype, "dtype")
    w = np_dtype(weight_dtype, "weight_dtype") or x
    p, db = for_precompile(n, x, w_dtype=w, b_dtype=np_dtype(bias_dtype, "bias_dtype") or w,
                           affine=(weight, bias and not rms), rms=rms,
                           residual=np_dtype(residual, "residual"),
                           residual_dtype=np_dtype(residual_dtype, "residual_dtype"),
                           weight_offset=weight_offset,
                           out_dtype=np_dtype(out_dtype, "out_dtype"), quant=quant,
                           **quant_options)  # fmt: skip
    with _runtime.OnDevice(index):
        return len(_launcher.precompile(index, p, db, backward))


def layer_norm(
    input: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
    quant: str | None = None,
    **quant_options,
):
    """``torch.nn.functional.layer_norm`` with cupyln's kernels (CUDA tensors of float32,
    float16, bfloat16 or float64; weight and bias may have their own dtypes); ``out_dtype``:
    y's dtype, of input's precision (default input's: float32 in, bfloat16 out for the next
    GEMM); ``quant``: y quantized in the same pass, as ``rms_norm``'s. CPU tensors go to
    ``torch.nn.functional.layer_norm`` itself."""
    if quant is not None or quant_options:
        return quantized(input, None, weight, bias, eps, normalized_shape, rms=False,
                         quant=quant, options=quant_options)[0]  # fmt: skip
    if isinstance(input, torch.Tensor) and input.device.type == "cpu":
        y = torch.nn.functional.layer_norm(input, _shape(normalized_shape), weight, bias, eps)
        return y if out_dtype is None else y.to(out_dtype)
    if out_dtype is not None:
        return norm(input, None, weight, bias, eps, normalized_shape, rms=False,
                    weight_offset=0.0, out_dtype=out_dtype)[0]  # fmt: skip
    _check(input, "input")
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, input)
    shape = _shapes(input, normalized_shape, weight, bias)
    k = len(shape)
    eps = _checks.eps(eps)
    if torch.is_autocast_enabled("cuda"):  # as F.layer_norm: float32 in, float32 out
        input = input.float()
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
    if k == 1:  # the kernels take any leading shape: no reshapes
        x, w, b = input, weight, bias
        n = shape[0]
    else:
        n = math.prod(shape)
        x = input.reshape(*input.shape[: input.dim() - k], n)
        w = None if weight is None else weight.reshape(n)
        b = None if bias is None else bias.reshape(n)
    if eager():
        y = _eager_apply(x, w, b, eps) if needs_grad(x, w, b) else _inference(x, w, b, eps)
    else:
        y = _FWD(x, None, w, b, eps, False, None, 0.0)[0]
    return y if k == 1 else y.reshape(input.shape)


def forward(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    rms: bool = False,
    residual: torch.Tensor | None = None,
    residual_dtype: torch.dtype | None = None,
    weight_offset: float = 0.0,
    quant: str | None = None,
    **quant_options,
) -> tuple:
    """``cupyln.forward`` / ``cupyln.rms_forward`` on torch CUDA tensors: ``(y, mean, rstd)``
    of LayerNorm over the last dimension of x (``rms``: ``(y, rstd)`` of RMSNorm), ``h``
    appended with a ``residual`` add in front, launched on torch's current stream. No
    autograd: for code that keeps the statistics for its own backward (an
    ``autograd.Function`` of its own); ``layer_norm`` records gradients. y is like x
    (contiguous), or with ``quant`` a ``cupyln.Quantized(data, scale)`` (as ``rms_norm``'s);
    mean and rstd have shape ``x.shape[:-1]``, float32 (float64 for float64 x). Under
    torch.compile the call is the op ``torch.ops.cupyln.norm_fwd`` (``norm_fwd_q``) on
    detached inputs."""
    tensors = (x, residual, weight, bias)
    if eager() and quant is None and not quant_options:  # no op to trace: nothing to detach
        y, mean, rstd, h = _fwd_impl(*tensors, eps, rms, residual_dtype, weight_offset)
    else:
        detached = [None if t is None else t.detach() for t in tensors]
        if quant is not None or quant_options:
            y, mean, rstd, h = quantized(*detached, eps, (x.shape[-1],), rms=rms,
                                         residual_dtype=residual_dtype,
                                         weight_offset=weight_offset, quant=quant,
                                         options=quant_options)  # fmt: skip
        else:
            offset = _checks.weight_offset(weight_offset, weight is not None)
            y, mean, rstd, h = _FWD(*detached, _checks.eps(eps), rms, residual_dtype, offset)
    out = (y, rstd) if rms else (y, mean, rstd)
    return out + (h,) if residual is not None else out


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cupyln.backward`` on torch CUDA tensors: ``(dx, dw, db)`` at the statistics that
    ``forward`` returned, without autograd. dx is like x; dw (empty without a weight) and db
    have the weight's dtype (x's without one), summed in a fixed order (deterministic). Under
    torch.compile the call is the op ``torch.ops.cupyln.norm_bwd`` on detached inputs."""
    if eager():
        return _bwd_impl(dy, None, x, weight, mean, rstd, False, 0.0)
    weight = None if weight is None else weight.detach()
    return _BWD(dy.detach(), None, x.detach(), weight, mean.detach(), rstd.detach(), False, 0.0)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by cupyln: the same constructor, parameters and
    ``state_dict`` (a checkpoint loads either way), and ``isinstance(m, nn.LayerNorm)``; on CPU
    tensors it runs ``torch.nn.functional.layer_norm``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


def replace_layer_norms(module: torch.nn.Module) -> torch.nn.Module:
    """Make every ``torch.nn.LayerNorm`` in ``module`` a ``cupyln.torch.LayerNorm`` in place
    (parameters, buffers and hooks kept); returns ``module``."""
    for m in module.modules():
        if type(m) is torch.nn.LayerNorm:
            m.__class__ = LayerNorm
    return module


# ------------------------------------------------------------------ the norm family
def _rms_eps(eps, dtype: torch.dtype) -> float:
    """F.rms_norm's eps=None: the epsilon of float32 for 16-bit and float32 input (what torch
    does, measured), of float64 for float64."""
    if eps is not None:
        return eps
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def _shape(normalized_shape) -> tuple:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


def _cpu_checks(input, normalized_shape, weight, bias, residual, weight_offset) -> float:
    """The GPU path's checks on the CPU fallback's arguments, with its messages; returns the
    weight offset."""
    _shapes(input, normalized_shape, weight, bias, residual)
    return _checks.weight_offset(weight_offset, weight is not None)


def _cpu_add(input, residual, residual_dtype):
    hdt = residual.dtype if residual_dtype is None else residual_dtype
    return (input.float() + residual.float()).to(hdt) if hdt != torch.float64 else input + residual


def rms_norm(
    input: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
    quant: str | None = None,
    **quant_options,
):
    """``torch.nn.functional.rms_norm`` with cupyln's kernels: y = x * rstd * weight, rstd =
    1 / sqrt(mean(x^2) + eps) over the trailing ``normalized_shape``, in float32 (float64 for
    float64 input); ``eps=None`` as torch; ``out_dtype`` as ``layer_norm``'s. ``quant``: y
    quantized in the same pass, a ``cupyln.Quantized(data, scale)`` (forward only; the formats
    and keywords of ``cupyln.rms_forward``; data flattened over ``normalized_shape``). CPU
    tensors go to torch's own ``rms_norm``."""
    if quant is not None or quant_options:
        return quantized(input, None, weight, None, _rms_eps(eps, getattr(input, "dtype", None)),
                         normalized_shape, rms=True, weight_offset=weight_offset, quant=quant,
                         options=quant_options)[0]  # fmt: skip
    if isinstance(input, torch.Tensor) and input.device.type == "cpu":
        offset = _cpu_checks(input, normalized_shape, weight, None, None, weight_offset)
        w = weight if not offset else weight + offset
        y = torch.nn.functional.rms_norm(input, _shape(normalized_shape), w, eps)
        return y if out_dtype is None else y.to(out_dtype)
    eps = _rms_eps(eps, getattr(input, "dtype", None))
    return norm(input, None, weight, None, eps, normalized_shape, rms=True,
                weight_offset=weight_offset, out_dtype=out_dtype)[0]  # fmt: skip


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    residual_dtype: torch.dtype | None = None,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
    quant: str | None = None,
    **quant_options,
) -> tuple:
    """``(y, h)``: h = input + residual, added in float32 and stored in ``residual_dtype``
    (default residual's dtype), and y = rms_norm(h) in input's dtype (or ``out_dtype``, of
    its precision; or ``quant``'s, as ``rms_norm``'s); one read of input and residual, one
    write of y and h. Gradients reach input and residual (through both y and h)."""
    if quant is not None or quant_options:
        q, _, _, h = quantized(input, residual, weight, None,
                               _rms_eps(eps, getattr(input, "dtype", None)), normalized_shape,
                               rms=True, residual_dtype=residual_dtype,
                               weight_offset=weight_offset, quant=quant,
                               options=quant_options)  # fmt: skip
        return q, h
    if isinstance(input, torch.Tensor) and input.device.type == "cpu":
        offset = _cpu_checks(input, normalized_shape, weight, None, residual, weight_offset)
        h = _cpu_add(input, residual, residual_dtype)
        w = weight if not offset else weight + offset
        y = torch.nn.functional.rms_norm(h, _shape(normalized_shape), w, eps)
        return y.to(input.dtype if out_dtype is None else out_dtype), h
    eps = _rms_eps(eps, getattr(input, "dtype", None))
    return norm(
        input,
        residual,
        weight,
        None,
        eps,
        normalized_shape,
        rms=True,
        residual_dtype=residual_dtype,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
    )


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    residual_dtype: torch.dtype | None = None,
    weight_offset: float = 0.0,
    out_dtype: torch.dtype | None = None,
    quant: str | None = None,
    **quant_options,
) -> tuple:
    """``(y, h)``: h = input + residual as in ``add_rms_norm``, y = layer_norm(h) in input's
    dtype (or ``out_dtype``, or ``quant``'s)."""
    if quant is not None or quant_options:
        q, _, _, h = quantized(input, residual, weight, bias, eps, normalized_shape, rms=False,
                               residual_dtype=residual_dtype, weight_offset=weight_offset,
                               quant=quant, options=quant_options)  # fmt: skip
        return q, h
    if isinstance(input, torch.Tensor) and input.device.type == "cpu":
        offset = _cpu_checks(input, normalized_shape, weight, bias, residual, weight_offset)
        h = _cpu_add(input, residual, residual_dtype)
        w = weight if not offset else weight + offset
        y = torch.nn.functional.layer_norm(h, _shape(normalized_shape), w, bias, eps)
        return y.to(input.dtype if out_dtype is None else out_dtype), h
    return norm(
        input,
        residual,
        weight,
        bias,
        eps,
        normalized_shape,
        rms=False,
        residual_dtype=residual_dtype,
        weight_offset=weight_offset,
        out_dtype=out_dtype,
    )


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by cupyln: the same constructor, parameters and
    ``state_dict``, and ``isinstance(m, nn.RMSNorm)``; on CPU tensors torch's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


def replace_norms(module: torch.nn.Module, *, strict: bool = False) -> torch.nn.Module:
    """Make the norms of ``module`` compute with cupyln, in place (parameters, buffers, hooks
    and ``state_dict`` keys kept); returns ``module``.

    ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` become cupyln's; other norm modules (those
    of Hugging Face models: Llama, Mistral, Qwen2/3 with q_norm and k_norm, Gemma 1-3, OLMo2,
    Phi-3, DeepSeek-V3, T5) are recognised by what they compute, and keep their rounding (see
    ``cupyln.torch._models``). The names taken and the norm-like modules left are logged to
    the "cupyln" logger; ``strict=True`` raises ValueError where one is left."""
    from ._models import replace_model_norms

    replace_layer_norms(module)
    for m in module.modules():
        if type(m) is torch.nn.RMSNorm:
            m.__class__ = RMSNorm
    replace_model_norms(module, strict=strict)
    return module
