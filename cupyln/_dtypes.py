"""The one dtype table: which element types cupyln takes and what they are in CUDA C.

bfloat16 is NumPy's extension type from ``ml_dtypes`` (the one CuPy >= 14 uses); the kernels
treat fp16/bf16 as 16-bit storage types defined in ``kernels/common.cuh``.
"""

from __future__ import annotations

import numpy

try:  # bfloat16 exists in NumPy only through ml_dtypes
    import ml_dtypes

    BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

FLOAT16 = numpy.dtype(numpy.float16)
FLOAT32 = numpy.dtype(numpy.float32)
FLOAT64 = numpy.dtype(numpy.float64)

#: element dtype -> (C type in the kernels, dtype of the arithmetic / statistics)
TABLE: dict[numpy.dtype, tuple[str, numpy.dtype]] = {
    FLOAT32: ("float", FLOAT32),
    FLOAT16: ("cupyln::half_t", FLOAT32),
    FLOAT64: ("double", FLOAT64),
}
if BFLOAT16 is not None:
    TABLE[BFLOAT16] = ("cupyln::bf16_t", FLOAT32)

#: names for messages and docs, in the order of the table
SUPPORTED_NAMES = tuple(dt.name for dt in TABLE)

#: the jagged offsets' dtypes -> their C type
INDEX = {numpy.dtype(numpy.int32): "int", numpy.dtype(numpy.int64): "long long"}

#: a quantized y's elements and byte scales (cupyln/_formats.py), as the kernels store them
BYTES = numpy.dtype(numpy.uint8)


def ctype(dtype) -> str:
    """C type of a supported element or offsets dtype (TypeError for any other)."""
    dtype = numpy.dtype(dtype)
    entry = TABLE.get(dtype)
    if entry is not None:
        return entry[0]
    if dtype in INDEX:
        return INDEX[dtype]
    if dtype == BYTES:
        return "unsigned char"
    raise TypeError(f"dtype must be one of {', '.join(SUPPORTED_NAMES)}; got {dtype}")


def acc_dtype(dtype) -> numpy.dtype:
    """dtype of mean/rstd and of all arithmetic for inputs of this dtype."""
    return TABLE[numpy.dtype(dtype)][1]
