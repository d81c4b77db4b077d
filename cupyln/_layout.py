"""How the CuPy API hands arrays to the launcher: rows at one stride used in place (other
layouts copied), w/b vectors aligned for the kernels' pack loads, raw pointers, and the
rounding of the pieces of one allocation."""

from __future__ import annotations

from . import _checks, _runtime


def rows(a):
    """(array, row stride in elements) for a CuPy array: rows at one stride are used in place,
    other layouts are copied to C order."""
    e = a.itemsize
    stride = None
    if all(s % e == 0 for s in a.strides):
        stride = _checks.row_stride(a.shape, [s // e for s in a.strides])
    if stride is None:
        a = _runtime.cupy().ascontiguousarray(a)
        stride = a.shape[-1]
    return a, stride


def aligned_vector(a):
    """w/b are read as contiguous packs of up to 64 bytes: a strided or misaligned vector is
    copied to a fresh allocation."""
    if a is None or (a.data.ptr % 64 == 0 and a.flags.c_contiguous):
        return a
    return _runtime.cupy().array(a, copy=True, order="C")


def ptr(a) -> int:
    """The device address of an array, 0 for None."""
    return 0 if a is None else a.data.ptr


def round_up(nbytes: int, to: int = 256) -> int:
    """``nbytes`` rounded up to a multiple of ``to`` (the pieces of one allocation)."""
    return -(-nbytes // to) * to
