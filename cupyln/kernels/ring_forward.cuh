// cupyln/kernels/ring_forward.cuh -- the staging-ring forward over sequences of rows, and the
// column-walk helpers around it.
//
// A group of GROUP threads (a block, or a warp) normalizes a contiguous range of sequences,
// each sequence one or more whole rows normalized together: a jagged batch's sequences
// (jagged.cu's short path, jag_fwd_short) or the rows of a dense batch, each its own sequence
// (layer_norm_fwd_staged.cu's ring tier, ln_fwd_ring). The group copies its next sequences into its
// ring in shared memory with cp.async (ring.cuh) while it reduces and writes the current one,
// so HBM never waits for a sequence's arithmetic; x is read once and y written once.
// Statistics: the mean, then the corrected two-pass variance of x minus it, both from the
// staged copy (exact for large-mean data).
// Limits: a staged sequence fits the group's ring (the host's plan sees to it); longer ones
// are left to the caller (long_path) or walked from global memory by the group.
#pragma once
#include "common.cuh"
#include "ring.cuh"

namespace cupyln {

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> ld(const T* __restrict__ p, const i64 v) {
  return reinterpret_cast<const Pack<T, VEC>*>(p)[v];
}

// Loads VEC weights (or bias values) for columns [c, c + VEC): 1 when absent.
template <typename A, typename TW, int VEC>
__device__ __forceinline__ void load_cols(const TW* __restrict__ w, const int c, const A none,
                                          A (&out)[VEC]) {
  if (w != nullptr) {
    load_pack<A, TW, VEC>(w + c, out);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = none;
  }
}

// The column (in vectors) of vectors v = start, start + stride, ... of rows of dv vectors,
// one call of next() per vector in that order: no division inside the loops.
struct ColumnWalk {
  int c, step, dv;
  __device__ __forceinline__ ColumnWalk(const int start, const int stride, const int dv_)
      : c(start % dv_), step(stride % dv_), dv(dv_) {}
  __device__ __forceinline__ int next() {
    const int r = c;
    c += step;
    if (c >= dv) c -= dv;
    return r;
  }
};

// ============================================================================ forward
// Walks from global memory, by the S threads of a group (t: this thread's index in it; thread t
// owns vectors t, t + S, ...), with U loads in flight:
// Sum of (x - k) over the nv vectors of p[0 .. nv*VEC). The shift k (the share's first
// element) keeps large-mean data exact, as in layer_norm_fwd.cu.
template <typename T, typename A, int VEC, int S, int U = 4>
__device__ __forceinline__ A sum_vectors(const T* __restrict__ p, const i64 nv, const A k0,
                                         const int t) {
  A sum = 0;
  walk_vectors<T, VEC, S, U>(p, nv, t, [&](i64, const Pack<T, VEC>& pk) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum += widen_at<A>(pk, k) - k0;
  });
  return sum;
}

// Sum of ((x - k) - mu)^2 over the same vectors.
template <typename T, typename A, int VEC, int S, int U = 4>
__device__ __forceinline__ A sq_dev_vectors(const T* __restrict__ p, const i64 nv, const A k0,
                                            const A mu, const int t) {
  A sq = 0;
  walk_vectors<T, VEC, S, U>(p, nv, t, [&](i64, const Pack<T, VEC>& pk) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A d = (widen_at<A>(pk, k) - k0) - mu;
      sq += d * d;
    }
  });
  return sq;
}

// y = ((x - k) - mu) * rs * w + b for one pack pk of x (the columns col.next() gives, when w
// or b is present), stored at dst of TY. M is the type of k and mu: A with the share's shift,
// or double (k = 0, mu the exact mean) where no shift is at hand.
template <typename T, typename TY, typename TW, typename TB, typename A, typename M, int VEC>
__device__ __forceinline__ void apply_pack(const Pack<T, VEC>& pk, ColumnWalk& col, const M k0,
                                           const M mu, const A rs, const TW* __restrict__ w,
                                           const TB* __restrict__ b, TY* __restrict__ dst) {
  A wv[VEC], bv[VEC], out[VEC];
  if (w != nullptr || b != nullptr) {
    const int c = col.next() * VEC;
    load_cols<A, TW, VEC>(w, c, A(1), wv);
    load_cols<A, TB, VEC>(b, c, A(0), bv);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) wv[k] = A(1), bv[k] = A(0);
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const M xk = static_cast<M>(widen_at<A>(pk, k));
    out[k] = static_cast<A>((xk - k0) - mu) * rs * wv[k] + bv[k];
  }
  store_pack<TY, A, VEC>(dst, out);
}

// apply_pack over the nv vectors at src (row-major, D columns, starting at a row start),
// written at dst, by thread t of a group of S.
template <typename T, typename TY, typename TW, typename TB, typename A, typename M, int VEC, int S>
__device__ __forceinline__ void apply_vectors(const T* __restrict__ src, TY* __restrict__ dst,
                                              const i64 nv, const int D, const M k0, const M mu,
                                              const A rs, const TW* __restrict__ w,
                                              const TB* __restrict__ b, const int t) {
  ColumnWalk col(t, S, D / VEC);
  for (i64 v = t; v < nv; v += S) {
    apply_pack<T, TY, TW, TB, A, M, VEC>(ld<T, VEC>(src, v), col, k0, mu, rs, w, b,
                                         dst + v * VEC);
  }
}

// ---------------------------------------------------------------- staging ring (short path)
// A group of GROUP threads walks its own contiguous range of sequences (parts[g] ..
// parts[g + 1], cut by jag_partition so that every group gets about the same number of rows),
// staging them in its ring (ring.cuh) up to RING_DEPTH sequences ahead of the one it computes.

// The sequences of the ring forward: a jagged batch's offsets (int or long long), or the rows of
// a dense batch (DenseRows: sequence s is row s, no offsets array).
struct DenseRows {};

template <typename I>
__device__ __forceinline__ i64 seq_start(const I* __restrict__ off, const i64 s) {
  return static_cast<i64>(off[s]);
}
__device__ __forceinline__ i64 seq_start(const DenseRows*, const i64 s) { return s; }

// The ring forward of one group over its sequences [s_begin, s_end): sequence s is rows
// [seq_start(s), seq_start(s + 1)) of x (row i at x + i * x_pitch; a sequence of several rows
// needs x_pitch == D) and of y (contiguous). The group's ring is `ring` packs at slots.
// mean/rstd may be null (not stored). y is of TY.
template <typename T, typename TY, typename TW, typename TB, typename I, int VEC, int BLOCK,
          int GROUP>
__device__ __forceinline__ void ring_forward(
    const T* __restrict__ x, const i64 x_pitch, const I* __restrict__ off, const i64 s_begin,
    const i64 s_end, const int D, TY* __restrict__ y, const TW* __restrict__ w,
    const TB* __restrict__ b, typename AccOf<T>::type* __restrict__ mean,
    typename AccOf<T>::type* __restrict__ rstd, const typename AccOf<T>::type eps,
    const i64 cap, Pack<T, VEC>* slots, const int ring, const int long_path,
    unsigned* __restrict__ has_long, typename AccOf<T>::type* red) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  const int lane = threadIdx.x % GROUP;
  const bool stats = mean != nullptr;
  Ring<P, GROUP> r{slots, ring};
  i64 next = s_begin;  // the next sequence to stage
  for (i64 s = s_begin; s < s_end; ++s) {
    const i64 r0 = seq_start(off, s);
    const i64 cnt = (seq_start(off, s + 1) - r0) * D;
    if (cnt > cap && long_path) {  // a long sequence: the chunk kernels
      if (lane == 0) *has_long = 1u;
      continue;
    }
    if (cnt > cap) {  // longer than max_seqlen promised: walked from global memory, slowly
      const T* p = x + r0 * x_pitch;
      const i64 nv = cnt / VEC;
      const A k0 = static_cast<A>(widen(p[0]));
      const A mu = group_sum<GROUP>(sum_vectors<T, A, VEC, GROUP, 1>(p, nv, k0, lane), red) /
                   static_cast<A>(cnt);
      const A var =
          group_sum<GROUP>(sq_dev_vectors<T, A, VEC, GROUP, 1>(p, nv, k0, mu, lane), red) /
          static_cast<A>(cnt);
      const A rs = rsqrt_acc<A>(var + eps);
      if (lane == 0 && stats) {
        mean[s] = k0 + mu;
        rstd[s] = rs;
      }
      apply_vectors<T, TY, TW, TB, A, A, VEC, GROUP>(p, y + r0 * D, nv, D, k0, mu, rs, w, b,
                                                     lane);
      continue;
    }
    if (cnt == 0) {
      if (lane == 0 && stats) {
        mean[s] = A(0);
        rstd[s] = rsqrt_acc<A>(eps);
      }
      continue;
    }
    // stage s (when not yet) and up to RING_DEPTH sequences after it, as far as the ring holds
    for (; next < s_end && r.ahead <= RING_DEPTH; ++next) {
      const i64 a = seq_start(off, next), c = (seq_start(off, next + 1) - a) * D;
      if (c > cap || c == 0) continue;  // not staged (see above)
      if (!r.stage(reinterpret_cast<const P*>(x + a * x_pitch), static_cast<int>(c / VEC), lane)) {
        break;
      }
    }
    r.wait_oldest();
    const int nv = static_cast<int>(cnt / VEC);
    const A inv = A(1) / static_cast<A>(cnt);
    // pass 1: the mean of the staged sequence; pass 2: the sum and sum of squares of x minus
    // it (the corrected two-pass variance: exact for large-mean data, and for sequences whose
    // rows have means far apart)
    A sum = 0;
    for (int v = lane, i = r.wrap(r.head + lane); v < nv; v += GROUP, i = r.wrap(i + GROUP)) {
      const P pk = r.slot[i];
#pragma unroll
      for (int k = 0; k < VEC; ++k) sum += widen_at<A>(pk, k);
    }
    const A mu0 = group_sum<GROUP>(sum, red) / static_cast<A>(cnt);
    A s1 = 0, s2 = 0;
    for (int v = lane, i = r.wrap(r.head + lane); v < nv; v += GROUP, i = r.wrap(i + GROUP)) {
      const P pk = r.slot[i];
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A d = widen_at<A>(pk, k) - mu0;
        s1 += d;
        s2 += d * d;
      }
    }
    group_sum2<GROUP>(s1, s2, red);
    const A md = s1 * inv;
    const A var = s2 * inv - md * md;
    const A rs = rsqrt_acc<A>((var > A(0) ? var : A(0)) + eps);
    if (lane == 0 && stats) {
      mean[s] = mu0 + md;
      rstd[s] = rs;
    }
    // pass 3: y = ((x - mu0) - md) * rs * w + b
    TY* dst = y + r0 * D;
    ColumnWalk col(lane, GROUP, D / VEC);
    for (int v = lane, i = r.wrap(r.head + lane); v < nv; v += GROUP, i = r.wrap(i + GROUP)) {
      apply_pack<T, TY, TW, TB, A, A, VEC>(r.slot[i], col, mu0, md, rs, w, b,
                                           dst + static_cast<i64>(v) * VEC);
    }
    r.release(nv);
    group_sync<GROUP, BLOCK>();  // every thread is done with s's slots before they are reused
  }
}

// Blocks of the ring kernels asked to fit one SM (launch bounds): three of 256 threads (the
// host's rings of 74 KB), two in double; one of more threads.
template <typename T, int BLOCK>
struct RingBlocks {
  static constexpr int value = BLOCK > 256 ? 1 : sizeof(T) == 8 ? 2 : 3;
};

}  // namespace cupyln
