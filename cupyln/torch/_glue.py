"""torch tensors to kernel launches: the dtype map, the bridge's argument checks (through
cupyln._checks), row layout, torch's current stream, and the launches on raw pointers with
scratch memory from torch's caching allocator."""

import math

import torch

from .. import _checks, _launcher, _runtime
from .._dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64
from .._problem import Problem

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
    if t.dtype not in _NP:
        _checks.dtype(t.dtype, name)  # raises, naming the dtypes the kernels take
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


def _shapes(input, normalized_shape, weight=None, bias=None, residual=None) -> tuple:
    """``normalized_shape`` as a tuple, checked as F.layer_norm checks it: the trailing
    dimensions of ``input``, the shape of weight and bias; a residual of input's shape. For
    tensors on any device (the CPU fallback's too)."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    k = len(shape)
    if k == 0 or input.dim() < k or input.shape[-k:] != shape:
        raise ValueError(
            f"Given normalized_shape={list(shape)}, expected input with shape "
            f"[*, {', '.join(map(str, shape))}], but got input of size {list(input.shape)}"
        )
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"residual must be a torch.Tensor; got {type(residual).__name__}")
        if residual.shape != input.shape:
            raise ValueError(f"residual must have the shape of input {tuple(input.shape)}; "
                             f"got {tuple(residual.shape)}")  # fmt: skip
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    n = shape[0] if k == 1 else math.prod(shape)
    if n > _checks.MAX_N:  # the kernels' columns are int32
        raise ValueError(f"normalized_shape must hold at most {_checks.MAX_N} elements; got {n}")
    return shape


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


def _forward_into(x, weight, bias, eps, y, mean_ptr: int, rstd_ptr: int) -> None:
    """Launch the forward of a checked, non-empty x into y (contiguous) and the statistics."""
    n = x.shape[-1]
    m = x.numel() // n
    x, stride = _rows(x)
    weight, bias = _vector(weight), _vector(bias)
    p = Problem(m, n, _NP[x.dtype], None if weight is None else _NP[weight.dtype],
                None if bias is None else _NP[bias.dtype], x_stride=stride)  # fmt: skip
    ptrs = (x.data_ptr(), y.data_ptr(), _ptr(weight), _ptr(bias), mean_ptr, rstd_ptr, 0, 0)
    index = x.get_device()
    _on_device(index, _launcher.launch_forward, p, ptrs, eps, _stream(index))


def _on_device(index: int, launch, *args) -> None:
    """``launch(index, *args)`` with device ``index`` current (made so only where it is not)."""
    if _runtime.is_current(index):
        launch(index, *args)
    else:
        with _runtime.OnDevice(index):
            launch(index, *args)


def _backward_into(dy, x, weight, mean_ptr: int, rstd_ptr: int, dx, dw, db) -> None:
    """Launch the backward of checked, non-empty dy/x at the saved statistics into dx
    (contiguous), dw (ignored without a weight) and db."""
    n = x.shape[-1]
    m = x.numel() // n
    x, xs = _rows(x)
    dy, gs = _rows(dy)
    weight = _vector(weight)
    wnp = _NP[db.dtype]  # dw and db in the weight's dtype (x's without one)
    p = Problem(m, n, _NP[x.dtype], None if weight is None else wnp, wnp, x_stride=xs,
                dy_stride=gs)  # fmt: skip
    ptrs = (dy.data_ptr(), x.data_ptr(), _ptr(weight), mean_ptr, rstd_ptr, dx.data_ptr(),
            _ptr(dw) if weight is not None else 0, db.data_ptr(), 0)  # fmt: skip
    index = x.get_device()
    _on_device(index, _launcher.launch_backward, p, ptrs, _workspace(index), _stream(index))


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
