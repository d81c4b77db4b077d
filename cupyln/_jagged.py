"""Array API of the jagged LayerNorm: validation and allocation; the launcher's jagged job
runs kernels/jagged.cu on the arrays' pointers.

``values`` [total_L, D] holds B sequences one after another; ``offsets`` [B+1] (int32 or
int64) marks them: sequence i is rows offsets[i] to offsets[i+1]. Each sequence's whole block
of L_i * D elements is normalized with one mean and rstd (float32; float64 for float64
values), then scaled and shifted per column by optional w, b of shape [D].

Offsets are checked on the GPU: a small kernel flags offsets[0] != 0, a decrease, or
offsets[-1] != total_L, and finds the longest sequence; only its 24-byte verdict comes back to
the host (one synchronization, not a copy of the offsets). ``check_offsets=False`` skips it (no
synchronization; for offsets known to be valid, e.g. inside CUDA-graph capture): the kernels then
read a copy clamped on the GPU into a valid partition (each offset the largest of 0 and those
before it, at most total_L, the last total_L), so that bad offsets give wrong sequences but
never an access outside values.

The longest sequence (from the check, else the caller's ``max_seqlen``) decides whether the
long path's kernels run at all: they are skipped when every sequence fits the short path.
Without the check, a sequence longer than ``max_seqlen`` is still normalized right, walked from
global memory by the forward's short kernel (slowly); the backward keeps the long path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _checks, _launcher, _runtime
from ._dtypes import INDEX, acc_dtype
from ._launcher.jagged import Jagged
from ._layout import aligned_vector, ptr

if TYPE_CHECKING:
    from cupy import ndarray


# ------------------------------------------------------------------ validation
def _check_values(values, name="values") -> tuple[int, int]:
    _checks.array(values, name)
    if values.ndim != 2:
        raise ValueError(f"{name} must be 2-D [total_L, D]; got shape {values.shape}")
    total, d = values.shape
    if not 1 <= d <= _checks.MAX_N:
        raise ValueError(f"{name}.shape[1] (D) must be in [1, {_checks.MAX_N}]; got {d}")
    return total, d


def _check_offsets_array(offsets, dev: int) -> int:
    cupy = _runtime.cupy()
    if not isinstance(offsets, cupy.ndarray):
        raise TypeError(f"offsets must be a cupy.ndarray of int32 or int64; got {type(offsets)}")
    if offsets.dtype not in INDEX:
        raise TypeError(f"offsets must have dtype int32 or int64; got {offsets.dtype}")
    if offsets.ndim != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be 1-D of length B + 1 >= 1; got shape {offsets.shape}")
    if offsets.data.device_id != dev:
        raise ValueError(
            f"offsets must be on the device of values (cuda:{dev}); "
            f"got cuda:{offsets.data.device_id}"
        )
    return offsets.shape[0] - 1


def _setup(values, offsets, w, b, eps, max_seqlen):
    total, d = _check_values(values)
    dev = values.data.device_id
    nseq = _check_offsets_array(offsets, dev)
    _checks.vector_array(w, "w", d, dev)
    _checks.vector_array(b, "b", d, dev)
    eps = _checks.eps(eps)
    _checks.max_seqlen(max_seqlen)
    return total, d, dev, nseq, eps


def _dtype(a):
    return None if a is None else a.dtype


def _prepare(values, offsets, w, b):
    """Contiguous values and offsets, aligned w and b."""
    cupy = _runtime.cupy()
    values = cupy.ascontiguousarray(values)
    offsets = cupy.ascontiguousarray(offsets)
    return values, offsets, aligned_vector(w), aligned_vector(b)


# ------------------------------------------------------------------ public functions
def jagged_forward(
    values: ndarray,
    offsets: ndarray,
    w: ndarray | None = None,
    b: ndarray | None = None,
    eps: float = 1e-6,
    *,
    max_seqlen: int | None = None,
    check_offsets: bool = True,
) -> tuple[ndarray, ndarray, ndarray]:
    """LayerNorm of each sequence of a jagged batch over all its elements.

    Args:
        values: CuPy array [total_L, D] (float32, float16, bfloat16 or float64).
        offsets: CuPy int32/int64 array [B + 1]: 0 = offsets[0] <= ... <= offsets[B] = total_L.
            Equal neighbours are empty sequences.
        w, b: optional per-feature scale and shift of shape [D], each of any float dtype.
        eps: added to each sequence's biased variance; finite and >= 0.
        max_seqlen: optional bound on the sequence lengths. It sizes the shared memory of the
            short path, and without the offsets check it lets the long path's kernels be
            skipped; a longer sequence is still normalized right, only slower.
        check_offsets: validate the offsets on the GPU first (one small synchronization);
            False: no synchronization, the kernels read the offsets clamped into a valid
            partition (right for valid offsets; bad ones never lead outside values).

    Returns:
        (y, mean, rstd): y like values; mean and rstd of shape [B], float32 (float64 for
        float64 values). An empty sequence has mean 0 and rstd 1/sqrt(eps).
    """
    total, d, dev, nseq, eps = _setup(values, offsets, w, b, eps, max_seqlen)
    acc = acc_dtype(values.dtype)
    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        values, offsets, w, b = _prepare(values, offsets, w, b)
        y = cupy.empty((total, d), values.dtype)
        mean = cupy.empty(nseq, acc)
        rstd = cupy.empty(nseq, acc)
        p = Jagged(total, d, nseq, values.dtype, offsets.dtype, _dtype(w), _dtype(b),
                   _checks.max_seqlen(max_seqlen))  # fmt: skip
        ptrs = (values.data.ptr, offsets.data.ptr, y.data.ptr, ptr(w), ptr(b), mean.data.ptr,
                rstd.data.ptr)  # fmt: skip
        _launcher.launch_jagged_forward(dev, p, ptrs, eps, check_offsets, _runtime.pool_workspace,
                                        _runtime.current_stream())  # fmt: skip
    return y, mean, rstd


def jagged_layer_norm(values: ndarray, offsets: ndarray, eps: float = 1e-6, **kwargs) -> ndarray:
    """``jagged_forward(values, offsets, eps=eps)[0]``: the normalized values only."""
    return jagged_forward(values, offsets, eps=eps, **kwargs)[0]


def jagged_backward(
    dy: ndarray,
    values: ndarray,
    offsets: ndarray,
    w: ndarray | None,
    mean: ndarray,
    rstd: ndarray,
    *,
    db_dtype=None,
    max_seqlen: int | None = None,
    check_offsets: bool = True,
    bias_dtype=None,
) -> tuple[ndarray, ndarray | None, ndarray]:
    """Gradients of the jagged LayerNorm at the forward's saved mean and rstd.

    Args:
        dy: gradient of y, [total_L, D] like values.
        values, offsets: the forward's inputs.
        w: the forward's weight or None (then dw is None).
        mean, rstd: the forward's statistics, [B].
        db_dtype: dtype of db (default: w's, or values' without w); ``bias_dtype`` is its
            old, deprecated name.

    Returns:
        (dx, dw, db): dx like values; dw, db of shape [D], deterministic.
    """
    if bias_dtype is not None:
        db_dtype = _checks.renamed("bias_dtype", bias_dtype, "db_dtype", db_dtype)
    total, d, dev, nseq, _ = _setup(values, offsets, w, None, 0.0, max_seqlen)
    _checks.array(dy, "dy", dev)
    _checks.like(dy.shape, dy.dtype, "dy", values.shape, values.dtype, "values")
    acc = acc_dtype(values.dtype)
    for a, name in ((mean, "mean"), (rstd, "rstd")):
        _checks.array(a, name, dev)
        if a.dtype != acc or a.shape != (nseq,):
            raise ValueError(f"{name} must be {acc.name} of shape ({nseq},); got {a.dtype} "
                             f"{a.shape}")  # fmt: skip
    wdt = values.dtype if w is None else w.dtype
    db_dtype = _checks.dtype_arg(db_dtype, wdt, "db_dtype")
    cupy = _runtime.cupy()
    with _runtime.OnDevice(dev):
        values, offsets, w, _ = _prepare(values, offsets, w, None)
        dy = cupy.ascontiguousarray(dy)
        mean = cupy.ascontiguousarray(mean)
        rstd = cupy.ascontiguousarray(rstd)
        dx = cupy.empty((total, d), values.dtype)
        dw = None if w is None else cupy.empty(d, wdt)
        db = cupy.empty(d, db_dtype)
        p = Jagged(total, d, nseq, values.dtype, offsets.dtype, _dtype(w), db_dtype,
                   _checks.max_seqlen(max_seqlen))  # fmt: skip
        ptrs = (dy.data.ptr, values.data.ptr, offsets.data.ptr, ptr(w), mean.data.ptr,
                rstd.data.ptr, dx.data.ptr, ptr(dw), db.data.ptr)  # fmt: skip
        _launcher.launch_jagged_backward(dev, p, ptrs, check_offsets, _runtime.pool_workspace,
                                         _runtime.current_stream())  # fmt: skip
    return dx, dw, db
