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

// The address of `*local` (a __shared__ address) in block `rank` of the cluster.
__device__ __forceinline__ unsigned remote_address(const void* local, const unsigned rank) {
  unsigned d = 0;
#if CUPYLN_CLUSTERS
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(d) : "r"(shared_address(local)),
               "r"(rank));
#endif
  return d;
}

// Stores v (float or double) at `dst`, a shared::cluster address from remote_address; ASYNC:
// with st.async, counting its bytes on the mbarrier at shared::cluster address `bar` of the same
// block.
template <bool ASYNC, typename A>
__device__ __forceinline__ void store_remote(const unsigned dst, const A v, const unsigned bar) {
#if CUPYLN_CLUSTERS
  if constexpr (ASYNC && sizeof(A) == 4) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                     dst),
                 "r"(__float_as_uint(v)), "r"(bar)
                 : "memory");
  } else if constexpr (ASYNC) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];" ::"r"(
                     dst),
                 "l"(__double_as_longlong(v)), "r"(bar)
                 : "memory");
  } else if constexpr (sizeof(A) == 4) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(dst), "f"(v) : "memory");
  } else {
    asm volatile("st.shared::cluster.f64 [%0], %1;" ::"r"(dst), "d"(v) : "memory");
  }
#else
  __trap();
#endif
}

// How a ClusterExchange waits for the other blocks' values.
//   kBarrier: plain stores into the other blocks' shared memory, then the cluster barrier (its
//   arrive releases, its wait acquires). The release orders all of the thread's earlier memory
//   operations, the row's global stores among them.
//   kAsync, kAsyncCluster: st.async stores, each counting its bytes on an mbarrier of the
//   receiving block, which waits on that mbarrier alone, acquiring at CTA or cluster scope: no
//   cluster barrier and no release on a row's path.
//   The forward's register clusters take kAsyncCluster (with four slots where a block holds two
//   rows, though a receive comes between its sends: docs/tuning.md); the backward's
//   kAsync, with four slots (a row's sums sent before the previous row's are received); the
//   staging clusters kBarrier. Each was the fastest of the three where it is taken: the
//   barrier's release of every earlier store costs the register clusters, and the mbarriers
//   cost the staging clusters (docs/tuning.md). ptxas follows each successful kAsyncCluster
//   wait with CCTL.IVALL, which empties the SM's L1 once a row: the forward clusters then read
//   w and b from L2, at no cost that shows (kAsync keeps them in L1 and loses: docs/tuning.md).
enum class Sync { kBarrier, kAsync, kAsyncCluster };

// W values from each of the C blocks of a cluster to every block, once a row: send() gives
// this block's values (block-wide: the same in every thread) to every block (thread p < C
// writes them into block p), and the next receive() waits for the C blocks' values of that
// exchange and returns them, block p's at [p * W, (p + 1) * W), which the caller combines in
// rank order so every block gets bitwise the same result. Work between the two overlaps the
// exchange. Exchanges take the SLOTS parts of the slots in turn: the n-th uses part n % SLOTS.
//   kBarrier: two parts, a receive() between two send()s. A block writes a part again only
// after the wait of the next exchange, which no block passes before every thread of every
// block has read that part (its reads precede its next arrive).
//   kAsync*: thread 0 of each block arrives on the part's mbarrier expecting C * W values, and
// the part's phase (parity n / SLOTS % 2) completes when all C blocks' values are in. The
// caller puts a barrier of its block (__syncthreads, as in a block-wide sum) between its reads
// of a receive() and its next send(). With two parts a receive() comes between two send()s: a
// block writes a part again (exchange n + 2) only after it received exchange n + 1, which no
// block sends before its threads have read exchange n. With four, a block may send exchange
// n + 1 before it receives exchange n, and sends exchange n + 2 only after that receive: a
// block writes a part again (exchange n + 4) only after it received exchange n + 2, which no
// block sends before its threads have read exchange n. (Three parts would let a block write
// exchange n + 3 once it received n + 1, while another may still wait for exchange n.)
// Every thread of every block of the cluster makes the same calls; start() once before the
// first send (it is the kernel's first cluster barrier: every block runs before DSMEM is used).
template <int C, typename A, int W, Sync S = Sync::kBarrier, int SLOTS = 2>
struct ClusterExchange {
  static_assert(sizeof(A) == 4 || sizeof(A) == 8, "float or double");
  static constexpr bool kByBarrier = S == Sync::kBarrier;
  static_assert(SLOTS == 2 || (SLOTS == 4 && !kByBarrier), "four slots: mbarriers only");
  A* slots;           // SLOTS * C * W values of __shared__ memory at one offset in every block
  unsigned n = 0;     // exchanges received
  unsigned sent = 0;  // exchanges sent (SLOTS = 4)

  // kAsync*: the parts' mbarriers, __shared__ memory of their own. Kept in one struct with
  // the slots (which every mode declares), they cost the kBarrier kernels that stage rows in
  // dynamic shared memory (docs/tuning.md), so a kernel declares nothing for them.
  __device__ __forceinline__ static unsigned long long* bars() {
    __shared__ unsigned long long bar[SLOTS];
    return bar;
  }

  __device__ __forceinline__ void start() {
#if CUPYLN_CLUSTERS
    if (!kByBarrier && threadIdx.x == 0) {
#pragma unroll
      for (int h = 0; h < SLOTS; ++h) {  // one arrival a phase: thread 0's
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(&bars()[h]))
                     : "memory");
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
#endif
    cluster_sync();
  }

  __device__ __forceinline__ void send(const A (&v)[W]) {
#if CUPYLN_CLUSTERS
    const int h = (SLOTS == 2 ? n : sent) % SLOTS;  // (two slots: a receive between sends)
    if constexpr (SLOTS != 2) ++sent;
    if (!kByBarrier && threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                       shared_address(&bars()[h])),
                   "r"(static_cast<unsigned>(C * W * sizeof(A)))
                   : "memory");
    }
    if (threadIdx.x < C) {  // thread p writes to block p
      const unsigned p = threadIdx.x, r = cluster_rank();
      const unsigned bar = !kByBarrier ? remote_address(&bars()[h], p) : 0;
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const unsigned dst = remote_address(slots + (h * C + r) * W + j, p);
        store_remote<!kByBarrier>(dst, v[j], bar);
      }
    }
    if constexpr (S == Sync::kBarrier) cluster_arrive();
#else
    __trap();
#endif
  }

  __device__ __forceinline__ const A* receive() {
    const int h = n % SLOTS;
#if CUPYLN_CLUSTERS
    if constexpr (kByBarrier) {
      cluster_wait();
    } else {
      const unsigned bar = shared_address(&bars()[h]), parity = (n / SLOTS) & 1;
      unsigned done = 0;
      do {
        if constexpr (S == Sync::kAsync) {
          asm volatile(
              "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
              " selp.u32 %0, 1, 0, p;\n}"
              : "=r"(done)
              : "r"(bar), "r"(parity)
              : "memory");
        } else {
          asm volatile(
              "{\n .reg .pred p;\n"
              " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
              " selp.u32 %0, 1, 0, p;\n}"
              : "=r"(done)
              : "r"(bar), "r"(parity)
              : "memory");
        }
      } while (!done);
    }
#else
    __trap();
#endif
    ++n;
    return slots + h * C * W;
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
// squared deviations), with no E[x^2] - E[x]^2. Returns rs = 1 / sqrt(m2 / n + eps) (RMS:
// rstd_of's) and off = the row's mean minus `k`, the calling block's shift (RMS: -k, so that
// x - k - off is x); stores the mean and rs at *mean and *rstd where mean is not null (RMS: rs
// where rstd is not null; one thread of the cluster passes them). Divisions, once a row: a reciprocal held across the
// caller's loop over rows spills some variants.
template <bool RMS, int C, int VEC, typename A>
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
  rs = rstd_of<RMS>(m2 / A(n), k0 + mu, eps);
  off = RMS ? -k : mu - (k - k0);
  if constexpr (RMS) {
    if (rstd != nullptr) *rstd = rs;
  } else if (mean != nullptr) {
    *mean = k0 + mu;
    *rstd = rs;
  }
}

}  // namespace cupyln
