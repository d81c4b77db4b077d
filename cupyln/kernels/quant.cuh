// cupyln/kernels/quant.cuh -- float32 to the elements and scales of the quantized output
// formats (cupyln/_formats.py), rounded to nearest even and saturating.
//
//   * to_e4m3 / to_e5m2: one fp8 byte (largest 448 / 57344; beyond, infinities included, the
//     largest of the sign; NaN gives the format's NaN, 0x7f or 0xff);
//   * to_e2m1: one fp4 code in the low nibble (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives;
//     beyond 6 the largest); pack_e2m1: two codes a byte, the first in the low nibble;
//   * e8m0_of: the biased exponent of an MX block scale, 2^ceil(log2(amax / top)) with top =
//     448 or 57344 (0 for an all-zero block, 254 for infinity, 0xff for NaN), and
//     inv_scale_of_e8m0: the power of two that a block's values are multiplied by;
//   * from_e4m3: an e4m3 scale's value (NVFP4's block scales); pow2_at_least: a scale rounded up
//     to a power of two.
//
// The fp8 bytes are formed on the bits of the float, exact on every architecture from sm_80 on;
// to_fp8x2 converts a pair with sm_89's instruction for the same rounding where it exists.
// Arithmetic before them is the caller's (y / s or y * 1/s).
#pragma once

namespace cupyln {

// |f|'s bits rounded to nearest even at mantissa bit SHIFT (the field below it dropped),
// rebiased from float32's exponent bias to BIAS: the code of a normal number of the format.
template <int SHIFT, int BIAS>
__device__ __forceinline__ unsigned int round_bits(const unsigned int mag) {
  const unsigned int r = mag + ((1u << (SHIFT - 1)) - 1u) + ((mag >> SHIFT) & 1u);
  return (r >> SHIFT) - (static_cast<unsigned int>(127 - BIAS) << (23 - SHIFT));
}

// An fp8 byte of MANT mantissa bits and exponent bias BIAS: normal from 2^(1 - BIAS), subnormal
// in steps of 2^(1 - BIAS - MANT); past the largest value (bits TOP of the float) the largest
// code TOP_CODE; NaN 0x7f.
template <int MANT, int BIAS, unsigned int TOP, unsigned int TOP_CODE>
__device__ __forceinline__ unsigned char to_fp8(const float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 24) & 0x80u;
  const unsigned int mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7fu);
  if (mag > TOP) return static_cast<unsigned char>(sign | TOP_CODE);
  if (mag >= (127u + 1u - BIAS) << 23) {
    return static_cast<unsigned char>(sign | round_bits<23 - MANT, BIAS>(mag));
  }
  const float steps = __uint_as_float((127u + BIAS - 1u + MANT) << 23);  // exact: 2^k
  const unsigned int q = static_cast<unsigned int>(rintf(__uint_as_float(mag) * steps));
  return static_cast<unsigned char>(sign | q);
}

// e4m3: largest 448 (0x43e00000), code 0x7e; e5m2: largest 57344 (0x47600000), code 0x7b.
__device__ __forceinline__ unsigned char to_e4m3(const float f) {
  return to_fp8<3, 7, 0x43e00000u, 0x7eu>(f);
}
__device__ __forceinline__ unsigned char to_e5m2(const float f) {
  return to_fp8<2, 15, 0x47600000u, 0x7bu>(f);
}

// Two fp8 bytes, lo's in the low byte: sm_89 and newer convert a pair in one instruction
// (cvt.rn.satfinite: nearest even, saturating, as to_fp8); older GPUs take to_fp8 twice.
template <bool E5M2>
__device__ __forceinline__ unsigned short to_fp8x2(const float lo, const float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short r;
  if constexpr (E5M2) {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(r) : "f"(lo), "f"(hi));
  } else {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(r) : "f"(lo), "f"(hi));
  }
  return r;
#else
  if constexpr (E5M2) {
    return to_fp8<2, 15, 0x47600000u, 0x7bu>(lo) | (to_fp8<2, 15, 0x47600000u, 0x7bu>(hi) << 8);
  } else {
    return to_fp8<3, 7, 0x43e00000u, 0x7eu>(lo) | (to_fp8<3, 7, 0x43e00000u, 0x7eu>(hi) << 8);
  }
#endif
}

// e2m1: bias 1, 1 mantissa bit, normal from 1, subnormal step 0.5; NaN gives 0 (none in e2m1).
// |f| clamped to 6 lies in a binade of step 0.5 (below 2), 1 (below 4) or 2, the steps of its
// exponent e = 0, 1, 2 past 1: the code is e * 2 plus |f| / step rounded to an integer, which
// the add of 2^23 does (nearest even), in ten instructions without a branch.
__device__ __forceinline__ unsigned int to_e2m1(const float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 28) & 0x8u;
  const float a = fminf(fabsf(f), 6.0f);
  const unsigned int eb = max(__float_as_uint(a) >> 23, 127u);  // 127 + e
  const float inv_step = __uint_as_float((255u - eb) << 23);     // 2^(1 - e)
  const unsigned int q = __float_as_uint(fmaf(a, inv_step, 8388608.0f)) - 0x4b000000u;
  const unsigned int code = (q + 2u * eb - 254u) | sign;
  return (u & 0x7fffffffu) > 0x7f800000u ? 0u : code;
}

__device__ __forceinline__ unsigned char pack_e2m1(const float first, const float second) {
  return static_cast<unsigned char>(to_e2m1(first) | (to_e2m1(second) << 4));
}

// The E8M0 byte of a block whose largest magnitude is amax (>= 0), for elements whose largest
// value is top = 0.875 * 2^TOP_EXP (448: 9, 57344: 16): the least e with amax <= top * 2^e,
// clamped to [-127, 127], biased by 127; decided exactly on amax's exponent and mantissa
// (amax = 1.f * 2^E exceeds 0.875 * 2^(E + 1) where f > 0.75). Zero and subnormal amax give
// 0 (2^-127), NaN 0xff.
template <int TOP_EXP>
__device__ __forceinline__ unsigned char e8m0_of(const float amax) {
  const unsigned int u = __float_as_uint(amax);
  if (u > 0x7f800000u) return 0xffu;
  if (u == 0x7f800000u) return 254u;  // infinite: no e covers it, the largest
  if (u < 0x00800000u) return 0u;
  int e = static_cast<int>(u >> 23) - 127 + 1 - TOP_EXP + ((u & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return static_cast<unsigned char>(e + 127);
}

// 1 / 2^(byte - 127) of an E8M0 byte other than 0xff, a normal float (byte 254: 2^-126), by
// which a block's values are multiplied: exact, as the division by the scale, and finite
// where the scale is a subnormal float (byte 0: a block of zeros, or of values below
// 448 * 2^-127).
__device__ __forceinline__ float inv_scale_of_e8m0(const unsigned char byte) {
  const unsigned int b = byte > 253u ? 253u : byte;
  return __uint_as_float((254u - b) << 23);
}

// The value of an e4m3 byte that to_e4m3 gave for a non-negative float (no NaN): exact.
__device__ __forceinline__ float from_e4m3(const unsigned char byte) {
  const unsigned int e = (byte >> 3) & 0xfu, m = byte & 0x7u;
  if (e == 0) return static_cast<float>(m) * 0.001953125f;  // subnormal: m * 2^-9
  return __uint_as_float(((e + 120u) << 23) | (m << 20));
}

// The least power of two >= s, for a positive normal float s (exact, on its bits).
__device__ __forceinline__ float pow2_at_least(const float s) {
  const unsigned int u = __float_as_uint(s);
  const unsigned int up = (u & 0x7fffffu) ? (u & 0x7f800000u) + 0x00800000u : u;
  return __uint_as_float(up);
}

}  // namespace cupyln
