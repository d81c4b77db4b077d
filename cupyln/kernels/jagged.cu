// cupyln/kernels/jagged.cu -- LayerNorm over the sequences of a jagged batch.
//
// Layout: values x[total_L, D] (C-contiguous), offsets off[B+1] (int or long long, 0 = off[0]
// <= off[1] <= ... <= off[B] = total_L). Sequence s is the block of rows [off[s], off[s+1]):
// its L*D elements are normalized together (one mean and one rstd per sequence, biased
// variance, two-pass), then scaled by the per-column w and shifted by b (optional).
//
// Two paths, chosen per sequence on the GPU (the host never reads the offsets):
//   * short (L*D <= CAP elements, CAP set by the host from max_seqlen and shared memory):
//     forward: a group of threads (a block, or a warp for small sequences) walks a contiguous
//     range of sequences holding about total_L/G rows (jag_partition cuts them), staging each
//     sequence in a shared-memory ring with cp.async up to six sequences ahead of the one it
//     computes (three passes over the staged copy: mean, corrected variance, y). x is read
//     once and y written once, and the loads never wait for the arithmetic. When the host
//     knows that no sequence is long (max_seqlen, or the offsets check) it passes
//     long_path = 0 and skips the chunk kernels; a sequence longer than promised is then
//     walked from global memory by its group (right, but slow).
//     backward: one block per sequence, grid-stride over sequences; x and dy are staged in
//     shared memory as they are read. Each thread reads back only the vectors it staged, so
//     staging needs no barrier.
//   * long: the rows are cut into fixed chunks of R rows (chunk c = rows [c*R, (c+1)*R)),
//     with 2*R*D <= CAP, so a long sequence (L > 2R) never lies inside one chunk and at most
//     two long sequences touch a chunk: each chunk writes at most two partial records in its
//     own slots. A second kernel combines a long sequence's chunk records in chunk order
//     (Chan's formula for mean/M2, in double) with a fixed-order tree, so results are
//     deterministic; a third applies the statistics chunk by chunk. x is read twice there.
//     The block-per-sequence kernel raises *has_long when it skips a sequence; the chunk
//     kernels return at once when nothing was skipped.
// Statistics are exact for large-mean data: the short path sums x minus the sequence's mean
// (the corrected two-pass variance, from the staged copy), the long path x minus the share's
// first element, and applies the mean in double.
// The short path's ring forward lives in ring_forward.cuh, which the dense forward's ring tier
// (layer_norm_fwd_staged.cu, ln_fwd_ring) shares: there each row is a sequence of one row.
// Backward: dx = rstd * (w*dy - (xhat * sum(w*dy*xhat) + sum(w*dy)) / (L*D)) per sequence, by
// the same two paths; dw/db are column sums over all rows, computed by layer_norm_bwd_sums.cu's
// column kernel on per-row copies of the sequence statistics (jag_expand_stats).
// Vector access: VEC elements per access need D % VEC == 0 and x, y (dy, dx) aligned to
// VEC * sizeof(T); w/b aligned to VEC * sizeof(TW/TB) (the host copies them when not).
#include "common.cuh"
#include "ring.cuh"
#include "ring_forward.cuh"

namespace cupyln {

// The sequence holding row `row` (0 <= row < off[B]): the last s with off[s] <= row, which
// skips empty sequences.
template <typename I>
__device__ __forceinline__ i64 seq_of_row(const I* __restrict__ off, const i64 B, const i64 row) {
  i64 lo = 0, hi = B - 1;
  while (lo < hi) {
    const i64 mid = (lo + hi + 1) >> 1;
    if (static_cast<i64>(off[mid]) <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}


template <typename T, typename TW, typename TB, typename I, int VEC, int BLOCK, int GROUP>
__global__ void __launch_bounds__(BLOCK, RingBlocks<T, BLOCK>::value)
    jag_fwd_short(const T* __restrict__ x, const I* __restrict__ off, const int D,
                  T* __restrict__ y, const TW* __restrict__ w, const TB* __restrict__ b,
                  typename AccOf<T>::type* __restrict__ mean,
                  typename AccOf<T>::type* __restrict__ rstd,
                  const typename AccOf<T>::type eps, const i64 cap, const int ring,
                  const i64* __restrict__ parts, const int long_path,
                  unsigned* __restrict__ has_long) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[2 * (BLOCK / 32)];
  const i64 g = static_cast<i64>(blockIdx.x) * (BLOCK / GROUP) + threadIdx.x / GROUP;
  P* slots = reinterpret_cast<P*>(smem_raw) + (threadIdx.x / GROUP) * ring;
  ring_forward<T, T, TW, TB, I, VEC, BLOCK, GROUP>(x, D, off, parts[g], parts[g + 1], D, y, w, b,
                                                mean, rstd, eps, cap, slots, ring, long_path,
                                                has_long, red);
}


// Cuts the sequences into G contiguous ranges of about total/G rows each for the short
// kernel's groups: group q takes the sequences starting in rows [q*total/G, (q+1)*total/G)
// (trailing empty ones go to the last group), parts[q] its first sequence, parts[G] = B.
// Thread s writes parts[q] = s for each q whose range starts at s. Also clears *has_long.
template <typename I>
__global__ void __launch_bounds__(256, 1)
    jag_partition(const I* __restrict__ off, const i64 B, const i64 G, i64* __restrict__ parts,
                  unsigned* __restrict__ has_long) {
  const i64 total = off[B];
  const auto group_of = [&](const i64 s) -> i64 {  // the group of sequence s (-1 <= s <= B)
    if (s < 0) return -1;
    if (s == B) return G;
    const i64 q = total > 0 ? static_cast<i64>(off[s]) * G / total : G - 1;
    return q < G - 1 ? q : G - 1;
  };
  const i64 tid = blockIdx.x * i64(256) + threadIdx.x;
  if (tid == 0) *has_long = 0u;
  for (i64 s = tid; s <= B; s += i64(gridDim.x) * 256) {
    for (i64 q = group_of(s - 1) + 1, e = group_of(s); q <= e; ++q) parts[q] = s;
  }
}

// A chunk's share of one long sequence: seq (-1: unused slot), count, and two values
// (forward: mean and M2 of the share; backward: sum(w*dy*xhat) and sum(w*dy)).
struct Part {
  i64 seq;
  double n, a, b;
};

// Calls f(s, r0, r1) for each long sequence s meeting chunk [row0, row1) with its rows
// [r0, r1) inside the chunk (at most two), then marks the unused slots.
template <typename I, typename F>
__device__ __forceinline__ void for_long_in_chunk(const I* __restrict__ off, const i64 B,
                                                  const int D, const i64 cap, const i64 row0,
                                                  const i64 row1, F f) {
  for (i64 s = seq_of_row(off, B, row0); s < B && static_cast<i64>(off[s]) < row1; ++s) {
    const i64 a = off[s], e = off[s + 1];
    if ((e - a) * D <= cap) continue;  // short (or empty): done by the block-per-sequence path
    f(s, a > row0 ? a : row0, e < row1 ? e : row1);
  }
}

// The long path's walk over chunks: chunk c holds rows [c*R, (c+1)*R) of the off[B] rows, and
// block b takes the chunks c = b, b + gridDim.x, ... For each, f(c, slot, s, r0, r1) runs for
// the rows [r0, r1) of every long sequence s inside it (for_long_in_chunk; slot counts them from
// 0, at most 2), then end(c, slots). Nothing when the check found no long sequence.
template <typename I, typename F, typename E>
__device__ __forceinline__ void for_long_chunks(const I* __restrict__ off, const i64 B,
                                                const int D, const i64 R, const i64 cap,
                                                const unsigned* __restrict__ has_long, F f,
                                                E end) {
  if (*has_long == 0u) return;  // every sequence took the block-per-sequence path
  const i64 total = off[B];
  const i64 chunks = (total + R - 1) / R;
  for (i64 c = blockIdx.x; c < chunks; c += gridDim.x) {
    const i64 row0 = c * R, row1 = row0 + R < total ? row0 + R : total;
    int slot = 0;
    for_long_in_chunk(off, B, D, cap, row0, row1, [&](i64 s, i64 r0, i64 r1) {
      f(c, slot, s, r0, r1);
      ++slot;
    });
    end(c, slot);
  }
}

template <typename T, typename I, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    jag_fwd_partial(const T* __restrict__ x, const I* __restrict__ off, const i64 B, const int D,
                    const i64 R, const i64 cap, Part* __restrict__ part,
                    const unsigned* __restrict__ has_long) {
  typedef typename AccOf<T>::type A;
  __shared__ A red[BLOCK / 32];
  for_long_chunks(
      off, B, D, R, cap, has_long,
      [&](i64 c, int slot, i64 s, i64 r0, i64 r1) {
        const i64 cnt = (r1 - r0) * D;
        const int nv = static_cast<int>(cnt / VEC);
        const T* p = x + r0 * D;
        const A k0 = static_cast<A>(widen(p[0]));
        const A mu =
            group_sum<BLOCK>(sum_vectors<T, A, VEC, BLOCK>(p, nv, k0, threadIdx.x), red) /
            static_cast<A>(cnt);
        const A m2 =
            group_sum<BLOCK>(sq_dev_vectors<T, A, VEC, BLOCK>(p, nv, k0, mu, threadIdx.x), red);
        if (threadIdx.x == 0) {
          part[2 * c + slot] = Part{s, double(cnt), double(k0) + double(mu), double(m2)};
        }
      },
      [&](i64 c, int slot) {
        if (threadIdx.x == 0) {
          for (; slot < 2; ++slot) part[2 * c + slot].seq = -1;
        }
      });
}

// Chan's combination of (n, mean, M2) with another share.
__device__ __forceinline__ void chan(double& n, double& mu, double& m2, const double nb,
                                     const double mub, const double m2b) {
  if (nb == 0) return;
  const double nn = n + nb, d = mub - mu;
  mu += d * (nb / nn);
  m2 += m2b + d * d * (n * nb / nn);
  n = nn;
}

// One block per long sequence: its chunk records combined in chunk order (thread t takes
// chunks t, t + BLOCK, ...; thread 0 then combines the threads in order). FORWARD: mean/M2 to
// (mean, rstd) and the exact mean in mean64 for the apply kernel; backward: the two sums to
// (sum(w*dy*xhat) / n, sum(w*dy) / n) in (o1, o2).
template <typename A, typename I, bool FORWARD, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    jag_combine(const I* __restrict__ off, const i64 B, const int D, const i64 R, const i64 cap,
                const Part* __restrict__ part, A* __restrict__ o1, A* __restrict__ o2,
                double* __restrict__ mean64, const A eps, const unsigned* __restrict__ has_long) {
  __shared__ double sn[BLOCK], sa[BLOCK], sb[BLOCK];
  if (*has_long == 0u) return;
  for (i64 s = blockIdx.x; s < B; s += gridDim.x) {
    const i64 a = off[s], e = off[s + 1];
    if ((e - a) * D <= cap) continue;
    const i64 c0 = a / R, c1 = (e - 1) / R;
    double n = 0, va = 0, vb = 0;
    for (i64 c = c0 + threadIdx.x; c <= c1; c += BLOCK) {
      const Part p = part[2 * c].seq == s ? part[2 * c] : part[2 * c + 1];
      if (FORWARD) {
        chan(n, va, vb, p.n, p.a, p.b);
      } else {
        n += p.n;
        va += p.a;
        vb += p.b;
      }
    }
    sn[threadIdx.x] = n;
    sa[threadIdx.x] = va;
    sb[threadIdx.x] = vb;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int t = 1; t < BLOCK; ++t) {
        if (FORWARD) {
          chan(n, va, vb, sn[t], sa[t], sb[t]);
        } else {
          n += sn[t];
          va += sa[t];
          vb += sb[t];
        }
      }
      if (FORWARD) {
        o1[s] = static_cast<A>(va);
        o2[s] = rsqrt_acc<A>(static_cast<A>(vb / n) + eps);
        mean64[s] = va;
      } else {
        o1[s] = static_cast<A>(va / n);
        o2[s] = static_cast<A>(vb / n);
      }
    }
    __syncthreads();
  }
}

template <typename T, typename TW, typename TB, typename I, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    jag_fwd_apply(const T* __restrict__ x, const I* __restrict__ off, const i64 B, const int D,
                  const i64 R, const i64 cap, T* __restrict__ y, const TW* __restrict__ w,
                  const TB* __restrict__ b, const double* __restrict__ mean64,
                  const typename AccOf<T>::type* __restrict__ rstd,
                  const unsigned* __restrict__ has_long) {
  typedef typename AccOf<T>::type A;
  for_long_chunks(
      off, B, D, R, cap, has_long,
      [&](i64, int, i64 s, i64 r0, i64 r1) {
        apply_vectors<T, T, TW, TB, A, double, VEC, BLOCK>(x + r0 * D, y + r0 * D,
                                                        (r1 - r0) * D / VEC, D, 0.0, mean64[s],
                                                        rstd[s], w, b, threadIdx.x);
      },
      [](i64, int) {});
}

// ============================================================================ backward
// (sum(w*dy*xhat), sum(w*dy)) over this thread's vectors; stages x and dy when STAGE.
template <typename T, typename TW, typename A, int VEC, int BLOCK, bool STAGE, int U = 2>
__device__ __forceinline__ void bwd_sums(const T* __restrict__ dy, const T* __restrict__ x,
                                         const int nv, const int D, const TW* __restrict__ w,
                                         const A mu, const A rs, T* sdy, T* sx, A& s1, A& s2) {
  ColumnWalk col(threadIdx.x, BLOCK, D / VEC);
  s1 = 0;
  s2 = 0;
  for (int v0 = threadIdx.x; v0 < nv; v0 += U * BLOCK) {
    Pack<T, VEC> pg[U], px[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * BLOCK;
      if (v < nv) {
        pg[u] = ld<T, VEC>(dy, v);
        px[u] = ld<T, VEC>(x, v);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + u * BLOCK;
      if (v < nv) {
        if constexpr (STAGE) {
          reinterpret_cast<Pack<T, VEC>*>(sdy)[v] = pg[u];
          reinterpret_cast<Pack<T, VEC>*>(sx)[v] = px[u];
        }
        A wv[VEC];
        if (w != nullptr) {
          load_cols<A, TW, VEC>(w, col.next() * VEC, A(1), wv);
        } else {
#pragma unroll
          for (int k = 0; k < VEC; ++k) wv[k] = A(1);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A wdy = wv[k] * widen_at<A>(pg[u], k);
          s1 += wdy * (widen_at<A>(px[u], k) - mu) * rs;
          s2 += wdy;
        }
      }
    }
  }
}

// dx = rs * (w*dy - (xhat * c1 + c2)) with c1, c2 the per-element means of the sums.
template <typename T, typename TW, typename A, int VEC, int BLOCK>
__device__ __forceinline__ void dx_vectors(const T* __restrict__ dy, const T* __restrict__ x,
                                           T* __restrict__ dx, const int nv, const int D,
                                           const TW* __restrict__ w, const A mu, const A rs,
                                           const A c1, const A c2) {
  ColumnWalk col(threadIdx.x, BLOCK, D / VEC);
  for (int v = threadIdx.x; v < nv; v += BLOCK) {
    A gv[VEC], xv[VEC], wv[VEC], out[VEC];
    const i64 o = static_cast<i64>(v) * VEC;
    load_pack<A, T, VEC>(dy + o, gv);
    load_pack<A, T, VEC>(x + o, xv);
    if (w != nullptr) {
      load_cols<A, TW, VEC>(w, col.next() * VEC, A(1), wv);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) wv[k] = A(1);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const A xhat = (xv[k] - mu) * rs;
      out[k] = rs * (wv[k] * gv[k] - (xhat * c1 + c2));
    }
    store_pack<T, A, VEC>(dx + o, out);
  }
}

template <typename T, typename TW, typename I, int VEC, int BLOCK, int UNROLL>
__global__ void __launch_bounds__(BLOCK, 1)
    jag_bwd_short(const T* __restrict__ dy, const T* __restrict__ x, const I* __restrict__ off,
                  const i64 B, const int D, const TW* __restrict__ w,
                  const typename AccOf<T>::type* __restrict__ mean,
                  const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx,
                  const i64 cap, unsigned* __restrict__ has_long) {
  typedef typename AccOf<T>::type A;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sdy = reinterpret_cast<T*>(smem_raw);
  T* sx = sdy + cap;
  __shared__ A red[2 * (BLOCK / 32)];
  for (i64 s = blockIdx.x; s < B; s += gridDim.x) {
    const i64 r0 = off[s];
    const i64 cnt = (static_cast<i64>(off[s + 1]) - r0) * D;
    if (cnt > cap && threadIdx.x == 0) *has_long = 1u;
    if (cnt > cap || cnt == 0) continue;
    const int nv = static_cast<int>(cnt / VEC);
    const A mu = mean[s], rs = rstd[s];
    A s1, s2;
    bwd_sums<T, TW, A, VEC, BLOCK, true, UNROLL>(dy + r0 * D, x + r0 * D, nv, D, w, mu, rs, sdy, sx, s1,
                                         s2);
    group_sum2<BLOCK>(s1, s2, red);
    const A inv = A(1) / static_cast<A>(cnt);
    dx_vectors<T, TW, A, VEC, BLOCK>(sdy, sx, dx + r0 * D, nv, D, w, mu, rs, s1 * inv, s2 * inv);
  }
}

template <typename T, typename TW, typename I, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    jag_bwd_partial(const T* __restrict__ dy, const T* __restrict__ x, const I* __restrict__ off,
                    const i64 B, const int D, const i64 R, const i64 cap,
                    const TW* __restrict__ w, const typename AccOf<T>::type* __restrict__ mean,
                    const typename AccOf<T>::type* __restrict__ rstd, Part* __restrict__ part,
                    const unsigned* __restrict__ has_long) {
  typedef typename AccOf<T>::type A;
  __shared__ A red[2 * (BLOCK / 32)];
  for_long_chunks(
      off, B, D, R, cap, has_long,
      [&](i64 c, int slot, i64 s, i64 r0, i64 r1) {
        const i64 cnt = (r1 - r0) * D;
        A s1, s2;
        bwd_sums<T, TW, A, VEC, BLOCK, false>(dy + r0 * D, x + r0 * D, int(cnt / VEC), D, w,
                                              mean[s], rstd[s], nullptr, nullptr, s1, s2);
        group_sum2<BLOCK>(s1, s2, red);
        if (threadIdx.x == 0) part[2 * c + slot] = Part{s, double(cnt), double(s1), double(s2)};
      },
      [&](i64 c, int slot) {
        if (threadIdx.x == 0) {
          for (; slot < 2; ++slot) part[2 * c + slot].seq = -1;
        }
      });
}

template <typename T, typename TW, typename I, int VEC, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    jag_bwd_apply(const T* __restrict__ dy, const T* __restrict__ x, const I* __restrict__ off,
                  const i64 B, const int D, const i64 R, const i64 cap, const TW* __restrict__ w,
                  const typename AccOf<T>::type* __restrict__ mean,
                  const typename AccOf<T>::type* __restrict__ rstd,
                  const typename AccOf<T>::type* __restrict__ c1,
                  const typename AccOf<T>::type* __restrict__ c2, T* __restrict__ dx,
                  const unsigned* __restrict__ has_long) {
  typedef typename AccOf<T>::type A;
  for_long_chunks(
      off, B, D, R, cap, has_long,
      [&](i64, int, i64 s, i64 r0, i64 r1) {
        dx_vectors<T, TW, A, VEC, BLOCK>(dy + r0 * D, x + r0 * D, dx + r0 * D,
                                         int((r1 - r0) * D / VEC), D, w, mean[s], rstd[s], c1[s],
                                         c2[s]);
      },
      [](i64, int) {});
}

// Per-row copies of the sequence statistics (for the dw/db column kernel): row r gets the
// mean and rstd of the sequence that holds it.
template <typename A, typename I>
__global__ void __launch_bounds__(256, 1)
    jag_expand_stats(const I* __restrict__ off, const i64 B, const A* __restrict__ mean,
                     const A* __restrict__ rstd, A* __restrict__ row_mean,
                     A* __restrict__ row_rstd) {
  const i64 total = off[B];
  for (i64 r = blockIdx.x * i64(256) + threadIdx.x; r < total; r += i64(gridDim.x) * 256) {
    const i64 s = seq_of_row(off, B, r);
    row_mean[r] = mean[s];
    row_rstd[r] = rstd[s];
  }
}

// Offsets check: flags[0] |= 1 when off[0] != 0, 2 when some off[i] > off[i + 1] (flags[1]:
// the smallest such i), 4 when off[B] != total; flags[2]: the longest sequence's rows (valid
// when flags[0] == 0). flags start as {0, ~0, 0}.
template <typename I>
__global__ void __launch_bounds__(256, 1)
    jag_check_offsets(const I* __restrict__ off, const i64 B, const i64 total,
                      unsigned long long* __restrict__ flags) {
  const i64 tid = blockIdx.x * i64(256) + threadIdx.x;
  if (tid == 0) {
    if (off[0] != 0) atomicOr(flags, 1ull);
    if (static_cast<i64>(off[B]) != total) atomicOr(flags, 4ull);
  }
  unsigned long long longest = 0;
  for (i64 i = tid; i < B; i += i64(gridDim.x) * 256) {
    const i64 len = static_cast<i64>(off[i + 1]) - static_cast<i64>(off[i]);
    if (len < 0) {
      atomicOr(flags, 2ull);
      atomicMin(flags + 1, static_cast<unsigned long long>(i));
    } else if (static_cast<unsigned long long>(len) > longest) {
      longest = static_cast<unsigned long long>(len);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, longest, o);
    longest = other > longest ? other : longest;
  }
  if ((threadIdx.x & 31u) == 0 && longest > 0) atomicMax(flags + 2, longest);
}

// Offsets made valid on the GPU, for calls that skip the host's check (no synchronization):
// out[i] is the largest of 0 and off[1..i], at most total, with out[0] = 0 and out[B] = total.
// Valid offsets come out unchanged; any others become a valid partition of the rows, so that
// no kernel reads or writes past values. One block walks them in chunks of 1024 (a max-scan
// in each chunk, carried to the next).
template <typename I>
__global__ void __launch_bounds__(1024, 1)
    jag_clamp_offsets(const I* __restrict__ off, const i64 B, const i64 total,
                      I* __restrict__ out) {
  __shared__ i64 warp_max[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  i64 carry = 0;
  for (i64 c = 0; c <= B; c += 1024) {
    const i64 i = c + threadIdx.x;
    i64 v = i > 0 && i <= B ? static_cast<i64>(off[i]) : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {  // inclusive max-scan in the warp
      const i64 u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d && u > v) v = u;
    }
    if (lane == 31) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {  // ...over the warps' maxima
      i64 m = warp_max[lane];
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const i64 u = __shfl_up_sync(0xffffffffu, m, d);
        if (lane >= d && u > m) m = u;
      }
      warp_max[lane] = m;
    }
    __syncthreads();
    if (warp > 0 && warp_max[warp - 1] > v) v = warp_max[warp - 1];
    if (carry > v) v = carry;
    if (i <= B) out[i] = static_cast<I>(i == B || v > total ? total : v);
    if (warp_max[31] > carry) carry = warp_max[31];
    __syncthreads();  // every thread has read warp_max before the next chunk writes it
  }
}

}  // namespace cupyln
