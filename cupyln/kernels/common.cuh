// cupyln/kernels/common.cuh -- building blocks shared by every cupyln kernel.
//
// Self-contained on purpose: no CUDA header is included, so NVRTC compiles these files with
// nothing but its own built-ins (fp16/bf16 are 16-bit storage types converted with PTX).
//
//   * element types: half_t, bf16_t (storage only), float, double; choose: one of two
//     arrays by a template flag;
//   * shared_address: the 32-bit shared-memory address of a __shared__ pointer;
//   * Acc<T>: the arithmetic type (double for double input, float for everything else);
//   * widen / narrow: element <-> arithmetic conversions (round-to-nearest-even); widen_at:
//     element k of a pack (bf16 through the 32-bit word holding it: one instruction);
//   * load_pack / store_pack: VEC consecutive elements in one access of VEC*sizeof(T) bytes
//     (the caller guarantees that alignment); normalize_values / normalize_store: one pack's
//     y, scaled and shifted;
//     l2_policy / load_hinted: a 16-byte load kept in place, under an L2 eviction policy (and
//     past L1 if asked); load_read_only: a 16-byte load of read-only data, through the
//     non-coherent path or the coherent one; prefetch_l1: a line brought into L1 ahead;
//   * walk_vectors: a group's strided walk over the packs of a span, U loads in flight;
//   * group_sum: a sum over the TPR threads that own one row, identical in every thread
//     (xor butterfly inside a warp, fixed-order sum of per-warp partials across warps), and
//     group_max, their largest value (both group_reduce);
//   * sum_over_y: fixed-order column sums in the (32, Y) blocks of the dw/db kernels;
//   * wait_prior_grid / release_dependents: programmatic dependent launch (sm_90+);
//   * SMEM_BLOCK_OPTIN: the opt-in shared bytes a block of the target architecture may have.
#pragma once

namespace cupyln {

typedef long long i64;

// The opt-in shared memory a block may have on the architecture being compiled for (the CUDA
// C++ Programming Guide's table of compute capabilities), for launch bounds that count the
// blocks an SM holds by their shared memory.
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870
constexpr long SMEM_BLOCK_OPTIN = 163L * 1024;
#elif __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200
constexpr long SMEM_BLOCK_OPTIN = 227L * 1024;
#else  // sm_86, sm_89, sm_120 and sm_121
constexpr long SMEM_BLOCK_OPTIN = 99L * 1024;
#endif

// Built for sm_100 or later: their ptxas needs more registers for the same code than sm_90's,
// on which every register budget here was tuned.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr bool NEWER_ARCH = true;
#else
constexpr bool NEWER_ARCH = false;
#endif

// Blocks an SM that the register tiers' launch bounds ask for, where the plans aim at `blocks`
// (the threads an SM tuned on sm_90): ptxas for sm_100 and later needs more registers for the
// same code and spills at sm_90's budget, so there they ask for three quarters of those blocks,
// at least one (the occupancy API then sizes the grids). Unchanged before sm_100.
__host__ __device__ constexpr int sm_blocks(int blocks) {
  return NEWER_ARCH ? (blocks * 3 / 4 > 0 ? blocks * 3 / 4 : 1) : blocks;
}

// The 32-bit shared-memory address of a pointer into __shared__ memory (for cp.async, mbarrier
// and DSMEM instructions).
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream
// serialization (cupyln/_driver.py) may start while the kernel before it on the stream still
// runs: its blocks become resident as the earlier kernel's blocks leave, instead of after the
// whole grid has drained. wait_prior_grid() holds it until that kernel has finished and its
// writes are visible: a dependent kernel calls it before it reads anything. release_dependents()
// lets the dependent grid launch once every block of this grid has called it (or exited). Both
// do nothing where no such launch is involved, and before sm_90.
__device__ __forceinline__ void wait_prior_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void release_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

struct half_t {
  unsigned short bits;
};
struct bf16_t {
  unsigned short bits;
};

// ------------------------------------------------------------------ arithmetic type
template <typename T>
struct AccOf {
  typedef float type;
};
template <>
struct AccOf<double> {
  typedef double type;
};

// ------------------------------------------------------------------ conversions
__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ double widen(double v) { return v; }
__device__ __forceinline__ float widen(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float widen(bf16_t v) {
  return __uint_as_float(static_cast<unsigned int>(v.bits) << 16);
}

template <typename T>
struct Narrow;
template <>
struct Narrow<float> {
  template <typename A>
  static __device__ __forceinline__ float from(A v) { return static_cast<float>(v); }
};
template <>
struct Narrow<double> {
  template <typename A>
  static __device__ __forceinline__ double from(A v) { return static_cast<double>(v); }
};
template <>
struct Narrow<half_t> {
  template <typename A>
  static __device__ __forceinline__ half_t from(A v) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(static_cast<float>(v)));
    return h;
  }
};
template <>
struct Narrow<bf16_t> {
  template <typename A>
  static __device__ __forceinline__ bf16_t from(A v) {
    const float f = static_cast<float>(v);
    bf16_t h;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
#else
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      h.bits = static_cast<unsigned short>((u >> 16) | 0x0040u);  // quiet NaN, sign kept
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      h.bits = static_cast<unsigned short>(u >> 16);
    }
#endif
    return h;
  }
};

template <typename T, typename A>
__device__ __forceinline__ T narrow(A v) {
  return Narrow<T>::from(v);
}

// a if C, else b: storage picked by a template flag
template <bool C, typename X, typename Y>
__device__ __forceinline__ auto& choose(X& a, Y& b) {
  if constexpr (C) {
    return a;
  } else {
    return b;
  }
}

// X if C, else Y
template <bool C, typename X, typename Y>
struct choose_type {
  typedef X type;
};
template <typename X, typename Y>
struct choose_type<false, X, Y> {
  typedef Y type;
};

template <typename X, typename Y>
struct Same {  // whether X and Y are one type (NVRTC here has no <type_traits>)
  static constexpr bool value = false;
};
template <typename X>
struct Same<X, X> {
  static constexpr bool value = true;
};

// ------------------------------------------------------------------ vector access
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Where a thread's pack i of a row at p lies, the thread at t of S threads owning packs
// t, t + S, ...: at element (i * S + t) * VEC (an int), or (PacksAt) as pack i * S + t of
// the row's packs (a pointer to packs, advanced). The same address, computed as the tier
// computes it.
template <int VEC, int S>
struct ElementsAt {
  int t;
  template <typename T>
  __device__ __forceinline__ const T* operator()(const T* p, const int i) const {
    return p + (i * S + t) * VEC;
  }
};
template <int VEC, int S>
struct PacksAt {
  int t;
  template <typename T>
  __device__ __forceinline__ const T* operator()(const T* p, const int i) const {
    return reinterpret_cast<const T*>(reinterpret_cast<const Pack<T, VEC>*>(p) + (i * S + t));
  }
};

// Element k of pk (k a compile-time constant after unrolling) widened to A.
template <typename A, typename T, int VEC>
__device__ __forceinline__ A widen_at(const Pack<T, VEC>& pk, const int k) {
  return static_cast<A>(widen(pk.v[k]));
}
// A bf16 element is the high half of a float: read through the 32-bit word that holds it and
// its neighbour, it costs one integer instruction (a shift for the low element, a mask for the
// high one) where the element alone costs an extract and a shift. The 16-bit rows are bound by
// issuing instructions more than by memory (Nsight Compute), so every instruction shows.
template <typename A, int VEC>
__device__ __forceinline__ A widen_at(const Pack<bf16_t, VEC>& pk, const int k) {
  if constexpr (VEC % 2 == 0) {
    unsigned word;
    memcpy(&word, &pk.v[k & ~1], sizeof(word));
    return static_cast<A>(__uint_as_float(k & 1 ? word & 0xffff0000u : word << 16));
  } else {
    return static_cast<A>(widen(pk.v[k]));
  }
}

// Loads VEC elements at p (aligned to VEC*sizeof(T)) and widens them to A.
template <typename A, typename T, int VEC>
__device__ __forceinline__ void load_pack(const T* __restrict__ p, A (&out)[VEC]) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = widen_at<A>(pk, k);
}

// An L2 eviction policy for load_hinted (sm_80+): EVICT_LAST lines are kept ahead of normal
// ones, evict_first lines are the first to go. 0 before sm_80 (load_hinted ignores it there).
template <bool EVICT_LAST>
__device__ __forceinline__ unsigned long long l2_policy() {
  unsigned long long p = 0;
#if __CUDA_ARCH__ >= 800
  if constexpr (EVICT_LAST) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  }
#endif
  return p;
}

// One 16-byte pack at p (aligned to 16 bytes, read-only for the kernel's lifetime) through the
// non-coherent path, under an l2_policy (sm_80+; a plain non-coherent load before). KEEP_L1:
// the line is allocated in L1 as usual; false: it is not (L1::no_allocate), for data read for
// the last time, so that it does not evict lines still to be read. volatile: the loads stay
// where the caller put them, in its order: the compiler may not keep a first pass's values
// for a second pass.
template <bool KEEP_L1 = true, typename P>
__device__ __forceinline__ P load_hinted(const P* __restrict__ p,
                                         const unsigned long long policy = 0) {
  static_assert(sizeof(P) == 16, "16-byte packs");
  unsigned w[4];
#if __CUDA_ARCH__ >= 800
  if constexpr (KEEP_L1) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %4;"
                 " ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [g], %5; }"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p), "l"(policy));
  } else {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %4;"
                 " ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [g], %5; }"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "l"(p), "l"(policy));
  }
#else
  asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %4;"
               " ld.global.nc.v4.u32 {%0, %1, %2, %3}, [g]; }"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(p));
#endif
  P out;
  memcpy(&out, w, sizeof(out));
  return out;
}

// One 16-byte pack at p (aligned to 16 bytes, read-only for the kernel's lifetime). COHERENT
// false: a plain read, which the compiler makes a non-coherent load (ld.global.nc, SASS
// LDG.E.128.CONSTANT) where p is const and __restrict__; true: ld.global (LDG.E.128), the
// coherent path. Both allocate in L1. Not volatile: the compiler may move, merge or drop it as it
// would a plain read. Which path a kernel takes changes how ptxas schedules and allocates
// registers around it (ln_fwd_stream's COHERENT_WB).
template <bool COHERENT, typename P>
__device__ __forceinline__ P load_read_only(const P* __restrict__ p) {
  static_assert(sizeof(P) == 16, "16-byte packs");
  if constexpr (COHERENT) {
    unsigned w[4];
    asm("{ .reg .u64 g; cvta.to.global.u64 g, %4; ld.global.v4.u32 {%0, %1, %2, %3}, [g]; }"
        : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
        : "l"(p));
    P out;
    memcpy(&out, w, sizeof(out));
    return out;
  } else {
    return *p;
  }
}

// Asks for the line holding p to be brought into L1 (prefetch.global.L1): no register holds it,
// and a later load of it finds it there unless it was evicted first.
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; prefetch.global.L1 [g]; }" ::"l"(p));
}

// Stores W 32-bit words at p (aligned to 16 bytes; W a multiple of 4) as whole 16-byte words
// through st.global.v4, which the compiler cannot split into narrower stores.
template <int W>
__device__ __forceinline__ void store_words(void* __restrict__ p, const unsigned (&w)[W]) {
  static_assert(W % 4 == 0, "16-byte words");
#pragma unroll
  for (int j = 0; j < W / 4; ++j) {
    asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; st.global.v4.b32 [g], {%1, %2, %3, %4}; }"
                 ::"l"(static_cast<char*>(p) + 16 * j), "r"(w[4 * j]), "r"(w[4 * j + 1]),
                 "r"(w[4 * j + 2]), "r"(w[4 * j + 3]));
  }
}

// Narrows VEC values to T and stores them at p (aligned to VEC*sizeof(T)). WHOLE (packs of 16
// bytes or several): as whole 16-byte words (store_words). A plain assignment of the struct may
// become one store per element where the compiler loses the alignment: the backward of rows
// split over a cluster (ln_bwd_reg_cluster) stored its 16-byte packs of dx as six 2-byte and one
// 4-byte stores, which tripled the stores' sectors. The other kernels keep the plain
// assignment: they compile to whole 16-byte stores as it is, and the words cost some of them
// (the compiler unrolls differently around them; docs/tuning.md).
template <typename T, typename A, int VEC, bool WHOLE = false>
__device__ __forceinline__ void store_pack(T* __restrict__ p, const A (&in)[VEC]) {
  Pack<T, VEC> pk;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pk.v[k] = narrow<T>(in[k]);
  if constexpr (WHOLE) {
    unsigned w[sizeof(pk) / 4];
    memcpy(w, &pk, sizeof(pk));
    store_words(p, w);
  } else {
    *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
  }
}

// o = ((x - k) - m) * rs * w + b for the VEC elements of pk (columns [col, col + VEC) of w and
// b, each optional: nullptr, or a TW/TB of void). k and m are subtracted one after the other:
// with k a shift near the data (the row's first element) and m the mean of x - k, large-mean
// rows keep their precision.
template <typename TW, typename TB, typename A, int VEC, typename S>
__device__ __forceinline__ void normalize_values(const Pack<S, VEC>& pk, const A k, const A m,
                                                 const A rs, const TW* __restrict__ w,
                                                 const TB* __restrict__ b, const int col,
                                                 A (&o)[VEC]) {
  A p[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) o[e] = (widen_at<A>(pk, e) - k - m) * rs;
  if constexpr (!Same<TW, void>::value) {
    if (w != nullptr) {
      load_pack<A, TW, VEC>(w + col, p);
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] *= p[e];
    }
  }
  if constexpr (!Same<TB, void>::value) {
    if (b != nullptr) {
      load_pack<A, TB, VEC>(b + col, p);
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] += p[e];
    }
  }
}

// normalize_values' y of one pack, stored at dst of T.
template <typename T, typename TW, typename TB, typename A, int VEC, typename S>
__device__ __forceinline__ void normalize_store(const Pack<S, VEC>& pk, const A k, const A m,
                                                const A rs, const TW* __restrict__ w,
                                                const TB* __restrict__ b, const int col,
                                                T* __restrict__ dst) {
  A o[VEC];
  normalize_values<TW, TB, A, VEC>(pk, k, m, rs, w, b, col, o);
  store_pack<T, A, VEC>(dst, o);
}

// Walks packs v = t, t + S, t + 2S, ... < nv of p (VEC elements each, p aligned to a pack) for
// thread t of a group of S threads, U loads issued before the first is used: calls f(v, pack)
// for each, in that order.
template <typename T, int VEC, int S, int U, typename F>
__device__ __forceinline__ void walk_vectors(const T* __restrict__ p, const i64 nv, const int t,
                                             F f) {
  const Pack<T, VEC>* __restrict__ packs = reinterpret_cast<const Pack<T, VEC>*>(p);
  for (i64 v0 = t; v0 < nv; v0 += U * S) {
    Pack<T, VEC> pk[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (v0 + u * S < nv) pk[u] = packs[v0 + u * S];
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (v0 + u * S < nv) f(v0 + u * S, pk[u]);
    }
  }
}

// ------------------------------------------------------------------ reductions
template <typename A>
__device__ __forceinline__ A shfl_xor(unsigned mask, A v, int lane_mask) {
  return __shfl_xor_sync(mask, v, lane_mask);
}

// Sum over the TPR consecutive threads that share a row. Every thread of the group gets the
// same bits back (the butterfly adds the same pairs in every lane; the cross-warp step sums the
// warp partials in one fixed order in every thread).
//   TPR <= 32: the group is an aligned slice of a warp; only its lanes take part.
//   TPR  > 32: whole warps; `red` (the group's own) holds TPR/32 values and the call contains
//              group_barrier<TPR, BLOCK>() (BLOCK = blockDim.x, a multiple of TPR), so every
//              thread of the group must call it.
//              GUARD: a first barrier waits until no thread still reads `red` from an earlier
//              call. A caller whose consecutive calls alternate between two buffers passes
//              false: one barrier per sum (a thread writes buffer A again only after passing
//              the barrier of a B call, which every thread reaches after its last read of A).
// A barrier of the TPR consecutive threads (whole warps) of a block of BLOCK: __syncthreads()
// when they are the block, else the group's own named barrier (1 + group; at most 15 groups).
template <int TPR, int BLOCK>
__device__ __forceinline__ void group_barrier() {
  static_assert(BLOCK % TPR == 0 && TPR % 32 == 0 && BLOCK / TPR <= 15, "groups of warps");
  if constexpr (TPR == BLOCK) {
    __syncthreads();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(1 + threadIdx.x / TPR), "n"(TPR) : "memory");
  }
}

// The index of this thread's warp within its group of TPR threads (whole warps).
template <int TPR, int BLOCK>
__device__ __forceinline__ unsigned group_warp() {
  return (TPR == BLOCK ? threadIdx.x : threadIdx.x % TPR) >> 5;
}

// op(a, b) of the group reductions: a sum, or the larger of two floats.
struct SumOp {
  template <typename A>
  __device__ __forceinline__ A operator()(const A a, const A b) const {
    return a + b;
  }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(const float a, const float b) const {
    return fmaxf(a, b);
  }
};

// op over the TPR consecutive threads of a row, identical in every thread of the group.
template <int TPR, bool GUARD, int BLOCK, typename A, typename Op>
__device__ __forceinline__ A group_reduce(A v, A* red, const Op op) {
  if constexpr (TPR <= 32) {
    unsigned mask = 0xffffffffu;
    if constexpr (TPR < 32) mask = ((1u << TPR) - 1u) << ((threadIdx.x & 31u) / TPR * TPR);
#pragma unroll
    for (int o = TPR / 2; o > 0; o /= 2) v = op(v, shfl_xor(mask, v, o));
    return v;
  } else {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = op(v, shfl_xor(0xffffffffu, v, o));
    if constexpr (GUARD) group_barrier<TPR, BLOCK>();  // no thread still reads `red`
    if ((threadIdx.x & 31u) == 0) red[group_warp<TPR, BLOCK>()] = v;
    group_barrier<TPR, BLOCK>();
    A t = red[0];
#pragma unroll
    for (int i = 1; i < TPR / 32; ++i) t = op(t, red[i]);
    return t;
  }
}

template <int TPR, bool GUARD = true, int BLOCK = TPR, typename A>
__device__ __forceinline__ A group_sum(A v, A* red) {
  return group_reduce<TPR, GUARD, BLOCK>(v, red, SumOp{});
}

// The largest v over the TPR consecutive threads of a row, in every thread of the group: as
// group_sum (GUARD always: `red` may be any buffer of TPR/32 values that the group owns).
template <int TPR, int BLOCK = TPR>
__device__ __forceinline__ float group_max(float v, float* red) {
  return group_reduce<TPR, true, BLOCK>(v, red, MaxOp{});
}

// Two sums in one pass of synchronisation (the backward needs sum(xhat*wdy) and sum(wdy)); `red`
// holds 2 * TPR/32 values, GUARD as for group_sum.
template <int TPR, bool GUARD = true, int BLOCK = TPR, typename A>
__device__ __forceinline__ void group_sum2(A& a, A& b, A* red) {
  if constexpr (TPR <= 32) {
    a = group_sum<TPR>(a, red);
    b = group_sum<TPR>(b, red);
  } else {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      a += shfl_xor(0xffffffffu, a, o);
      b += shfl_xor(0xffffffffu, b, o);
    }
    if constexpr (GUARD) group_barrier<TPR, BLOCK>();
    if ((threadIdx.x & 31u) == 0) {
      red[group_warp<TPR, BLOCK>()] = a;
      red[TPR / 32 + group_warp<TPR, BLOCK>()] = b;
    }
    group_barrier<TPR, BLOCK>();
    A ta = red[0], tb = red[TPR / 32];
#pragma unroll
    for (int i = 1; i < TPR / 32; ++i) {
      ta += red[i];
      tb += red[TPR / 32 + i];
    }
    a = ta;
    b = tb;
  }
}

// Column sums in a (32, Y) block: adds the Y partial pairs (a, b) of each column, in threadIdx.y
// order. The sums are valid in the threads with threadIdx.y == 0; every thread must call it.
template <int Y, typename A>
__device__ __forceinline__ void sum_over_y(A& a, A& b) {
  __shared__ A sa[Y][32], sb[Y][32];
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0) {
#pragma unroll
    for (int j = 1; j < Y; ++j) {
      a += sa[j][threadIdx.x];
      b += sb[j][threadIdx.x];
    }
  }
}

// ------------------------------------------------------------------ the norm family
template <typename A>
__device__ __forceinline__ A rsqrt_acc(A v);
template <>
__device__ __forceinline__ float rsqrt_acc<float>(float v) { return rsqrtf(v); }
template <>
__device__ __forceinline__ double rsqrt_acc<double>(double v) { return rsqrt(v); }

// rstd of a row from its exact mean and biased variance: LayerNorm 1 / sqrt(var + eps); RMS
// 1 / sqrt(mean(x^2) + eps), with mean(x^2) = var + mean^2 (two non-negative terms: no
// cancellation), so that every tier's two-pass statistics serve both norms.
template <bool RMS, typename A>
__device__ __forceinline__ A rstd_of(const A var, const A mean, const A eps) {
  return rsqrt_acc(RMS ? var + mean * mean + eps : var + eps);
}

// Row `row`'s statistics, where stored: LayerNorm's mean m and rstd r where mean is not null (both
// or neither), RMSNorm's r where rstd is not null.
template <bool RMS, typename A>
__device__ __forceinline__ void store_stats(A* mean, A* rstd, const i64 row, const A m, const A r) {
  if constexpr (RMS) {
    if (rstd != nullptr) rstd[row] = r;
  } else if (mean != nullptr) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// o[k] += dh[k] for the VEC elements at p (a pack): the gradient along the residual stream,
// added to dx.
template <typename T, typename A, int VEC>
__device__ __forceinline__ void add_grad(const T* __restrict__ p, A (&o)[VEC]) {
  A d[VEC];
  load_pack<A, T, VEC>(p, d);
#pragma unroll
  for (int k = 0; k < VEC; ++k) o[k] += d[k];
}

// h = x + res for the VEC elements of px and pr, added in A and rounded to TH (what the norm
// then reads), stored at dst.
template <typename A, typename TH, typename T, typename TR, int VEC>
__device__ __forceinline__ Pack<TH, VEC> add_residual(const Pack<T, VEC>& px,
                                                      const Pack<TR, VEC>& pr,
                                                      TH* __restrict__ dst) {
  Pack<TH, VEC> ph;
#pragma unroll
  for (int e = 0; e < VEC; ++e) ph.v[e] = narrow<TH>(widen_at<A>(px, e) + widen_at<A>(pr, e));
  *reinterpret_cast<Pack<TH, VEC>*>(dst) = ph;
  return ph;
}

}  // namespace cupyln
