// cupyln/kernels/policy.cuh -- the operands around the norm, as policies the tiers take.
//
// Every dense kernel is a tier (how a row is held and reduced: registers, a cluster, a ring,
// a stream, a row) over two policies, its first two template arguments:
//   * Load<T, TR, TH>: what the row is. x of T; with a residual (TR not void), h = x + res
//     (res of TR, added in the arithmetic type, rounded to TH), stored as it is read, and
//     normalized in its place. In the backward, TR not void: dx gains the gradient dh that
//     reaches h along the residual stream (of T).
//   * Store<RMS, TY, TW, TB>: what the norm writes. The statistics (LayerNorm: mean and
//     rstd = 1 / sqrt(var + eps); RMS: rstd = 1 / sqrt(mean(x^2) + eps) alone) and
//     y = xhat * w + b of TY (RMS: xhat = x * rstd, and no b), w of TW and b of TB. A TW or TB
//     of void: no such operand, known when compiling (the tiers that specialize on it); else
//     nullptr at run time says none. In the backward, dy is of TY.
// A new operand or output format is a new policy (or a field of one) and its tests; the tiers
// call the policy's functions where they read a row or write one, and learn nothing of it.
// The plans name both policies (cupyln/_plans/common.py renders them from a kernel record).
#pragma once
#include "common.cuh"

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

template <bool RMS_, typename TY, typename TW, typename TB>
struct Store {
  static constexpr bool RMS = RMS_;
  typedef TY Y;  // y's elements
  typedef TW W;  // the scale's, void: none
  typedef TB B;  // the shift's, void: none
  static constexpr bool HAS_W = !Same<TW, void>::value;
  static constexpr bool HAS_B = !Same<TB, void>::value;

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
  // (either nullptr: none), stored at dst (normalize_store).
  template <typename A, int VEC, typename S>
  static __device__ __forceinline__ void apply(const Pack<S, VEC>& pk, const A k, const A m,
                                               const A rs, const TW* __restrict__ w,
                                               const TB* __restrict__ b, const int col,
                                               TY* __restrict__ dst) {
    normalize_store<TY, TW, TB, A, VEC>(pk, k, m, rs, w, b, col, dst);
  }
};

// The Store of a kernel that writes no y of its own (ln_fwd_add): x's type throughout.
template <typename LD>
using NoStore = Store<false, typename LD::X, typename LD::X, typename LD::X>;

}  // namespace cupyln
