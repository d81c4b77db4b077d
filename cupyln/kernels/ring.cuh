// cupyln/kernels/ring.cuh -- staging rings: shared memory filled with cp.async ahead of use.
//
// A group of GROUP threads (a block, or a warp) copies the spans it will work on next (a jagged
// sequence, a row, a row of x and one of dy) global -> shared into its ring of packs with
// cp.async (sm_80+: no registers hold data in flight), up to RING_DEPTH copy groups ahead of
// the span being computed, so the loads of the next spans overlap the passes over this one.
// Pack v of a span is copied and later read by thread v % GROUP of the group, so a thread waits
// only for its own copies; the group synchronizes once per span before its slots are reused.
// Used by ring_forward.cuh (the jagged forward and the dense forward's ring tier),
// layer_norm_fwd_staged.cu (the forward's cluster tier) and layer_norm_bwd_staged.cu (the
// backward's ring and cluster tiers).
#pragma once

#include "common.cuh"

namespace cupyln {

constexpr int RING_DEPTH = 6;  // copy groups in flight per thread, at most

// One pack of BYTES global -> shared: 4, 8 or 16 bytes in one cp.async, multiples of 16 in one
// cp.async per 16 bytes (packs of float w beside 16-bit x), 2 bytes (one 16-bit element) by an
// ordinary load and store.
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  static_assert(BYTES == 2 || BYTES == 4 || BYTES == 8 || BYTES % 16 == 0, "pack size");
  if constexpr (BYTES > 16) {
#pragma unroll
    for (int j = 0; j < BYTES; j += 16) {
      copy_async<16>(static_cast<char*>(dst) + j, static_cast<const char*>(src) + j);
    }
  } else if constexpr (BYTES == 16 || BYTES == 8 || BYTES == 4) {
    const unsigned s = shared_address(dst);
    if constexpr (BYTES == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(s), "l"(src), "n"(BYTES)
                   : "memory");
    }
  } else {
    *static_cast<unsigned short*>(dst) = *static_cast<const unsigned short*>(src);
  }
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Waits until at most n (0 <= n <= N) of this thread's newest copy groups are pending.
template <int N = RING_DEPTH>
__device__ __forceinline__ void wait_copies(const int n) {
  if constexpr (N == 0) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  } else if (n >= N) {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
  } else {
    wait_copies<N - 1>(n);
  }
}

// Synchronizes the GROUP threads of a group: the block (GROUP == BLOCK) or a warp (GROUP == 32).
template <int GROUP, int BLOCK>
__device__ __forceinline__ void group_sync() {
  static_assert(GROUP == BLOCK || GROUP == 32, "a group is the block or a warp");
  if constexpr (GROUP == BLOCK) {
    __syncthreads();
  } else {
    __syncwarp();
  }
}

// The ring of one group: packs [head, head + used) (mod size) hold staged sequences, oldest
// first; the next one goes at tail.
template <typename P, int GROUP>
struct Ring {
  P* slot;
  int size, head = 0, tail = 0, used = 0, ahead = 0;

  __device__ __forceinline__ int wrap(const int i) const { return i >= size ? i - size : i; }

  // Stages n packs from src at tail when they fit (this thread's share); false when full.
  __device__ __forceinline__ bool stage(const P* __restrict__ src, const int n, const int lane) {
    if (used + n > size) return false;
    int i = wrap(tail + lane);
    for (int v = lane; v < n; v += GROUP) {
      copy_async<sizeof(P)>(slot + i, src + v);
      i = wrap(i + GROUP);
    }
    commit_copies();
    tail = wrap(tail + n);
    used += n;
    ++ahead;
    return true;
  }

  // Waits for the oldest staged sequence (this thread's packs of it).
  __device__ __forceinline__ void wait_oldest() { wait_copies(--ahead); }

  __device__ __forceinline__ void release(const int n) {
    head = wrap(head + n);
    used -= n;
  }
};

}  // namespace cupyln
