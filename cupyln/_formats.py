"""The one table of quantized output formats: y written for the next low-precision GEMM in the
norm's own pass (``quant=``). What each format's elements, blocks and scales are, and the
checked options of one call (``spec``), which the API, the bridges, the reference and the plans
share.

- "fp8": per tensor, the caller's static ``scale``: data = fp8(y / scale).
- "fp8_row": per row, s = max(amax_row, 1e-12) / FP8_MAX (amax clamped to ``scale_ub``).
- "fp8_block": blocks of ``block`` (128 or 64) along the row, the last one partial; s as per
  row, rounded up to a power of two with ``pow2_scale``.
- "mxfp8": OCP MX, blocks of 32, s = 2^ceil(log2(amax / FP8_MAX)) stored as E8M0.
- "nvfp4": blocks of 16, e2m1 elements two a byte (the first in the low nibble), block scales
  e4m3 = amax / 6 * S with S = 448 * 6 / ``global_amax``.

Rounding is to nearest even and saturating; fp8 is e4m3 unless ``fp8_dtype="e5m2"``.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy

from . import _checks

E4M3 = numpy.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = numpy.dtype(ml_dtypes.float8_e5m2)
E2M1 = numpy.dtype(ml_dtypes.float4_e2m1fn)  # one element a byte in NumPy; packed in outputs

FP8 = {"e4m3": (E4M3, 448.0), "e5m2": (E5M2, 57344.0)}  # fp8_dtype -> (dtype, largest value)
FP4_MAX = 6.0
MIN_AMAX = 1e-12  # a block of zeros gets a tiny scale, not a division by zero
E8M0_BIAS = 127


class Format(NamedTuple):
    """``block``: elements a scale covers along the row (0: the whole row, None: the tensor);
    ``divides``: whether N must be a multiple of the block. Scales are the caller's ("fp8"),
    float32 ("fp8_row", "fp8_block"), E8M0 bytes ("mxfp8") or e4m3 ("nvfp4")."""

    block: int | None
    divides: bool = False


FORMATS = {
    "fp8": Format(None),
    "fp8_row": Format(0),
    "fp8_block": Format(128),
    "mxfp8": Format(32, divides=True),
    "nvfp4": Format(16, divides=True),
}
FP8_BLOCKS = (128, 64)
CUBLAS = ("mxfp8", "nvfp4")  # the formats whose scales cuBLAS reads in 128x4 tiles


class Quantized(NamedTuple):
    """A quantized y: its elements and its scales (layouts and dtypes: ``outputs``)."""

    data: object
    scale: object


class Spec(NamedTuple):
    """One call's checked quantization: format name, elements per scale (0: the row, None: the
    tensor), the element dtype and its largest value, and the options the format takes."""

    name: str
    block: int | None
    dtype: numpy.dtype
    max: float
    scale_layout: str = "rows"
    pow2_scale: bool = False
    scale_ub: float | None = None

    def blocks(self, n: int) -> int:
        """Scales a row of ``n`` holds (1 per row for "fp8_row", 0 for "fp8")."""
        if self.block is None:
            return 0
        return 1 if self.block == 0 else -(-n // self.block)


def spec(quant, n: int, *, fp8_dtype="e4m3", block=None, pow2_scale=False, scale_ub=None,
         scale_layout="rows") -> Spec:  # fmt: skip
    """The checked ``quant=`` options of a call over rows of ``n``: TypeError/ValueError naming
    the argument, what it takes and what came, before anything is written. The per-call
    operands (``scale=``, ``global_amax=``, ``amax=``) are the API's to check."""
    if not isinstance(quant, str):
        raise TypeError(f"quant must be a format name or None; got {type(quant).__name__}")
    fmt = FORMATS.get(quant)
    if fmt is None:
        raise ValueError(f"quant must be one of {', '.join(FORMATS)}; got {quant!r}")
    if quant == "nvfp4":
        if fp8_dtype != "e4m3":
            raise ValueError(f"fp8_dtype does not apply to nvfp4 (e2m1); got {fp8_dtype!r}")
        dtype, top = E2M1, FP4_MAX
    else:
        if fp8_dtype not in FP8:
            raise ValueError(f"fp8_dtype must be 'e4m3' or 'e5m2'; got {fp8_dtype!r}")
        dtype, top = FP8[fp8_dtype]
    size = fmt.block
    if block is not None:
        if quant != "fp8_block":
            raise ValueError(f"block= applies to fp8_block only; got block={block!r} with {quant}")
        if block not in FP8_BLOCKS:
            raise ValueError(f"block must be 128 or 64; got {block!r}")
        size = int(block)
    if fmt.divides and n % size:
        raise ValueError(f"{quant} needs N to be a multiple of {size}; got N = {n}")
    if pow2_scale and quant != "fp8_block":
        raise ValueError(f"pow2_scale applies to fp8_block only; got it with {quant}")
    if scale_ub is not None:
        if quant != "fp8_row":
            raise ValueError(f"scale_ub applies to fp8_row only; got it with {quant}")
        if isinstance(scale_ub, bool) or not isinstance(scale_ub, (int, float, numpy.floating)):
            raise TypeError(f"scale_ub must be a positive float; got {type(scale_ub).__name__}")
        scale_ub = _checks._finite(scale_ub, "scale_ub", " and positive")
        if not scale_ub > 0:
            raise ValueError(f"scale_ub must be a positive finite float; got {scale_ub}")
    if scale_layout not in ("rows", "cublas"):
        raise ValueError(f"scale_layout must be 'rows' or 'cublas'; got {scale_layout!r}")
    if scale_layout == "cublas" and quant not in CUBLAS:
        raise ValueError(f"scale_layout='cublas' is for {' and '.join(CUBLAS)}; got {quant}")
    return Spec(quant, size, dtype, top, scale_layout, bool(pow2_scale), scale_ub)


# The Store's template codes (kernels/policy.cuh QuantFormat, QuantOption).
CODES = {"fp8": 1, "fp8_row": 2, "fp8_block": 3, "mxfp8": 4, "nvfp4": 5}
E5M2_BIT, POW2_BIT, CUBLAS_BIT = 1, 2, 4
OPTIONS = ("fp8_dtype", "block", "pow2_scale", "scale_ub", "scale_layout")  # spec's keywords
OPERANDS = ("scale", "global_amax", "amax")  # a call's arrays or values besides


def store_args(s: Spec) -> dict:
    """The quantizing Store's template arguments (QF, QB, QO) of a checked spec."""
    bits = (E5M2_BIT if s.dtype == E5M2 else 0) | (POW2_BIT if s.pow2_scale else 0)
    bits |= CUBLAS_BIT if s.scale_layout == "cublas" else 0
    return {"QF": CODES[s.name], "QB": s.block or 0, "QO": bits}


def outputs(s: Spec, shape: tuple) -> tuple:
    """((data shape, data dtype), (scale shape, scale dtype)) of y of ``shape`` quantized by
    ``s``, as the kernels store them: elements and byte scales as uint8 (CuPy has no float8
    dtype: the bits of ``s.dtype``, fp4 two a byte), float32 scales; "fp8"'s scale is the
    caller's (None here)."""
    n = shape[-1]
    lead = shape[:-1]
    data = ((*lead, n // 2) if s.name == "nvfp4" else tuple(shape), numpy.dtype(numpy.uint8))
    if s.name == "fp8":
        return data, None
    byte = s.name in ("mxfp8", "nvfp4")
    dtype = numpy.dtype(numpy.uint8 if byte else numpy.float32)
    blocks = s.blocks(n)
    if s.scale_layout == "cublas":
        rows = 1
        for d in lead:
            rows *= d
        return data, (cublas_shape(rows, blocks), dtype)
    return data, ((*lead, blocks), dtype)


def split_options(options: dict) -> tuple[dict, dict]:
    """A call's ``quant=`` keywords as (spec's options, operands); TypeError naming any other."""
    unknown = sorted(set(options) - set(OPTIONS) - set(OPERANDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r} (quant= takes "
                        f"{', '.join(OPTIONS + OPERANDS)})")  # fmt: skip
    return ({k: v for k, v in options.items() if k in OPTIONS},
            {k: v for k, v in options.items() if k in OPERANDS})  # fmt: skip


GIVEN = {"fp8": "scale", "nvfp4": "global_amax"}  # the scalar operand a format requires


def needed(s: Spec, operands: dict) -> None:
    """The call's operands are those its format takes: "fp8" a ``scale`` (and an optional
    ``amax``), "nvfp4" a ``global_amax``, the others none; ValueError naming the one missing or
    out of place."""
    takes = {"fp8": ("scale", "amax"), "nvfp4": ("global_amax",)}.get(s.name, ())
    for name, value in operands.items():
        if value is not None and name not in takes:
            raise ValueError(f"{name}= applies to {FOR[name]} only; got it with quant={s.name!r}")
    required = GIVEN.get(s.name)
    if required is not None and operands.get(required) is None:
        raise ValueError(f"quant={s.name!r} needs {required}= (a float, or a 0-d float32 array "
                         "on x's device)")  # fmt: skip


def checked(quant, options: dict, n: int, out_dtype=None) -> tuple[Spec, dict]:
    """(spec, operands) of a call's ``quant=`` and its keywords over rows of ``n``, every one
    checked by name (``out_dtype`` does not go with a quantized y); the front ends check their
    own arrays among the operands."""
    opts, operands = split_options(options)
    s = spec(quant, n, **opts)
    needed(s, operands)
    if out_dtype is not None:
        raise ValueError(f"out_dtype does not apply with quant={quant!r}: the format is y's type")
    return s, operands


def scalar(value, name: str, array: str) -> float:
    """A scalar operand given as a number: the finite float (TypeError for anything else; the
    front end has taken its own ``array`` kind first)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, numpy.floating)):
        raise TypeError(f"{name} must be a float or a 0-d float32 {array}; got "
                        f"{type(value).__name__}")  # fmt: skip
    return _checks._finite(value, name)


def zero_d(a, name: str, kind: str, is_array, exc=ValueError, number_ok: bool = False) -> None:
    """``a`` is a 0-d float32 array of the front end (``is_array``; ``kind``, its word for one),
    else ``exc`` naming it and what came (``number_ok``: the operand may be a float instead)."""
    shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", type(a).__name__)
    if not is_array(a) or tuple(shape) != () or str(dtype).rsplit(".", 1)[-1] != "float32":
        what = "a float or a 0-d" if number_ok else "a 0-d"
        got = f"{dtype} of shape {tuple(shape)}" if shape is not None else dtype
        raise exc(f"{name} must be {what} float32 {kind}; got {got}")


def scalar_operand(s: Spec, operands: dict, is_array, kind: str) -> tuple:
    """(name, array, number) of the format's scalar operand (GIVEN; name None where it takes
    none): an array of the front end (``is_array``) checked 0-d float32, with number 0.0; a
    number checked finite, with array None; (None, 0.0) where it is absent."""
    name = GIVEN.get(s.name)
    given = operands.get(name)
    if given is None:
        return name, None, 0.0
    if not is_array(given):
        return name, None, scalar(given, name, kind)
    zero_d(given, name, kind, is_array, number_ok=True)
    return name, given, 0.0


def launch_value(s: Spec, value: float) -> float:
    """The float the kernels take beside the scalar operand's pointer: fp8_row's ``scale_ub``
    (0: none), else the operand given as a number."""
    return (s.scale_ub or 0.0) if s.name == "fp8_row" else value


FOR = {"scale": "quant='fp8'", "amax": "quant='fp8'", "global_amax": "quant='nvfp4'"}


def cublas_shape(rows: int, blocks: int) -> tuple[int, int]:
    """The padded 2-D shape of the 128x4-tiled scales of ``rows`` x ``blocks``."""
    return -(-rows // 128) * 128, -(-blocks // 4) * 4


def cublas_offset(r, c, blocks: int):
    """Where the scale of row ``r``, block ``c`` lies in the flattened 128x4-tiled layout: tiles
    of 128 rows x 4 blocks in row-major order of tiles, each 512 bytes holding its rows r as
    (r % 32, r // 32 % 4) and its blocks c % 4 innermost (NumPy integers or arrays)."""
    tiles_per_row = -(-blocks // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
