// cupyln/kernels/layer_norm_bwd_staged.cu -- LayerNorm backward, the staged tiers: rows past
// the register tiers.
//
// Parameters, inputs, outputs, formulas (RMS, dh) and determinism: as every backward kernel
// (layer_norm_bwd.cu's header, CUPYLN_BWD_PARAMS in args.cuh). ln_bwd_ring: x and dy staged in
// a shared-memory ring, the dw/db sums in registers; ln_bwd_cluster (sm_90): rows whose sums
// outgrow one block's registers, a column slice a block of a thread-block cluster; ln_bwd_row:
// the rest, dx a block a row, with dw/db from ln_bwd_dwdb_cols (layer_norm_bwd_sums.cu).
#include "args.cuh"
#include "cluster.cuh"
#include "common.cuh"
#include "ring.cuh"

namespace cupyln {

// Tier "ring": fused dx + dw/db for rows too wide to keep x and dy in registers.
//   One block per SM walks the contiguous rows [q*M/Q, (q+1)*M/Q) (q of Q). Each row's x and dy
//   are copied into the block's staging ring (ring.cuh; the dynamic shared memory) with cp.async
//   up to RING_DEPTH copy groups ahead, so the loads of the next rows overlap this row's two
//   passes: pass 1 forms the row sums and adds dy * xhat and dy to the thread's dw/db
//   accumulators, which stay in registers across the block's rows (thread t always owns the
//   column packs t, t + BLOCK, ..., ITEMS of them); pass 2 writes dx. The block writes row q of
//   dw_part / db_part at the end, as the register tier does.
//   ln_bwd_ring: q = blockIdx.x, the whole row in each block.
//   ln_bwd_cluster (sm_90+): clusters of C blocks, q = the cluster's index; block k of a cluster
//   takes the packs [k*P/C, (k+1)*P/C) of each row (P = N / VEC), so the dw/db accumulators of
//   rows too wide for one SM's registers are spread over C SMs. The row sums are combined
//   across the cluster through distributed shared memory (cluster.cuh ClusterExchange). With
//   LAG = 1 the next row's pass 1 runs while the blocks wait for each other: pass 2 of a row
//   follows pass 1 of the next one, and the ring holds two rows' slices at once.
// Limits: ceil(N / VEC / C) <= BLOCK * ITEMS; the ring holds the x and dy slices of 1 + LAG
//   rows.
template <typename T, typename TW, int VEC, int ITEMS, int BLOCK, int C, int LAG, bool RMS,
          bool DH>
__device__ __forceinline__ void bwd_ring_rows(
    const T* __restrict__ dy, const i64 dy_stride, const T* __restrict__ x, const i64 x_stride,
    const TW* __restrict__ w, const typename AccOf<T>::type* __restrict__ mean,
    const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx,
    typename AccOf<T>::type* __restrict__ dw_part, typename AccOf<T>::type* __restrict__ db_part,
    const i64 M, const int N, const typename AccOf<T>::type inv_n, const T* __restrict__ dh,
    const i64 dh_stride) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024 && C <= 32, "bad block");
  static_assert(LAG == 0 || (LAG == 1 && C > 1), "LAG: rows between a row's passes 1 and 2");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[2 * (BLOCK / 32)];
  __shared__ A xch[2 * C * 2];
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  Ring<P, BLOCK> r{reinterpret_cast<P*>(smem_raw), static_cast<int>(smem_bytes / sizeof(P))};
  ClusterExchange<C, A, 2> exchange{xch};
  auto cluster_sums = [&](A& c1, A& c2) {  // the cluster's row sums
    A sums[2];
    exchange.receive_sums(sums);
    c1 = sums[0];
    c2 = sums[1];
  };
  const int t = threadIdx.x;
  const unsigned q = C > 1 ? cluster_index() : blockIdx.x;
  const unsigned nq = C > 1 ? cluster_count() : gridDim.x;
  const unsigned rank = C > 1 ? cluster_rank() : 0;
  const ColumnSlices<C, VEC> slices{N / VEC};
  const int lo = slices.start(rank), nv = slices.start(rank + 1) - lo;  // this block's slice
  const i64 row_begin = static_cast<i64>(q) * M / nq;
  const i64 row_end = static_cast<i64>(q + 1) * M / nq;
  const TW* __restrict__ ws = w != nullptr ? w + lo * VEC : nullptr;
  if constexpr (C > 1) exchange.start();

  A dw_acc[ITEMS][VEC], db_acc[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw_acc[i][k] = db_acc[i][k] = 0;
  }

  // pass 1 over the row slice at ring offset `at`: the block's sums of xhat * g and g, and
  // dy * xhat, dy into the accumulators
  auto pass1 = [&](const int at, const A mu, const A rs, A& s1, A& s2) {
    s1 = s2 = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = t + i * BLOCK;
      if (v < nv) {
        const P px = r.slot[r.wrap(r.head + at + v)];
        const P pg = r.slot[r.wrap(r.head + at + nv + v)];
        A p[VEC];
        if (ws != nullptr) load_pack<A, TW, VEC>(ws + v * VEC, p);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A xhat = (widen_at<A>(px, k) - mu) * rs;
          const A gk = widen_at<A>(pg, k);
          dw_acc[i][k] += gk * xhat;
          if constexpr (!RMS) db_acc[i][k] += gk;
          const A g = ws != nullptr ? gk * p[k] : gk;
          s1 += xhat * g;
          s2 += g;
        }
      }
    }
    // `red` is free: every thread passed the previous row's closing barrier after reading it
    group_sum2<BLOCK, false>(s1, s2, red);
  };

  // pass 2 over the oldest row slice in the ring (row `row`): dx, then its slots are released.
  // dx = rs * (g - c2 - xhat * c1) = rs * g + (x - mu) * k1 + k0, k1 = -rs^2 c1, k0 = -rs c2
  auto pass2 = [&](const i64 row, const A mu, const A rs, const A c1, const A c2) {
    T* __restrict__ dxr = dx + row * N + lo * VEC;
    const T* __restrict__ dhr = DH ? dh + row * dh_stride + lo * VEC : nullptr;
    const A k1 = -rs * rs * c1, k0 = RMS ? A(0) : -rs * c2;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = t + i * BLOCK;
      if (v < nv) {
        const P px = r.slot[r.wrap(r.head + v)];
        const P pg = r.slot[r.wrap(r.head + nv + v)];
        A p[VEC], o[VEC];
        if (ws != nullptr) load_pack<A, TW, VEC>(ws + v * VEC, p);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const A gk = widen_at<A>(pg, k);
          const A g = ws != nullptr ? gk * p[k] : gk;
          o[k] = rs * g + ((widen_at<A>(px, k) - mu) * k1 + k0);
        }
        if constexpr (DH) add_grad<T, A, VEC>(dhr + v * VEC, o);
        store_pack<T, A, VEC>(dxr + v * VEC, o);
      }
    }
    r.release(2 * nv);
    __syncthreads();  // every thread is done with the row's slots before they are reused
  };

  i64 next = row_begin;  // the next row to stage
  A mu_held = 0, rs_held = 0;  // statistics of the row whose pass 2 is pending (LAG == 1)
  // each row's statistics are loaded a row ahead, so their latency is not waited for
  A mu_next = row_begin < row_end && !RMS ? mean[row_begin] : A(0);
  A rs_next = row_begin < row_end ? rstd[row_begin] : A(0);
  for (i64 row = row_begin; row < row_end + LAG; ++row) {
    A s1 = 0, s2 = 0, mu = 0, rs = 0;
    if (row < row_end) {
      mu = mu_next;
      rs = rs_next;
      if (row + 1 < row_end) {
        mu_next = RMS ? A(0) : mean[row + 1];
        rs_next = rstd[row + 1];
      }
      // stage rows ahead (x, then dy: two copy groups each) as far as the ring holds them
      for (; next < row_end && r.ahead <= RING_DEPTH - 1 && r.used + 2 * nv <= r.size; ++next) {
        r.stage(reinterpret_cast<const P*>(x + next * x_stride) + lo, nv, t);
        r.stage(reinterpret_cast<const P*>(dy + next * dy_stride) + lo, nv, t);
      }
      r.wait_oldest();  // this row's x
      r.wait_oldest();  // and dy
      pass1(LAG != 0 && row > row_begin ? 2 * nv : 0, mu, rs, s1, s2);
    }
    if constexpr (C == 1) {
      pass2(row, mu, rs, s1 * inv_n, s2 * inv_n);
    } else if constexpr (LAG == 0) {
      exchange.send({s1, s2});
      cluster_sums(s1, s2);
      pass2(row, mu, rs, s1 * inv_n, s2 * inv_n);
    } else {
      A c1 = 0, c2 = 0;
      if (row > row_begin) cluster_sums(c1, c2);  // the previous row's
      if (row < row_end) exchange.send({s1, s2});
      if (row > row_begin) pass2(row - 1, mu_held, rs_held, c1 * inv_n, c2 * inv_n);
      mu_held = mu;
      rs_held = rs;
    }
  }

  // ---- this block's slice of partial row q (zeros when it owned no row)
  const i64 slot = static_cast<i64>(q) * N + lo * VEC;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = t + i * BLOCK;
    if (v < nv) {
      if (dw_part != nullptr) store_pack<A, A, VEC>(dw_part + slot + v * VEC, dw_acc[i]);
      if constexpr (!RMS) store_pack<A, A, VEC>(db_part + slot + v * VEC, db_acc[i]);
    }
  }
}

template <typename LD, typename ST, int VEC, int ITEMS, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    ln_bwd_ring(CUPYLN_BWD_PARAMS) {
  static_assert(Same<typename ST::Y, typename LD::X>::value, "dy of x's dtype");
  release_dependents();
  bwd_ring_rows<typename LD::X, typename ST::W, VEC, ITEMS, BLOCK, 1, 0, ST::RMS, LD::RES>(
      dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, inv_n, dh,
      dh_stride);
}

template <typename LD, typename ST, int VEC, int ITEMS, int BLOCK, int C, int LAG>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, 1)
    ln_bwd_cluster(CUPYLN_BWD_PARAMS) {
  static_assert(Same<typename ST::Y, typename LD::X>::value, "dy of x's dtype");
  release_dependents();
  bwd_ring_rows<typename LD::X, typename ST::W, VEC, ITEMS, BLOCK, C, LAG, ST::RMS, LD::RES>(
      dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, inv_n, dh,
      dh_stride);
}

// Tier "row": dx for rows too wide for registers, one block per row.
//   Pass 1 reads x and dy, UNROLL vectors of each per thread before using them (copying them to
//   shared memory with STAGE: 2 * N elements of T), and forms the two row sums; pass 2
//   recomputes xhat and g from shared memory (or from global memory without STAGE) and writes dx.
//   dw/db come from ln_bwd_dwdb_cols. RMS, DH: as layer_norm_bwd.cu's header says.
// Limits: any N < 2^31 - UNROLL * BLOCK * VEC.
template <typename LD, typename ST, int VEC, int BLOCK, bool STAGE>
__global__ void __launch_bounds__(BLOCK, 1)
    ln_bwd_row(CUPYLN_BWD_PARAMS) {
  typedef typename LD::X T;
  typedef typename ST::W TW;
  typedef typename LD::A A;
  constexpr bool RMS = ST::RMS, DH = LD::RES;
  static_assert(Same<typename ST::Y, T>::value, "dy of x's dtype");
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "bad block");
  constexpr int UNROLL = 4;
  constexpr int STEP = BLOCK * VEC;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  T* stage_x = reinterpret_cast<T*>(dyn_smem);
  T* stage_g = stage_x + N;  // N is a multiple of VEC, so stage_g keeps the pack alignment
  __shared__ A red[2 * (BLOCK / 32)];
  const A inv_cols = A(1) / A(N);

  for (i64 row = blockIdx.x; row < M; row += gridDim.x) {
    const T* __restrict__ xr = x + row * x_stride;
    const T* __restrict__ gr = dy + row * dy_stride;
    const A mu = RMS ? A(0) : mean[row];
    const A r = rstd[row];

    A s1 = 0, s2 = 0;
    for (int base = threadIdx.x * VEC; base < N; base += UNROLL * STEP) {
      Pack<T, VEC> rx[UNROLL], rg[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int col = base + u * STEP;
        if (col < N) {
          rx[u] = *reinterpret_cast<const Pack<T, VEC>*>(xr + col);
          rg[u] = *reinterpret_cast<const Pack<T, VEC>*>(gr + col);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int col = base + u * STEP;
        if (col < N) {
          if constexpr (STAGE) {
            *reinterpret_cast<Pack<T, VEC>*>(stage_x + col) = rx[u];
            *reinterpret_cast<Pack<T, VEC>*>(stage_g + col) = rg[u];
          }
          A p[VEC];
          if (w != nullptr) load_pack<A, TW, VEC>(w + col, p);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const A xhat = (widen_at<A>(rx[u], k) - mu) * r;
            const A gk = widen_at<A>(rg[u], k);
            const A g = w != nullptr ? gk * p[k] : gk;
            s1 += xhat * g;
            s2 += g;
          }
        }
      }
    }
    group_sum2<BLOCK>(s1, s2, red);
    const A c1 = s1 * inv_cols, c2 = RMS ? A(0) : s2 * inv_cols;

    const T* __restrict__ src_x = STAGE ? stage_x : xr;
    const T* __restrict__ src_g = STAGE ? stage_g : gr;
    T* __restrict__ dxr = dx + row * N;
    const T* __restrict__ dhr = DH ? dh + row * dh_stride : nullptr;
    for (int base = threadIdx.x * VEC; base < N; base += UNROLL * STEP) {
      A xv[UNROLL][VEC], gv[UNROLL][VEC];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int col = base + u * STEP;
        if (col < N) {
          load_pack<A, T, VEC>(src_x + col, xv[u]);
          load_pack<A, T, VEC>(src_g + col, gv[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int col = base + u * STEP;
        if (col < N) {
          A p[VEC];
          if (w != nullptr) load_pack<A, TW, VEC>(w + col, p);
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            const A xhat = (xv[u][k] - mu) * r;
            const A g = w != nullptr ? gv[u][k] * p[k] : gv[u][k];
            xv[u][k] = (g - (xhat * c1 + c2)) * r;
          }
          if constexpr (DH) add_grad<T, A, VEC>(dhr + col, xv[u]);
          store_pack<T, A, VEC>(dxr + col, xv[u]);
        }
      }
    }
  }
}

}  // namespace cupyln
