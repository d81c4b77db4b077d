"""kernels/quant.cuh: float32 to e4m3, e5m2, e2m1 and E8M0 on the GPU, against ml_dtypes'
rounding (saturated first, as the formats' rule says) and the reference's E8M0 rule; fp8
pairs (to_fp8x2: sm_89's instruction) byte for byte as the single conversions.

CPU tier: NVRTC builds the conversions for every supported architecture. GPU tier: every
float32 at the formats' edges (each boundary, the ties either side of it, subnormals, zeros,
infinities, NaN) and random floats over the whole exponent range, converted in one kernel and
compared code for code."""

import ml_dtypes
import numpy as np
import pytest

from cupyln import _compile
from cupyln._plans.devices import ARCHS

from .conftest import requires_gpu

PROBE = r"""
extern "C" __global__ void quant_probe(const float* x, unsigned char* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float f = x[i];
  out[i] = cupyln::to_e4m3(f);
  out[n + i] = cupyln::to_e5m2(f);
  out[2 * n + i] = static_cast<unsigned char>(cupyln::to_e2m1(f));
  out[3 * n + i] = cupyln::e8m0_of<9>(fabsf(f));
  out[4 * n + i] = cupyln::e8m0_of<16>(fabsf(f));
  const float inv = cupyln::inv_scale_of_e8m0(out[3 * n + i]);
  out[5 * n + i] = out[3 * n + i] == 0xffu ? 0 : cupyln::to_e4m3(f * inv);
  if (i == 0) out[6 * n] = cupyln::pack_e2m1(0.5f, -6.0f);
  // pairs (sm_89 and newer: one instruction each), f in the low byte and -f in the high one
  const unsigned short e4 = cupyln::to_fp8x2<false>(f, -f), e5 = cupyln::to_fp8x2<true>(f, -f);
  unsigned char* pairs = out + 6 * n + 1 + 4 * i;
  pairs[0] = e4 & 0xffu;
  pairs[1] = e4 >> 8;
  pairs[2] = e5 & 0xffu;
  pairs[3] = e5 >> 8;
}
"""


def probe_source() -> str:
    return _compile.source("quant.cuh")[0] + PROBE


@pytest.mark.parametrize("arch", list(ARCHS))
def test_conversions_compile(arch):
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(probe_source(), "quant_probe.cu", (), ())
    try:
        opts = _compile.OPTIONS + _compile.CUPY_OPTIONS + (f"-arch=sm_{arch}",)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as err:
            raise AssertionError(nvrtc.getProgramLog(prog)) from err
    finally:
        nvrtc.destroyProgram(prog)


def edge_floats() -> np.ndarray:
    """Each format's boundaries and the floats either side of them, the ties between
    neighbouring codes, subnormals, zeros, infinities and NaN, both signs; and random floats
    of every exponent."""
    points = [0.0, 2.0**-150, 2.0**-126, 1.0, 448.0, 464.0, 480.0, 57344.0, 61440.0, 6.0, 7.0,
              2.0**-6, 2.0**-9, 2.0**-10, 2.0**-14, 2.0**-16, 2.0**-17, 0.25, 0.5, 0.75, 5.0,
              3.5, 1.0625, 448.0 * 2.0**-127, 448.0 * 2.0**100, 3.4e38]  # fmt: skip
    e4 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e5 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e5m2).astype(np.float32)
    grid = np.concatenate([e4, e5, np.float32(points)])
    grid = grid[np.isfinite(grid)]
    with np.errstate(over="ignore"):  # 3.4e38 * 1.75: infinity, kept as such
        mids = (grid[:, None] * np.float32([0.5, 0.75, 1.0, 1.25, 1.5, 1.75])).ravel()
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf)), mids])  # fmt: skip
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
    special = np.float32([np.inf, -np.inf, np.nan])
    return np.concatenate([near, -near, bits.view(np.float32), special]).astype(np.float32)


def expected(x: np.ndarray) -> dict:
    def cast(v, dtype, top):
        return np.clip(v, -top, top).astype(dtype).view(np.uint8)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        out = {
            "e4m3": cast(x, ml_dtypes.float8_e4m3fn, 448.0),
            "e5m2": cast(x, ml_dtypes.float8_e5m2, 57344.0),
            "e2m1": cast(x, ml_dtypes.float4_e2m1fn, 6.0) & 0xF,
        }
        a = np.abs(x.astype(np.float64))
        for name, top in (("e8m0_448", 448.0), ("e8m0_57344", 57344.0)):
            mant, exp = np.frexp(a / top)
            e = np.clip(np.where(mant == 0.5, exp - 1, exp), -127, 127)
            byte = np.where(a < 2.0**-126, 0, e + 127)  # zero and subnormal: 0
            byte = np.where(np.isinf(a), 254, np.where(np.isnan(a), 255, byte))
            out[name] = byte.astype(np.uint8)
    return out


@pytest.mark.gpu
@requires_gpu
def test_conversions_match_the_formats_rounding():
    import cupy

    x = edge_floats()
    n = x.size
    mod = cupy.RawModule(code=probe_source(), options=_compile.OPTIONS)
    k = mod.get_function("quant_probe")
    out = cupy.full(10 * n + 1, 0xAB, dtype=cupy.uint8)  # poisoned
    k(((n + 255) // 256,), (256,), (cupy.asarray(x), out, np.int32(n)))
    got = out.get()
    want = expected(x)
    nan = np.isnan(x)
    names = ("e4m3", "e5m2", "e2m1", "e8m0_448", "e8m0_57344")
    for j, name in enumerate(names):
        g = got[j * n : (j + 1) * n]
        w = want[name]
        if name in ("e4m3", "e5m2"):  # NaN: the format's NaN with x's sign
            assert np.all(g[nan] & 0x7F == 0x7F), name
        if name == "e2m1":  # no NaN in e2m1: 0
            assert np.all(g[nan] == 0), name
        bad = np.flatnonzero((g != w) & ~nan)
        assert bad.size == 0, (f"{name}: {bad.size} of {n} differ, e.g. x = {x[bad[:5]]!r}: "
                               f"{g[bad[:5]]!r} != {w[bad[:5]]!r}")  # fmt: skip
    # MX: x times the block's inverse scale lands within e4m3 (never past 448), as the reference
    fin = np.isfinite(x) & (np.abs(x) >= 2.0**-126)
    mx = got[5 * n : 6 * n][fin].view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.all(np.isfinite(mx)) and np.all(np.abs(mx) <= 448.0)
    assert got[6 * n] == 0x1 | (0xF << 4)  # 0.5 in the low nibble, -6 in the high one
    # the pairs: each byte the single conversion's, of x and of -x
    pairs = got[6 * n + 1 :].reshape(n, 4)
    with np.errstate(invalid="ignore", over="ignore"):
        negated = expected(-x)
    for j, (name, want_of) in enumerate((("e4m3", want), ("e4m3", negated), ("e5m2", want),
                                         ("e5m2", negated))):  # fmt: skip
        bad = np.flatnonzero((pairs[:, j] != want_of[name]) & ~nan)
        assert bad.size == 0, (f"pair byte {j} ({name}): {bad.size} differ, e.g. x = "
                               f"{x[bad[:5]]!r}")  # fmt: skip
