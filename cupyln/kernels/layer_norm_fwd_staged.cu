// cupyln/kernels/layer_norm_fwd_staged.cu -- LayerNorm forward, the staged tiers: rows past
// the register tiers, staged in shared memory.
//
// Parameters, inputs, outputs and statistics: as every forward kernel (layer_norm_fwd.cu's
// header, CUPYLN_FWD_PARAMS in args.cuh). ln_fwd_ring: rows that one block's shared memory
// holds, through staging rings that load the next rows while one is reduced; ln_fwd_cluster
// (sm_90): rows too wide for one ring, a column slice a block of a thread-block cluster;
// ln_fwd_row: the rest, a block a row, staged in shared memory or re-read from global memory.
#include "args.cuh"
#include "cluster.cuh"
#include "common.cuh"
#include "ring.cuh"
#include "ring_forward.cuh"

namespace cupyln {

// Tier "ring": rows of x [M, N] through the staging rings of ring_forward.cuh, each row a
// sequence of one row, group q of the G groups taking rows [q*M/G, (q+1)*M/G). The dynamic
// shared memory is split evenly into the BLOCK/GROUP groups' rings; each must hold a row (the
// host's plan sees to it). LayerNorm only, of x alone (a Load without a residual).
template <typename LD, typename ST, int VEC, int BLOCK, int GROUP>
__global__ void __launch_bounds__(BLOCK, RingBlocks<typename LD::X, BLOCK>::value)
    ln_fwd_ring(CUPYLN_FWD_PARAMS) {
  typedef typename LD::X T;
  typedef typename LD::A A;
  typedef Pack<T, VEC> P;
  static_assert(!LD::RES && !ST::RMS, "LayerNorm of x alone");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[2 * (BLOCK / 32)];
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  constexpr int GROUPS = BLOCK / GROUP;
  const int ring = static_cast<int>(smem_bytes / (GROUPS * sizeof(P)));
  const i64 G = static_cast<i64>(gridDim.x) * GROUPS;
  const i64 g = static_cast<i64>(blockIdx.x) * GROUPS + threadIdx.x / GROUP;
  P* slots = reinterpret_cast<P*>(smem_raw) + (threadIdx.x / GROUP) * ring;
  ring_forward<T, typename ST::Y, typename ST::W, typename ST::B, DenseRows, VEC, BLOCK, GROUP>(
      x, x_stride, static_cast<const DenseRows*>(nullptr), g * M / G, (g + 1) * M / G, N, y, w,
      b, mean, rstd, eps, static_cast<i64>(N), slots, ring, 0, nullptr, red);
}

// Tier "row": one block per row for rows too wide for registers.
//   Each thread walks columns threadIdx.x * VEC + j * BLOCK * VEC, UNROLL vectors at a time
//   (their loads are all issued before the first is used). With STAGE, the first pass copies
//   the row into dynamic shared memory (N elements of T) and the two later passes read it from
//   there, so HBM sees one read of x; each thread reads back only what it wrote, so the staging
//   needs no barrier. Without STAGE (rows past the shared-memory limit) the later passes read x
//   again from global memory: a slower path, never a wrong one.
//   Of x alone (a Load without a residual: the plans add it first, ln_fwd_add).
// Limits: any N < 2^31 - UNROLL * BLOCK * VEC.
template <typename LD, typename ST, int VEC, int BLOCK, bool STAGE>
__global__ void __launch_bounds__(BLOCK, 1)
    ln_fwd_row(CUPYLN_FWD_PARAMS) {
  typedef typename LD::X T;
  typedef typename LD::A A;
  static_assert(!LD::RES, "x alone");
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "bad block");
  typedef Pack<T, VEC> P;
  constexpr int UNROLL = 4;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  T* stage = reinterpret_cast<T*>(dyn_smem);
  __shared__ A red[2][BLOCK / 32];  // the mean's and the variance's sums
  const A inv_n = A(1) / A(N);

  for (i64 row = blockIdx.x; row < M; row += gridDim.x) {
    const T* __restrict__ xr = x + row * x_stride;
    const A shift = static_cast<A>(widen(xr[0]));

    const i64 nv = N / VEC;  // a row's packs
    A s = 0;
    walk_vectors<T, VEC, BLOCK, UNROLL>(xr, nv, threadIdx.x, [&](const i64 v, const P& pk) {
      if constexpr (STAGE) reinterpret_cast<P*>(stage)[v] = pk;
#pragma unroll
      for (int k = 0; k < VEC; ++k) s += widen_at<A>(pk, k) - shift;
    });
    const A mu = group_sum<BLOCK, false>(s, red[0]) * inv_n;
    const T* __restrict__ src = STAGE ? stage : xr;

    A ss = 0;
    walk_vectors<T, VEC, BLOCK, UNROLL>(src, nv, threadIdx.x, [&](i64, const P& pk) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const A d = widen_at<A>(pk, k) - shift - mu;
        ss += d * d;
      }
    });
    const A r = ST::rstd(group_sum<BLOCK, false>(ss, red[1]) * inv_n, shift + mu, eps);
    if (threadIdx.x == 0) ST::stats(mean, rstd, row, shift + mu, r);

    typename ST::Y* __restrict__ yr = y + row * N;
    const A k = ST::RMS ? A(0) : shift, m = ST::RMS ? A(0) : mu;  // y of x - k - m
    walk_vectors<T, VEC, BLOCK, UNROLL>(src, nv, threadIdx.x, [&](const i64 v, const P& pk) {
      const int col = static_cast<int>(v) * VEC;
      ST::apply(pk, k, m, r, w, b, col, yr + col);
    });
  }
}

// Tier "cluster" (sm_90+): rows too wide for one block's staging ring.
//   Clusters of C blocks of BLOCK threads (the host fits several per SM); cluster q of Q takes
//   the rows [q*M/Q, (q+1)*M/Q) and block k of it the packs [k*P/C, (k+1)*P/C) of each row
//   (P = N / VEC), copied into the block's ring (ring.cuh) with cp.async up to RING_DEPTH rows
//   ahead.
//   Each block forms its slice's statistics exactly from shared memory, shifted by the slice's
//   first element k_p: d_p = mean(x - k_p) and m2_p = sum((x - k_p - d_p)^2). The blocks
//   exchange (k_p, d_p, m2_p) through distributed shared memory (cluster.cuh) and each merges
//   them in rank order (Chan et al.'s pairwise update, offsets taken against block 0's shift),
//   so every block gets bitwise the same mean and rstd without E[x^2] - E[x]^2. Then each
//   writes y for its slice; block 0 writes mean and rstd. Of x alone (as ln_fwd_row).
// Limits: one row's slice fits the ring (the host sizes the ring to a third of the SM).
template <typename LD, typename ST, int VEC, int BLOCK, int C>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, 1)
    ln_fwd_cluster(CUPYLN_FWD_PARAMS) {
  typedef typename LD::X T;
  typedef typename LD::A A;
  static_assert(!LD::RES, "x alone");
  typedef Pack<T, VEC> P;
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024 && C <= 32, "bad block");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[2][BLOCK / 32];  // the slice's sum and sum of squares
  __shared__ A xch[2 * C * 3];
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  Ring<P, BLOCK> r{reinterpret_cast<P*>(smem_raw), static_cast<int>(smem_bytes / sizeof(P))};
  ClusterExchange<C, A, 3> exchange{xch};
  const int t = threadIdx.x;
  const unsigned q = cluster_index(), nq = cluster_count(), rank = cluster_rank();
  const ColumnSlices<C, VEC> slices{N / VEC};
  const int lo = slices.start(rank), nv = slices.start(rank + 1) - lo;  // this block's slice
  const A inv_nv = A(1) / A(nv * VEC);
  const i64 row_begin = static_cast<i64>(q) * M / nq;
  const i64 row_end = static_cast<i64>(q + 1) * M / nq;
  const bool stats = (ST::RMS ? rstd : mean) != nullptr && rank == 0 && t == 0;
  exchange.start();

  i64 next = row_begin;  // the next row to stage
  for (i64 row = row_begin; row < row_end; ++row) {
    for (; next < row_end && r.ahead < RING_DEPTH && r.used + nv <= r.size; ++next) {
      r.stage(reinterpret_cast<const P*>(x + next * x_stride) + lo, nv, t);
    }
    const A k = static_cast<A>(widen(x[row * x_stride + lo * VEC]));  // the slice's shift
    r.wait_oldest();

    A s = 0;
    for (int v = t, i = r.wrap(r.head + t); v < nv; v += BLOCK, i = r.wrap(i + BLOCK)) {
      const P pk = r.slot[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += widen_at<A>(pk, e) - k;
    }
    // `red` alternates between its halves, and the previous row ended with a barrier
    const A d = group_sum<BLOCK, false>(s, red[0]) * inv_nv;
    A ss = 0;
    for (int v = t, i = r.wrap(r.head + t); v < nv; v += BLOCK, i = r.wrap(i + BLOCK)) {
      const P pk = r.slot[i];
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A dev = widen_at<A>(pk, e) - k - d;
        ss += dev * dev;
      }
    }
    exchange.send({k, d, group_sum<BLOCK, false>(ss, red[1])});

    A off, rs;  // the row's mean minus this slice's shift, and its rstd
    merge_slices<ST::RMS>(exchange.receive(), slices, N, eps, k, off, rs,
                          stats ? mean + row : nullptr, stats || !ST::RMS ? rstd + row : nullptr);
    typename ST::Y* __restrict__ yr = y + row * N + lo * VEC;
    for (int v = t, i = r.wrap(r.head + t); v < nv; v += BLOCK, i = r.wrap(i + BLOCK)) {
      ST::apply(r.slot[i], k, off, rs, w, b, (lo + v) * VEC, yr + v * VEC);
    }
    r.release(nv);
    __syncthreads();  // every thread is done with the row's slots before they are reused
  }
}

// The residual add on its own, for the tiers that do not fuse it (cupyln/_plans/forward.py
// says which): the Load's h = x + res, added in A and rounded to TH, for rows of N at x_stride
// and res_stride into h [M, N] contiguous; the other parameters are not read. A grid-stride
// walk over the M * N / VEC packs, 256 threads a block.
template <typename LD, int VEC, typename ST = NoStore<LD>>
__global__ void __launch_bounds__(256)
    ln_fwd_add(CUPYLN_FWD_PARAMS) {
  typedef typename LD::X T;
  typedef typename LD::A A;
  typedef typename LD::R R;
  typedef typename LD::H TH;
  static_assert(LD::RES, "a residual");
  const i64 nv = N / VEC, total = M * nv;
  for (i64 i = static_cast<i64>(blockIdx.x) * 256 + threadIdx.x; i < total;
       i += static_cast<i64>(gridDim.x) * 256) {
    const i64 row = i / nv, col = (i - row * nv) * VEC;
    const Pack<T, VEC> px = *reinterpret_cast<const Pack<T, VEC>*>(x + row * x_stride + col);
    const Pack<R, VEC> pr =
        *reinterpret_cast<const Pack<R, VEC>*>(static_cast<const R*>(res) + row * res_stride + col);
    add_residual<A>(px, pr, static_cast<TH*>(h) + row * N + col);
  }
}

}  // namespace cupyln
