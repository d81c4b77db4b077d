"""Array API of the jagged LayerNorm: validation, allocation and launch of kernels/jagged.cu.

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
from ._layout import aligned_vector, ptr
from ._plans import backward as bwd
from ._plans.common import grid_size, vector_width
from ._plans.jagged import JAG_CLAMP_BLOCK as CLAMP  # the offsets' clamp
from ._plans.jagged import JAG_SMALL_BLOCK as SMALL  # the check, partition and expand kernels

if TYPE_CHECKING:
    from cupy import ndarray

_PART_BYTES = 32  # struct Part in jagged.cu: int64 seq, double n, a, b


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


def _check_offsets_on_gpu(dev, offsets, b: int, total: int, stream: int) -> int:
    """Raises ValueError for bad offsets; returns the longest sequence's rows."""
    cupy = _runtime.cupy()
    flags = cupy.array([0, 2**64 - 1, 0], dtype=cupy.uint64)
    launch, capacity = _launcher.jagged_check(dev, offsets.dtype)
    grid = grid_size(max(1, -(-b // SMALL)), 1, capacity)
    launch(grid, SMALL, 0, stream, offsets.data.ptr, b, total, flags.data.ptr)
    bits, first, longest = (int(v) for v in flags.get())
    if bits & 1:
        raise ValueError(f"offsets[0] must be 0; got {int(offsets[0])}")
    if bits & 2:
        raise ValueError(
            f"offsets must be non-decreasing; offsets[{first}] = {int(offsets[first])} > "
            f"offsets[{first + 1}] = {int(offsets[first + 1])}"
        )
    if bits & 4:
        raise ValueError(
            f"offsets[-1] must equal values.shape[0] = {total}; got {int(offsets[-1])}"
        )
    return longest


def _setup(values, offsets, w, b, eps, max_seqlen):
    total, d = _check_values(values)
    dev = values.data.device_id
    nseq = _check_offsets_array(offsets, dev)
    _checks.vector_array(w, "w", d, dev)
    _checks.vector_array(b, "b", d, dev)
    eps = _checks.eps(eps)
    _checks.max_seqlen(max_seqlen)
    return total, d, dev, nseq, eps


def _prepare(values, offsets, w, b):
    """Contiguous values and offsets, aligned w and b."""
    cupy = _runtime.cupy()
    values = cupy.ascontiguousarray(values)
    offsets = cupy.ascontiguousarray(offsets)
    return values, offsets, aligned_vector(w), aligned_vector(b)


def _plan_seqlen(max_seqlen, longest):
    """The sequence length the kernels are shaped for: the caller's max_seqlen, else the
    longest sequence from the offsets check rounded up to a power of two (few distinct plans),
    else None (the plan's default)."""
    if max_seqlen:
        return int(max_seqlen)
    return 1 << max(0, int(longest) - 1).bit_length() if longest else None


def _long_path(longest, d: int, cap: int, total: int) -> bool:
    """Whether the long path's kernels must run: some sequence may have more than ``cap``
    elements (``longest``: a bound on the rows of every sequence, or None)."""
    return total > 0 and (longest is None or longest * d > cap)


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
        forward_into(values, offsets, w, b, eps, max_seqlen, check_offsets, y, mean, rstd,
                     _runtime.pool_workspace)  # fmt: skip
    return y, mean, rstd


def _offsets(dev, offsets, nseq, total, check, stream, scratch):
    """(pointer to the offsets the kernels read, owner, longest sequence or None): the
    offsets themselves after the host's check (``check``), else their clamp into a valid
    partition in ``scratch`` memory (no synchronization)."""
    if check:
        return offsets.data.ptr, None, _check_offsets_on_gpu(dev, offsets, nseq, total, stream)
    o_ptr, owner = scratch((nseq + 1) * offsets.itemsize)
    _launcher.jagged_clamp(dev, offsets.dtype)(1, CLAMP, 0, stream, offsets.data.ptr, nseq,
                                               total, o_ptr)  # fmt: skip
    return o_ptr, owner, None


def forward_into(values, offsets, w, b, eps, max_seqlen, check, y, mean, rstd, scratch,
                 shape_by_check=True):  # fmt: skip
    """The forward's launches on checked, contiguous arguments (w, b aligned or None) into y,
    mean and rstd, on CuPy's current stream of the current device, with scratch memory from
    ``scratch(nbytes)`` -> (address, owner) (as the dense backward's workspace).
    ``shape_by_check``: plan the kernels for the longest sequence the check found (else for
    ``max_seqlen`` alone: the same kernels whether the check runs or not)."""
    total, d = values.shape
    nseq = offsets.shape[0] - 1
    dev = values.data.device_id
    stream = _runtime.current_stream()
    vec = vector_width(values.itemsize, d, (), (values.data.ptr, y.data.ptr))
    wdt = values.dtype if w is None else w.dtype
    bdt = values.dtype if b is None else b.dtype
    o_ptr, o_owner, longest = _offsets(dev, offsets, nseq, total, check, stream, scratch)
    longest = max_seqlen if longest is None else longest
    seqlen = _plan_seqlen(max_seqlen, longest if shape_by_check else None)
    k = _launcher.jagged(dev, d, values.dtype, wdt, bdt, offsets.dtype, vec, seqlen)
    if nseq == 0:  # rows in no sequence (unchecked offsets): normalized to nothing, zeros
        if total:
            _runtime.cupy().cuda.runtime.memsetAsync(y.data.ptr, 0, y.nbytes, stream)
        return
    x_ptr, y_ptr = values.data.ptr, y.data.ptr
    m_ptr, r_ptr, w_ptr, b_ptr = mean.data.ptr, rstd.data.ptr, ptr(w), ptr(b)
    p, groups = k.fwd, k.fwd_groups
    long_path = _long_path(longest, d, p.cap, total)
    chunks = -(-total // p.rows) if long_path else 0
    # scratch: has_long flag, the groups' first sequences, the long path's chunk records and
    # its sequences' exact means
    part, owner = scratch(16 + 8 * (groups + 1) + (2 * _PART_BYTES * chunks + 8 * nseq
                                                    if long_path else 0))  # fmt: skip
    flag, parts = part, part + 16
    recs = parts + 8 * (groups + 1)
    mean64 = recs + 2 * chunks * _PART_BYTES
    k("partition", -(-(nseq + 1) // SMALL), stream, o_ptr, nseq, groups, parts, flag)
    k("fwd_short", k.fwd_blocks, stream, x_ptr, o_ptr, d, y_ptr, w_ptr, b_ptr, m_ptr, r_ptr,
      eps, p.cap, p.ring, parts, int(long_path), flag)  # fmt: skip
    if long_path:
        k("fwd_partial", chunks, stream, x_ptr, o_ptr, nseq, d, p.rows, p.cap, recs, flag)
        k("fwd_combine", nseq, stream, o_ptr, nseq, d, p.rows, p.cap, recs, m_ptr, r_ptr,
          mean64, eps, flag)  # fmt: skip
        k("fwd_apply", chunks, stream, x_ptr, o_ptr, nseq, d, p.rows, p.cap, y_ptr, w_ptr,
          b_ptr, mean64, r_ptr, flag)  # fmt: skip
    del owner, o_owner  # back to their allocator once the launches are enqueued


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
        backward_into(dy, values, offsets, w, mean, rstd, max_seqlen, check_offsets, dx, dw, db,
                      _runtime.pool_workspace)  # fmt: skip
    return dx, dw, db


def backward_into(dy, values, offsets, w, mean, rstd, max_seqlen, check, dx, dw, db, scratch,
                  shape_by_check=True):  # fmt: skip
    """The backward's launches on checked, contiguous arguments into dx, dw (None without w)
    and db; the rest as forward_into."""
    total, d = values.shape
    nseq = offsets.shape[0] - 1
    dev = values.data.device_id
    acc = acc_dtype(values.dtype)
    stream = _runtime.current_stream()
    wdt = values.dtype if w is None else w.dtype
    ptrs = (values.data.ptr, dy.data.ptr, dx.data.ptr)
    vec = vector_width(values.itemsize, d, (), ptrs)
    # the backward has no slow walk: only the check may skip the long path
    o_ptr, o_owner, longest = _offsets(dev, offsets, nseq, total, check, stream, scratch)
    seqlen = _plan_seqlen(max_seqlen, longest if shape_by_check else None)
    k = _launcher.jagged(dev, d, values.dtype, wdt, db.dtype, offsets.dtype, vec, seqlen)
    rt = _runtime.cupy().cuda.runtime
    if total == 0 or nseq == 0:  # no row in a sequence (unchecked offsets): zero gradients
        for a in (dx, dw, db):
            if a is not None and a.nbytes:
                rt.memsetAsync(a.data.ptr, 0, a.nbytes, stream)
        return
    x_ptr, g_ptr, dx_ptr = ptrs
    w_ptr, m_ptr, r_ptr = ptr(w), mean.data.ptr, rstd.data.ptr
    p = k.bwd
    long_path = _long_path(longest, d, p.cap, total)
    chunks = -(-total // p.rows) if long_path else 0
    g, per = bwd.dwdb_slices(total, d, k.sm_count)
    esz = acc.itemsize
    # scratch: has_long flag, chunk records, the long path's coefficients, per-row statistics,
    # the dw/db partial rows
    sizes = (16, 2 * chunks * _PART_BYTES, 2 * nseq * esz, 2 * total * esz, 2 * g * d * esz)
    base, owner = scratch(sum(-(-n // 16) * 16 for n in sizes))
    flag, recs, coef, rows, part = _carve(base, sizes)
    if long_path:  # else no sequence is long and the short kernel never writes the flag
        rt.memsetAsync(flag, 0, 4, stream)
    k("bwd_short", nseq, stream, g_ptr, x_ptr, o_ptr, nseq, d, w_ptr, m_ptr, r_ptr, dx_ptr,
      p.cap, flag)  # fmt: skip
    if long_path:
        c1, c2 = coef, coef + nseq * esz
        k("bwd_partial", chunks, stream, g_ptr, x_ptr, o_ptr, nseq, d, p.rows, p.cap, w_ptr,
          m_ptr, r_ptr, recs, flag)  # fmt: skip
        k("bwd_combine", nseq, stream, o_ptr, nseq, d, p.rows, p.cap, recs, c1, c2, 0, 0.0,
          flag)  # fmt: skip
        k("bwd_apply", chunks, stream, g_ptr, x_ptr, o_ptr, nseq, d, p.rows, p.cap, w_ptr,
          m_ptr, r_ptr, c1, c2, dx_ptr, flag)  # fmt: skip
    # dw/db: column sums over all rows, with each row's sequence statistics
    rm, rr = rows, rows + total * esz
    k("expand", -(-total // SMALL), stream, o_ptr, nseq, m_ptr, r_ptr, rm, rr)
    dw_part = part if w is not None else 0
    db_part = part + g * d * esz
    # the dense backward's column kernel (BwdArgs: no w, no dx, 1 / N unused)
    k.cols((-(-d // 32), g), bwd.REDUCE_BLOCK, 0, stream, g_ptr, d, x_ptr, d, 0, rm, rr, 0,
           dw_part, db_part, total, d, 0.0, per, 0, 0)  # fmt: skip
    red, red_grid, red_block = _launcher.partial_reduce(dev, d, *k.dtypes, g)
    red(red_grid, red_block, 0, stream, dw_part, db_part, g, d, ptr(dw), db.data.ptr)
    del owner, o_owner  # back to their allocator once the launches are enqueued


def _carve(base: int, sizes) -> list:
    """Addresses of consecutive 16-byte aligned pieces of ``sizes`` bytes from ``base``."""
    out = []
    for n in sizes:
        out.append(base)
        base += -(-n // 16) * 16
    return out
