"""torch bridge: cupyln's kernels on torch CUDA tensors, with autograd.

    import cupyln.torch
    y = cupyln.torch.layer_norm(x, (N,), weight, bias, eps)  # as torch.nn.functional.layer_norm
    ln = cupyln.torch.LayerNorm(N)                            # as torch.nn.LayerNorm
    cupyln.torch.replace_layer_norms(model)                   # every nn.LayerNorm of a model
    y, mean, rstd = cupyln.torch.forward(x, weight, bias)     # no autograd: the statistics
    dx, dw, db = cupyln.torch.backward(dy, x, weight, mean, rstd)  # for your own backward

Forward and backward are ``torch.library`` custom ops (``torch.ops.cupyln.layer_norm_fwd`` and
``torch.ops.cupyln.layer_norm_bwd``) with fake implementations and autograd, so
``torch.compile(fullgraph=True)`` keeps them in its graph. Kernels launch by raw pointers on
torch's current stream of the input's device; every output comes from torch's caching
allocator. Each new row width or dtype compiles its kernels on first use (cached on disk by
CuPy): run a model once before capturing it in a CUDA graph.

Under ``torch.autocast`` the layer behaves as ``torch.nn.functional.layer_norm`` does there: the
input, weight and bias are taken in float32 and the output is float32. On CPU tensors
``layer_norm`` and ``LayerNorm`` are ``torch.nn.functional.layer_norm`` itself, so a model whose
norms were replaced still runs on the CPU.
"""

import math
from typing import Optional

import torch

from . import _checks, _launcher, _runtime
from ._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64

__all__ = ["layer_norm", "LayerNorm", "replace_layer_norms", "forward", "backward",
           "jagged_layer_norm"]  # fmt: skip

#: torch dtype -> the NumPy dtype the launch heuristic and the C-type table know
_NP = {
    torch.float32: FLOAT32,
    torch.float16: FLOAT16,
    torch.bfloat16: BFLOAT16,
    torch.float64: FLOAT64,
}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(t, name: str, like=None) -> None:
    """t is a CUDA tensor of a supported dtype (on the device of the tensor ``like``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    _checks.dtype(_NP.get(t.dtype, t.dtype), name)
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor; got a tensor on {t.device}")
    if like is not None and t.get_device() != like.get_device():
        raise ValueError(f"{name} must be on {like.device} with the input; got {t.device}")


# ------------------------------------------------------------------ streams
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (index) -> CUstream


def _stream(index: int) -> int:
    """torch's current stream on device ``index``, as a raw CUstream."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _rows(t: torch.Tensor):
    """(tensor, row stride in elements): rows at one stride in place, other layouts copied."""
    if t.is_contiguous():
        return t, t.shape[-1]
    stride = _checks.row_stride(tuple(t.shape), t.stride())
    if stride is None:
        t = t.contiguous()
        stride = t.shape[-1]
    return t, stride


def _check_input(x) -> None:
    """x is a CUDA tensor of a supported dtype whose rows the kernels' int32 columns index."""
    _check(x, "input")
    _checks.width(x.shape, "input")


def _check_vector(t, name: str, x) -> None:
    """t is None or a CUDA tensor of shape (N,) on x's device (N: x's last dimension)."""
    if t is not None:
        _check(t, name, x)
        _checks.vector(t.shape, name, x.shape[-1])


def _vector(t):
    """w/b as a contiguous tensor whose start is 64-byte aligned (the kernels' pack loads)."""
    if t is None or (t.is_contiguous() and t.data_ptr() % 64 == 0):
        return t
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def _row_stats(x, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of x's rows' shape (``x.shape[:-1]``) and ``dtype`` on x's device. The
    sizes go to torch.empty as separate ints, which it parses faster than a torch.Size."""
    lead = x.shape[:-1]
    if not lead:
        return x.new_empty((), dtype=dtype)
    return torch.empty(*lead, dtype=dtype, device=x.device)


# ------------------------------------------------------------------ custom ops
def _fwd_impl(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
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


def _forward_into(x, weight, bias, eps, y, mean_ptr: int, rstd_ptr: int) -> None:
    """Launch the forward of a checked, non-empty x into y (contiguous) and the statistics."""
    n = x.shape[-1]
    m = x.numel() // n
    x, stride = _rows(x)
    weight, bias = _vector(weight), _vector(bias)
    xdt = _NP[x.dtype]
    index = x.get_device()
    _on_device(
        index, _launcher.launch_forward, m, n, x.data_ptr(), stride, xdt, y.data_ptr(),
        _ptr(weight), xdt if weight is None else _NP[weight.dtype],
        _ptr(bias), xdt if bias is None else _NP[bias.dtype],
        mean_ptr, rstd_ptr, eps, _stream(index),
    )  # fmt: skip


def _on_device(index: int, launch, *args) -> None:
    """``launch(index, *args)`` with device ``index`` current (made so only where it is not)."""
    if _runtime.is_current(index):
        launch(index, *args)
    else:
        with _runtime.OnDevice(index):
            launch(index, *args)


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
    weight: Optional[torch.Tensor],
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


def _backward_into(dy, x, weight, mean_ptr: int, rstd_ptr: int, dx, dw, db) -> None:
    """Launch the backward of checked, non-empty dy/x at the saved statistics into dx
    (contiguous), dw (ignored without a weight) and db."""
    n = x.shape[-1]
    m = x.numel() // n
    x, xs = _rows(x)
    dy, gs = _rows(dy)
    weight = _vector(weight)
    index = x.get_device()
    wnp = _NP[db.dtype]
    _on_device(
        index, _launcher.launch_backward, m, n, dy.data_ptr(), gs, x.data_ptr(), xs, _NP[x.dtype],
        _ptr(weight), wnp, mean_ptr, rstd_ptr, dx.data_ptr(),
        _ptr(dw) if weight is not None else 0, db.data_ptr(), wnp, _workspace(index),
        _stream(index),
    )  # fmt: skip


_workspaces: dict = {}  # device index -> launch_backward's workspace from torch's allocator


def _workspace(index: int):
    alloc = _workspaces.get(index)
    if alloc is None:
        device = torch.device("cuda", index)

        def alloc(nbytes: int):  # on torch's current stream, which the launches use
            t = torch.empty(nbytes, dtype=torch.uint8, device=device)
            return t.data_ptr(), t

        _workspaces[index] = alloc
    return alloc


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


# ------------------------------------------------------------------ public API
def layer_norm(
    input: torch.Tensor,
    normalized_shape,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` with cupyln's kernels (CUDA tensors of float32,
    float16, bfloat16 or float64; weight and bias may have their own dtypes). CPU tensors go
    to ``torch.nn.functional.layer_norm`` itself."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if isinstance(input, torch.Tensor) and input.device.type == "cpu":
        return torch.nn.functional.layer_norm(input, shape, weight, bias, eps)
    _check(input, "input")
    k = len(shape)
    if k == 0 or input.dim() < k or input.shape[-k:] != shape:
        raise ValueError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(input.shape)}"
        )
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None:
            _check(t, name, input)
            if t.shape != shape:
                raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
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
    if n > _checks.MAX_N:  # the kernels' columns are int32
        raise ValueError(f"normalized_shape must hold at most {_checks.MAX_N} elements; got {n}")
    if _eager():
        y = _eager_apply(x, w, b, eps) if _needs_grad(x, w, b) else _inference(x, w, b, eps)
    else:
        y = _FWD(x, w, b, eps)[0]
    return y if k == 1 else y.reshape(input.shape)


def forward(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cupyln.forward`` on torch CUDA tensors: ``(y, mean, rstd)`` of LayerNorm over the last
    dimension of x, launched on torch's current stream. No autograd: for code that keeps the
    statistics for its own backward (an ``autograd.Function`` of its own); ``layer_norm``
    records gradients. y is like x (contiguous); mean and rstd have shape ``x.shape[:-1]``,
    float32 (float64 for float64 x), rstd = 1 / sqrt(var + eps). Under torch.compile the call
    is the op ``torch.ops.cupyln.layer_norm_fwd`` on detached inputs."""
    if _eager():
        return _fwd_impl(x, weight, bias, eps)
    weight = None if weight is None else weight.detach()
    bias = None if bias is None else bias.detach()
    return _FWD(x.detach(), weight, bias, _checks.eps(eps))


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cupyln.backward`` on torch CUDA tensors: ``(dx, dw, db)`` at the statistics that
    ``forward`` returned, without autograd. dx is like x; dw (empty without a weight) and db
    have the weight's dtype (x's without one), summed in a fixed order (deterministic). Under
    torch.compile the call is the op ``torch.ops.cupyln.layer_norm_bwd`` on detached inputs."""
    if _eager():
        return _bwd_impl(dy, x, weight, mean, rstd)
    weight = None if weight is None else weight.detach()
    return _BWD(dy.detach(), x.detach(), weight, mean.detach(), rstd.detach())


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


# ------------------------------------------------------------------ jagged
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
    from . import _jagged

    return _jagged


def jagged_layer_norm(
    input: torch.Tensor,
    offsets: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    max_seqlen: Optional[int] = None,
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
