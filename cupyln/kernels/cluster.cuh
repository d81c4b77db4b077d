// cupyln/kernels/cluster.cuh -- thread-block clusters (sm_90+): one row shared by C blocks.
//
// A kernel declared with CUPYLN_CLUSTER(C) runs its blocks in clusters of C consecutive
// blockIdx.x, all resident at once on C SMs of one GPC, each able to write the others' shared
// memory (distributed shared memory, DSMEM). The wide-row kernels give each block of a cluster
// a slice of the row's columns and combine their row statistics with ClusterExchange.
// On older architectures the macro expands to nothing and the helpers trap: the launch
// heuristic never picks a cluster kernel there (tests/test_compile.py builds them for sm_90).
#pragma once

#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CUPYLN_CLUSTER(C) __cluster_dims__(C, 1, 1)
#define CUPYLN_CLUSTERS 1
#else
#define CUPYLN_CLUSTER(C)
#define CUPYLN_CLUSTERS 0
#endif

namespace cupyln {

// This block's rank in its cluster (0 .. C-1), the cluster's index and the number of clusters.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if CUPYLN_CLUSTERS
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ unsigned cluster_index() {
  unsigned r = blockIdx.x;
#if CUPYLN_CLUSTERS
  asm("mov.u32 %0, %%clusterid.x;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ unsigned cluster_count() {
  unsigned r = gridDim.x;
#if CUPYLN_CLUSTERS
  asm("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
#endif
  return r;
}

// The cluster barrier in two halves: every thread of every block of the cluster arrives, and
// later waits until all have arrived. Shared-memory writes (local or remote) before a thread's
// arrive are visible to every thread of the cluster after its wait. A thread alternates
// arrive and wait; work between them overlaps the wait for the slowest block.
__device__ __forceinline__ void cluster_arrive() {
#if CUPYLN_CLUSTERS
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if CUPYLN_CLUSTERS
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// Writes v (float or double) to the copy of `*local` (a __shared__ address) held by block
// `rank` of the cluster.
template <typename A>
__device__ __forceinline__ void store_remote(A* local, const unsigned rank, const A v) {
  static_assert(sizeof(A) == 4 || sizeof(A) == 8, "float or double");
#if CUPYLN_CLUSTERS
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(local));
  unsigned d;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(s), "r"(rank));
  if constexpr (sizeof(A) == 4) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(d), "f"(v) : "memory");
  } else {
    asm volatile("st.shared::cluster.f64 [%0], %1;" ::"r"(d), "d"(v) : "memory");
  }
#else
  __trap();
#endif
}

// W values from each of the C blocks of a cluster to every block: send() gives this block's
// values (block-wide: the same in every thread) to every block and arrives at the cluster
// barrier; the next receive() waits there and returns the C * W values received, block p's at
// [p * W, (p + 1) * W), which the caller combines in rank order so every block gets bitwise
// the same result. Work between the two overlaps the exchange. `slots` is 2 * C * W values of
// __shared__ memory at the same offset in every block; exchanges alternate between its two
// halves, so a block writes a half again only after the wait of the next exchange, which no
// block passes before every block has read that half (its reads precede its next arrive).
// Every thread of every block of the cluster makes the same calls; cluster_sync() once before
// the first send.
template <int C, typename A, int W>
struct ClusterExchange {
  A* slots;
  int half = 0;

  __device__ __forceinline__ void send(const A (&v)[W]) {
    A* mine = slots + half * C * W;
    if (threadIdx.x < C) {  // thread p writes to block p
      const unsigned r = cluster_rank();
#pragma unroll
      for (int j = 0; j < W; ++j) store_remote(mine + r * W + j, threadIdx.x, v[j]);
    }
    cluster_arrive();
  }

  __device__ __forceinline__ const A* receive() {
    cluster_wait();
    const A* got = slots + half * C * W;
    half ^= 1;
    return got;
  }

  // receive(), then each of the W values summed over the C blocks in rank order (bitwise the
  // same sums in every block).
  __device__ __forceinline__ void receive_sums(A (&v)[W]) {
    const A* got = receive();
#pragma unroll
    for (int j = 0; j < W; ++j) v[j] = got[j];
#pragma unroll
    for (int p = 1; p < C; ++p) {
#pragma unroll
      for (int j = 0; j < W; ++j) v[j] += got[p * W + j];
    }
  }
};

// The column slices of a row of `packs` packs of VEC elements over the C blocks of a cluster:
// block k takes the packs [start(k), start(k + 1)) = [k*P/C, (k+1)*P/C) (sizes differ by at
// most one).
template <int C, int VEC>
struct ColumnSlices {
  int packs;
  __device__ __forceinline__ int start(const unsigned k) const {
    return static_cast<int>(static_cast<i64>(k) * packs / C);
  }
  template <typename A>
  __device__ __forceinline__ A elements(const int p) const {
    return A((start(p + 1) - start(p)) * VEC);
  }
};

// The row's statistics from its C column slices: got[3p .. 3p+2] = (shift k_p, mean of x - k_p,
// sum of squared deviations from the slice's mean) of slice p, as ClusterExchange received
// them; n = the row's elements. Chan et al.'s pairwise update in rank order, offsets taken
// against k_0, gives every block of the cluster bitwise the same mean and m2 (the row's sum of
// squared deviations), with no E[x^2] - E[x]^2. Returns rs = 1 / sqrt(m2 / n + eps) and off =
// the row's mean minus `k`, the calling block's shift; stores the mean and rs at *mean and
// *rstd where `mean` is not null (one thread of the cluster passes them). Divisions, once a
// row: a reciprocal held across the caller's loop over rows spills some variants.
template <int C, int VEC, typename A>
__device__ __forceinline__ void merge_slices(const A* got, const ColumnSlices<C, VEC>& slices,
                                             const int n, const A eps, const A k, A& off,
                                             A& rs, A* mean, A* rstd) {
  const A k0 = got[0];
  A mu = 0;  // the row's mean minus k0
#pragma unroll 1
  for (int p = 0; p < C; ++p) {
    mu += slices.template elements<A>(p) * ((got[3 * p] - k0) + got[3 * p + 1]);
  }
  mu /= A(n);
  A m2 = 0;
#pragma unroll 1
  for (int p = 0; p < C; ++p) {
    const A dm = (got[3 * p] - k0) + got[3 * p + 1] - mu;
    m2 += got[3 * p + 2] + slices.template elements<A>(p) * dm * dm;
  }
  rs = rsqrt_acc(m2 / A(n) + eps);
  off = mu - (k - k0);
  if (mean != nullptr) {
    *mean = k0 + mu;
    *rstd = rs;
  }
}

}  // namespace cupyln
