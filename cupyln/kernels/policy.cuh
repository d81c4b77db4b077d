// cupyln/kernels/policy.cuh -- the operands around the norm, as policies the tiers take.
//
// Every dense kernel is a tier (how a row is held and reduced: registers, a cluster, a ring,
// a stream, a row) over two policies, its first two template arguments:
//   * Load<T, TR, TH>: what the row is. x of T; with a residual (TR not void), h = x + res
//     (res of TR, added in the arithmetic type, rounded to TH), stored as it is read, and
//     normalized in its place. In the backward, TR not void: dx gains the gradient dh that
//     reaches h along the residual stream (of T).
//   * Store<RMS, TY, TW, TB, QF, QB, QO>: what the norm writes. The statistics (LayerNorm:
//     mean and rstd = 1 / sqrt(var + eps); RMS: rstd = 1 / sqrt(mean(x^2) + eps) alone) and
//     y = xhat * w + b of TY (RMS: xhat = x * rstd, and no b), w of TW and b of TB. A TW or TB
//     of void: no such operand, known when compiling (the tiers that specialize on it); else
//     nullptr at run time says none. In the backward, dy is of TY. QF, a quantized output
//     format (QuantFormat; TY is then its bytes), QB the elements a scale covers, QO its options
//     (QuantOption): y is quantized in the same pass (Store::write, by the tiers that hold a row).
// A new operand or output format is a new policy (or a field of one) and its tests; the tiers
// call the policy's functions where they read a row or write one, and learn nothing of it.
// The plans name both policies (cupyln/_plans/common.py renders them from a kernel record).
#pragma once
#include "common.cuh"
#include "quant.cuh"

namespace cupyln {

template <typename T, typename TR = void, typename TH = void>
struct Load {
  typedef T X;                            // x's elements (y's, dx's, dy's by default)
  typedef typename AccOf<T>::type A;      // the arithmetic type
  static constexpr bool RES = !Same<TR, void>::value;
  typedef typename choose_type<RES, TR, T>::type R;  // the residual's (x's where none)
  typedef typename choose_type<RES, TH, T>::type H;  // what the norm reads: h, or x

  // The row's first element as the norm reads it (the shift near the data): x[0], or
  // x[0] + res[0] rounded to H. (The row pointers are the tier's, __restrict__ there.)
  static __device__ __forceinline__ H first(const T* xr, const R* rr) {
    if constexpr (RES) {
      return narrow<H>(static_cast<A>(widen(xr[0])) + static_cast<A>(widen(rr[0])));
    } else {
      return xr[0];
    }
  }

  // Packs i < ITEMS of a row where held(i): out[i] = x's pack, or h's, stored at hr + col(i).
  // at(p, i) is the address of pack i of the row at p (x's at xr, res's at rr), as the tier
  // computes it. Every load is issued before the first add, so that ITEMS packs of each
  // operand are in flight.
  template <int VEC, int ITEMS, typename Held, typename At, typename Col>
  static __device__ __forceinline__ void gather(const T* xr, const R* rr, H* hr, Held held,
                                                At at, Col col, Pack<H, VEC> (&out)[ITEMS]) {
    if constexpr (RES) {
      Pack<T, VEC> px[ITEMS];
      Pack<R, VEC> pr[ITEMS];
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (held(i)) {
          px[i] = *reinterpret_cast<const Pack<T, VEC>*>(at(xr, i));
          pr[i] = *reinterpret_cast<const Pack<R, VEC>*>(at(rr, i));
        }
      }
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (held(i)) out[i] = add_residual<A>(px[i], pr[i], hr + col(i));
      }
    } else {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (held(i)) out[i] = *reinterpret_cast<const Pack<H, VEC>*>(at(xr, i));
      }
    }
  }
};

// The quantized output formats (cupyln/_formats.py; the plans pass these codes) and options.
enum QuantFormat {
  Q_NONE = 0,
  Q_FP8 = 1,
  Q_FP8_ROW = 2,
  Q_FP8_BLOCK = 3,
  Q_MXFP8 = 4,
  Q_NVFP4 = 5
};
enum QuantOption { Q_E5M2 = 1, Q_POW2 = 2, Q_CUBLAS = 4 };

// A quantized y's operands besides its elements (kernel parameters; unused without one).
struct QuantOut {
  void* scale;      // fp8_row, fp8_block: float; mxfp8, nvfp4: bytes; [M, blocks] or cuBLAS tiles
  const float* in;  // fp8: the static scale, nvfp4: the global amax (nullptr: `value`)
  float* amax;      // fp8: max|y| of the call goes here (zeroed before), or nullptr
  float value;      // fp8_row: amax's upper bound (0: none); fp8, nvfp4: as `in` where nullptr
};

template <bool RMS_, typename TY, typename TW, typename TB, int QF = Q_NONE, int QB = 0,
          int QO = 0>
struct Store {
  static constexpr bool RMS = RMS_;
  typedef TY Y;  // y's elements (a quantized y: its bytes)
  typedef TW W;  // the scale's, void: none
  typedef TB B;  // the shift's, void: none
  static constexpr bool HAS_W = !Same<TW, void>::value;
  static constexpr bool HAS_B = !Same<TB, void>::value;
  static constexpr bool QUANT = QF != Q_NONE;

  // rstd of a row from its exact mean and biased variance (rstd_of).
  template <typename A>
  static __device__ __forceinline__ A rstd(const A var, const A mean, const A eps) {
    return rstd_of<RMS>(var, mean, eps);
  }

  // Row `row`'s statistics, where stored (store_stats).
  template <typename A>
  static __device__ __forceinline__ void stats(A* mean, A* rstd, const i64 row, const A m,
                                               const A r) {
    store_stats<RMS>(mean, rstd, row, m, r);
  }

  // y = ((x - k) - m) * rs * w + b of one pack pk, columns [col, col + VEC) of w and b
  // (either nullptr: none), stored at dst (normalize_store). Plain y only.
  template <typename A, int VEC, typename S>
  static __device__ __forceinline__ void apply(const Pack<S, VEC>& pk, const A k, const A m,
                                               const A rs, const TW* __restrict__ w,
                                               const TB* __restrict__ b, const int col,
                                               TY* __restrict__ dst) {
    static_assert(!QUANT, "a quantized y is written by rows (Store::write)");
    normalize_store<TY, TW, TB, A, VEC>(pk, k, m, rs, w, b, col, dst);
  }

  // y of row `row` held as ln_fwd_reg holds it: slot i of lane t of the row's TPR threads (in a
  // block of BLOCK) is the pack at columns (i * TPR + t) * VEC, present where held(i); every
  // thread of the row calls this. Plain y: each pack through apply. Quantized: the packs that
  // share a scale are reduced to their max|y| (shuffles among the lanes of a slot, or the row's
  // reduction), the scale formed and stored once, then the elements; `seen` keeps the largest
  // |y| this thread wrote (fp8's amax, for end).
  template <int TPR, int BLOCK, int VEC, int ITEMS, typename A, typename S, typename Held>
  static __device__ __forceinline__ void write(const Pack<S, VEC> (&v)[ITEMS], const A k,
                                               const A m, const A rs, const TW* __restrict__ w,
                                             const TB* __restrict__ b, Held held, const int lane,
                                             TY* __restrict__ y, const i64 row, const int N,
                                             const QuantOut& q, float& seen) {
    if constexpr (!QUANT) {
      TY* __restrict__ yr = y + row * N;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = (i * TPR + lane) * VEC;
        if (held(i)) apply(v[i], k, m, rs, w, b, col, yr + col);
      }
    } else {
      quantize<TPR, BLOCK, VEC, ITEMS>(v, k, m, rs, w, b, held, lane, y, row, N, q, seen);
    }
  }

  // After the last row: fp8's amax, the largest `seen` of the block, into q.amax (its bits,
  // non-negative, ordered as integers). Every thread of the block calls this.
  template <int BLOCK>
  static __device__ __forceinline__ void end(const QuantOut& q, float seen) {
    if constexpr (QF == Q_FP8) {
      if (q.amax == nullptr) return;
      __shared__ float warps[BLOCK / 32];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) seen = fmaxf(seen, shfl_xor(0xffffffffu, seen, o));
      if ((threadIdx.x & 31u) == 0) warps[threadIdx.x >> 5] = seen;
      __syncthreads();
      if (threadIdx.x == 0) {
        float t = warps[0];
#pragma unroll
        for (int i = 1; i < BLOCK / 32; ++i) t = fmaxf(t, warps[i]);
        atomicMax(reinterpret_cast<int*>(q.amax), __float_as_int(t));
      }
    }
  }

 private:
  static constexpr bool E5 = (QO & Q_E5M2) != 0;

  static __device__ __forceinline__ unsigned char fp8(const float f) {
    if constexpr (E5) {
      return to_e5m2(f);
    } else {
      return to_e4m3(f);
    }
  }

  // Where the scale of block c of row r lies: [M, nb] row-major, or cuBLAS's 128x4 tiles
  // (cupyln/_formats.py cublas_offset).
  static __device__ __forceinline__ i64 scale_at(const i64 r, const int c, const int nb) {
    if constexpr ((QO & Q_CUBLAS) != 0) {
      const i64 tile = (r / 128) * ((nb + 3) / 4) + c / 4;
      return tile * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4;
    } else {
      return r * nb + c;
    }
  }

  template <int TPR, int BLOCK, int VEC, int ITEMS, typename A, typename S, typename Held>
  static __device__ __forceinline__ void quantize(const Pack<S, VEC> (&v)[ITEMS], const A k,
                                                  const A m, const A rs, const TW* __restrict__ w,
                                                  const TB* __restrict__ b, Held held,
                                                  const int lane, TY* __restrict__ y,
                                                  const i64 row, const int N, const QuantOut& q,
                                                  float& seen) {
    constexpr bool ROW = QF == Q_FP8_ROW;
    constexpr bool BLOCKED = QF == Q_FP8_BLOCK || QF == Q_MXFP8 || QF == Q_NVFP4;
    static_assert(!BLOCKED || QB % VEC == 0, "a scale's block holds whole packs");
    constexpr int PB = BLOCKED ? QB / VEC : 1;  // packs a block scale covers
    // L lanes of a slot share a scale, over G consecutive slots: a block's packs (BLOCKED), the
    // whole row (ROW), or each pack alone (fp8: the scale is the caller's)
    constexpr int L = ROW ? TPR : (PB <= TPR ? PB : TPR);
    constexpr int G = ROW ? ITEMS : (PB <= TPR ? 1 : PB / TPR);
    // a block's lanes: inside a warp, the row's, or whole warps of a row of a block (L > 32,
    // reduced through shared memory at a named barrier of their own)
    constexpr bool WARPS = PB % 32 == 0 && TPR == BLOCK && BLOCK % PB == 0 && BLOCK / PB <= 15;
    static_assert(!BLOCKED || (PB <= TPR ? (PB <= 32 || PB == TPR || WARPS) : PB % TPR == 0),
                  "a block's lanes");
    static_assert(QF != Q_NVFP4 || VEC % 2 == 0, "fp4 elements pair up in bytes");
    constexpr bool KEEP = G == 1;  // a slot's values kept between the max and the stores
    constexpr float TOP = E5 ? 57344.0f : 448.0f;
    const int nb = ROW ? 1 : (N + QB - 1) / QB;
    __shared__ float red[BLOCK / 32];  // a row's max across warps (L == TPR > 32)
    float given = 1.0f;                // fp8's scale, nvfp4's global amax
    if constexpr (QF == Q_FP8 || QF == Q_NVFP4) given = q.in != nullptr ? *q.in : q.value;
    float big = 1.0f;  // nvfp4: S = 448 * 6 / global amax (1 where it is 0)
    if constexpr (QF == Q_NVFP4) big = given != 0.0f ? 2688.0f / given : 1.0f;

#pragma unroll
    for (int g = 0; g < (ITEMS + G - 1) / G; ++g) {
      A keep[KEEP ? VEC : 1];
      float amax = 0.0f;
      if constexpr (QF != Q_FP8) {
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int i = g * G + j;
          if (i < ITEMS && held(i)) {
            A o[VEC];
            normalize_values<TW, TB, A, VEC>(v[i], k, m, rs, w, b, (i * TPR + lane) * VEC, o);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              amax = fmaxf(amax, fabsf(static_cast<float>(o[e])));
              if constexpr (KEEP) keep[e] = o[e];
            }
          }
        }
        if constexpr (L == TPR || L > 32) {  // the row's lanes, or whole warps of a row
          amax = group_max<L, BLOCK>(amax, red + threadIdx.x / L * (L > 32 ? L / 32 : 0));
        } else {  // a slice of the row's lanes in a warp
          unsigned mask = 0xffffffffu;
          if constexpr (TPR < 32) mask = ((1u << TPR) - 1u) << ((threadIdx.x & 31u) / TPR * TPR);
#pragma unroll
          for (int o = L / 2; o > 0; o /= 2) amax = fmaxf(amax, shfl_xor(mask, amax, o));
        }
      }
      // the scale, stored by the block's first lane; y is multiplied by mul / div
      float mul = 1.0f, div = 1.0f;
      const int first = g * G;
      const bool writes = lane % L == 0 && first < ITEMS && held(first);
      const i64 at = scale_at(row, BLOCKED ? (first * TPR + lane) * VEC / (QB > 0 ? QB : 1) : 0,
                              nb);  // (ROW: nb = 1)
      if constexpr (QF == Q_FP8) {
        div = given;
      } else if constexpr (QF == Q_FP8_ROW || QF == Q_FP8_BLOCK) {
        float a = amax;
        if constexpr (ROW) a = q.value > 0.0f ? fminf(a, q.value) : a;
        float s = fmaxf(a, 1e-12f) / TOP;
        if constexpr ((QO & Q_POW2) != 0) s = pow2_at_least(s);
        if (writes) static_cast<float*>(q.scale)[at] = s;
        div = s;
      } else if constexpr (QF == Q_MXFP8) {
        const unsigned char e = e8m0_of<E5 ? 16 : 9>(amax);
        if (writes) static_cast<unsigned char*>(q.scale)[at] = e;
        mul = inv_scale_of_e8m0(e);
      } else {
        const unsigned char sb = to_e4m3(amax / 6.0f * big);
        if (writes) static_cast<unsigned char*>(q.scale)[at] = sb;
        const float sv = from_e4m3(sb);
        mul = sv > 0.0f ? big : 0.0f;  // a block whose scale is 0: zero elements (+0)
        div = sv > 0.0f ? sv : 1.0f;
      }
      const bool zero = QF == Q_NVFP4 && mul == 0.0f;
      const float factor = mul / div;  // y times one rounded factor, not divided per element
#pragma unroll
      for (int j = 0; j < G; ++j) {
        const int i = g * G + j;
        if (i < ITEMS && held(i)) {
          const int col = (i * TPR + lane) * VEC;
          A o[VEC];
          if constexpr (KEEP && QF != Q_FP8) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) o[e] = keep[e];
          } else {
            normalize_values<TW, TB, A, VEC>(v[i], k, m, rs, w, b, col, o);
          }
          float f[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const float yv = static_cast<float>(o[e]);
            if constexpr (QF == Q_FP8) seen = fmaxf(seen, fabsf(yv));
            f[e] = yv * factor;
          }
          store_codes<VEC>(f, zero, y + row * (QF == Q_NVFP4 ? N / 2 : N) +
                                        (QF == Q_NVFP4 ? col / 2 : col));
        }
      }
    }
  }

  // A pack's scaled values f as codes at dst (fp8 bytes, or fp4 pairs), in 32-bit words where
  // the pack fills them; `zero`: codes of +0 instead (an NVFP4 block whose scale is 0).
  template <int VEC>
  static __device__ __forceinline__ void store_codes(const float (&f)[VEC], const bool zero,
                                                     TY* __restrict__ dst) {
    constexpr int BYTES = QF == Q_NVFP4 ? VEC / 2 : VEC;
    if constexpr (BYTES % 4 == 0) {
      Pack<unsigned int, BYTES / 4> pk;
#pragma unroll
      for (int j = 0; j < BYTES / 4; ++j) {
        unsigned int word;
        if constexpr (QF == Q_NVFP4) {
          word = 0u;
#pragma unroll
          for (int e = 0; e < 8; ++e) word |= to_e2m1(f[8 * j + e]) << (4 * e);
        } else {
          word = static_cast<unsigned int>(to_fp8x2<E5>(f[4 * j], f[4 * j + 1])) |
                 (static_cast<unsigned int>(to_fp8x2<E5>(f[4 * j + 2], f[4 * j + 3])) << 16);
        }
        pk.v[j] = zero ? 0u : word;
      }
      *reinterpret_cast<Pack<unsigned int, BYTES / 4>*>(dst) = pk;
    } else {
      Pack<unsigned char, BYTES> pk;
#pragma unroll
      for (int e = 0; e < BYTES; ++e) {
        if constexpr (QF == Q_NVFP4) {
          pk.v[e] = zero ? 0u : pack_e2m1(f[2 * e], f[2 * e + 1]);
        } else if constexpr (BYTES % 2 == 0) {
          pk.v[e] = static_cast<unsigned char>(to_fp8x2<E5>(f[e & ~1], f[e | 1]) >> (8 * (e & 1)));
        } else {
          pk.v[e] = fp8(f[e]);
        }
      }
      *reinterpret_cast<Pack<unsigned char, BYTES>*>(dst) = pk;
    }
  }
};

// The Store of a kernel that writes no y of its own (ln_fwd_add): x's type throughout.
template <typename LD>
using NoStore = Store<false, typename LD::X, typename LD::X, typename LD::X>;

}  // namespace cupyln
