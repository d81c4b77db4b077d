// cupyln/kernels/layer_norm_bwd.cu -- LayerNorm backward: dx, and dw/db as float32 partials;
// the register tiers. The staged tiers are in layer_norm_bwd_staged.cu, the dw/db column kernel
// and the partial rows' reduce in layer_norm_bwd_sums.cu.
//
// With xhat = (x - mean) * rstd and g = dy * w (g = dy without w):
//   dx = rstd * (g - mean_N(g) - xhat * mean_N(g * xhat)) + dh
//   dw = sum over rows of dy * xhat,    db = sum over rows of dy.
// The kernels take the forward's policies (policy.cuh): a Store of RMS (RMSNorm): mean = 0 and
// no mean_N(g) term; no db (db_part is not written). A Load with a residual (DH below): dh, the
// gradient along the residual stream, is added (known when compiling: the pointer alone, tested
// at run time, costs the 16-bit rows registers and spills).
// Parameters: CUPYLN_BWD_PARAMS (args.cuh), the same list for every kernel of this file but
// ln_partial_reduce.
// Inputs : dy, x [M, N] of T (own row strides, last dim contiguous), w [N] of TW or nullptr,
//          mean, rstd [M] of A = AccOf<T>; the kernels that write partials read inv_n, 1 / N
//          rounded to A (the register clusters and the row tier compute their own): read from
//          the constant bank where a row's means are formed, it takes no register, where a
//          value computed in the kernel was spilled with the row step and reloaded each row.
// Outputs: dx [M, N] of T, contiguous; dw_part, db_part [G, N] of A (dw_part may be nullptr
//          when no dw is wanted), summed afterwards by ln_partial_reduce in a fixed order.
//
// Determinism: every partial slot (a row of dw_part/db_part, or a cluster block's column slice
// of one) is written by exactly one block, whole (zeros when it owned no row); rows are visited
// in a fixed order and all sums, across a cluster's blocks too, are in a fixed order, so the
// same inputs give bitwise-identical dx, dw and db. No atomics anywhere.
#include "args.cuh"
#include "cluster.cuh"
#include "common.cuh"
#include "ring.cuh"

namespace cupyln {

// Blocks of the register tier asked to fit one SM (launch bounds): as many as hold 768 threads
// for 16-bit T (80 registers a thread), 640 for wider T with at most 4 vector slots (102; more
// slots spill), else one: registers would otherwise leave a wide row's block alone on its SM.
// With SHARED_SUMS (the dw/db sums in shared memory) a thread keeps only x and dy: 1024
// threads per SM (64 registers), so two blocks of 512 share an SM.
// Those blocks also need their shared memory (the next row's packs and the sums, 16-byte packs
// of T, and w with STAGE_W): no more of them than the architecture's shared memory holds
// (SMEM_BLOCK_OPTIN), so a lone block of 512 threads with 4 slots gets the registers it needs
// (96) instead of spilling at 64.
// Blocks of several row groups of more than a warp (the plan's BWD_GROUP_BLOCK) whose threads
// hold at most 12 elements of x (BWD_GROUP_VALUES) also get 1024 threads (64 registers, as the
// lone 64-thread blocks of those rows reach unasked; docs/tuning.md has the A/B). Groups
// of wider rows (short launches) keep the 768 threads of their lone blocks.
template <typename T, int ITEMS, int VEC, int TPR, int BLOCK, bool SHARED_SUMS, bool STAGE_W>
struct BwdRegBlocks {
  static constexpr bool lean = TPR > 32 && TPR < BLOCK && ITEMS * VEC <= 12;
  static constexpr int threads = SHARED_SUMS || lean ? 1024
                                 : sizeof(T) == 2 ? 768 : ITEMS <= 4 ? 640 : 0;
  static constexpr int by_threads = sm_blocks(threads / BLOCK > 0 ? threads / BLOCK : 1);
  static constexpr long values = static_cast<long>(BLOCK) * ITEMS * (16 / sizeof(T));
  static constexpr long smem = 2 * values * (sizeof(T) + sizeof(typename AccOf<T>::type)) +
                               (STAGE_W ? values * sizeof(T) : 0);
  static constexpr int by_smem = SHARED_SUMS ? static_cast<int>(SMEM_BLOCK_OPTIN / smem) : by_threads;
  static constexpr int value = by_smem < 1 ? 1 : by_smem < by_threads ? by_smem : by_threads;
};

// Blocks of ln_bwd_reg_cluster asked to fit one SM: 512 threads an SM (128 registers a thread
// for two rows of x and dy) in blocks of up to 256 threads (three blocks of 160 an SM, two of
// 256); one larger block.
template <int BLOCK>
struct LagBlocks {
  static constexpr int value = BLOCK <= 256 ? 512 / BLOCK : 1;
};

// f(i, pack i of x's row xr, pack i of dy's row gr) for each vector slot i of the thread at
// `lane` of its row's TPR threads that the row of N elements has (ln_bwd_reg's layout).
template <int ITEMS, int TPR, int VEC, typename T, typename F>
__device__ __forceinline__ void row_packs(const T* __restrict__ xr, const T* __restrict__ gr,
                                          const int lane, const int N, F&& f) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int col = (i * TPR + lane) * VEC;
    if (col < N) f(i, xr + col, gr + col);
  }
}

// One thread's state of ln_bwd_reg's rows (bwd_reg_rows below): its packs of x and dy, their
// rows' statistics, the dw/db accumulators, and where its slots lie in shared memory. The
// global pointers are not members: they come to each function as __restrict__ parameters, so
// that the loads of x, dy and w stay read-only ones (args.cuh).
template <typename T, typename TW, int VEC, int ITEMS, int TPR, int BLOCK, bool AHEAD,
          bool SHARED_SUMS, int C, bool STAGE_W, bool RMS, bool DH>
struct BwdRegRows {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  typedef Pack<TW, VEC> WP;
  typedef BwdRegBlocks<T, ITEMS, VEC, TPR, BLOCK, SHARED_SUMS, STAGE_W> Blocks;
  static constexpr int ROWS = BLOCK / TPR;
  static constexpr int SLOTS = TPR * ITEMS * VEC;  // padded row length owned by one row group
  static constexpr bool LAG = C > 1;               // a cluster's rows overlap
  static constexpr int SETS = LAG ? 2 : 1;
  // SHARED_SUMS: the thread's dw/db sums of slot i in 16-byte chunks, chunk c of dw at
  // sums[(i * CHUNKS + c) * TPR] and of db CHUNKS * ITEMS * TPR chunks later (after the AHEAD
  // packs), so a warp's accesses are consecutive 16-byte words
  static constexpr int CHUNK = 16 / sizeof(A);  // values of A a chunk
  typedef Pack<A, CHUNK> Chunk;
  static constexpr int CHUNKS = VEC / CHUNK;
  // FUSED (16-bit rows whose dw/db sums are formed in pass 2): pass 1 forms xhat + lo =
  // x * r - hi in one fused multiply-add (widen_xd's plus_lo), where (x - mu) * r takes two:
  // hi = mu * r rounded and lo = mu * r - hi (exact, by a second one once a row), and
  // sum(xhat * g) = sum((xhat + lo) * g) - lo * sum(g) carries no error from rounding mu * r
  // (taken as xhat, x * r - hi errs by up to 2^-24 |mu * r|: 0.5 in a row of 30000s, whose rstd
  // is 1/sqrt(eps)). Pass 2 of every 16-bit row forms dx as g * r - xhat * (c1 * r) - c2 * r,
  // two fused multiply-adds where (g - (xhat * c1 + c2)) * r takes three. 16-bit rows are bound
  // by issuing instructions, float16's by the FMA pipe, which each of its widenings takes too,
  // so every instruction saved there shows. The rows that form dw/db in pass 1 keep xhat plain
  // there, as dw needs it (the correction dw's fused xhat needs costs what the fusion saves).
  static constexpr bool FUSED = sizeof(T) == 2 && SHARED_SUMS;
  // KEEP_G: with one block per SM, pass 2 keeps g from pass 1 instead of widening dy and
  // reloading w again (docs/tuning.md has it against reloading).
  static constexpr bool KEEP_G = Blocks::value == 1 && !SHARED_SUMS;
  // EARLY (16-bit DH rows): the row's dh packs are loaded before its reduction (a cluster:
  // before the wait for the cluster's sums), so their latency overlaps the barrier or the wait
  // instead of following it. Where a block has its SM alone, in clusters of two blocks an SM,
  // and in RMSNorm rows whose blocks share an SM (the others cover only part of the wait).
  // Not in LayerNorm rows whose blocks share an SM, whose dh registers spilled, nor in clusters
  // of three blocks an SM: there the dh registers spilled (docs/tuning.md, EARLY). sm_90
  // only: later architectures' ptxas spilled them too.
  static constexpr bool EARLY = DH && sizeof(T) == 2 && !NEWER_ARCH &&
                                (C == 1 ? Blocks::value == 1 || RMS : LagBlocks<BLOCK>::value == 2);
  // EARLY_N: the packs EARLY loads. In LayerNorm clusters of blocks over 192 threads (under 160
  // registers a thread) the last pack is loaded after the wait: with all of them held across
  // it, ptxas spilled to local memory (L2, as the shared memory takes nearly all of L1), and
  // float16's widening spilled more.
  static constexpr bool LAST_LATE = EARLY && C > 1 && !RMS && BLOCK > 192 && ITEMS > 1;
  static constexpr int EARLY_N = LAST_LATE ? ITEMS - 1 : EARLY ? ITEMS : 1;
  // PF (bf16 DH rows of a block, without EARLY): the row's dh lines are prefetched into L1
  // where EARLY would load them, so pass 2 finds them there instead of waiting on HBM. Not in
  // float16 rows, where the prefetch's addresses spilled (ptxas), nor in clusters, whose
  // cluster-scope waits invalidate L1 (and a prefetch into L2 lost there: docs/tuning.md).
  static constexpr bool PF = DH && Same<T, bf16_t>::value && C == 1 && !EARLY;
  static_assert(TPR <= 32 ? 32 % TPR == 0 : TPR % 32 == 0, "bad tiling");
  static_assert(BLOCK % 32 == 0 && BLOCK % TPR == 0 && BLOCK <= 1024, "bad block");
  static_assert(C == 1 || (AHEAD && SHARED_SUMS && ROWS == 1 && C <= 32),
                "a cluster: a block per row, AHEAD, the sums in shared memory");
  static_assert(!SHARED_SUMS || (AHEAD && ROWS == 1 && sizeof(P) == 16 &&
                                 CHUNKS * CHUNK == VEC),
                "SHARED_SUMS: a block per row, the next row ahead in 16-byte packs");
  static_assert(!STAGE_W || (sizeof(TW) == sizeof(T) && (!AHEAD || ROWS == 1)),
                "STAGE_W: w of T's size");

  int lane, lo, n;  // the thread's place in its row group; the block's columns [lo, lo + n)
  A dw_acc[SHARED_SUMS ? 1 : ITEMS][VEC], db_acc[SHARED_SUMS ? 1 : ITEMS][VEC];
  // the row's x and dy as loaded, and its statistics (LAG: two rows', set s of two)
  P rx[SETS][ITEMS], rg[SETS][ITEMS];
  A mu_s[SETS], r_s[SETS];
  A mu_next, r_next;  // AHEAD: those of the row copied ahead
  // AHEAD: this thread's slots, x's vector i at sx[i * TPR] and dy's at sg[i * TPR]; the
  // SHARED_SUMS chunks after them; STAGE_W: the block's packs of w, slot i of the thread at
  // `lane` at ws[i * TPR]: after the sums (or after the AHEAD packs), or without AHEAD at the
  // start of the dynamic shared memory, one copy that the block's row groups share (the
  // first group makes it)
  P* sx;
  P* sg;
  Chunk* sums;
  WP* ws;
  A kept[KEEP_G ? ITEMS : 1][VEC];
  P rh[EARLY_N];

  __device__ __forceinline__ Chunk& dw_sums(const int i, const int c) {
    return sums[(i * CHUNKS + c) * TPR];
  }
  __device__ __forceinline__ Chunk& db_sums(const int i, const int c) {
    return sums[((ITEMS + i) * CHUNKS + c) * TPR];
  }
  __device__ __forceinline__ int column(const int i) const { return (i * TPR + lane) * VEC; }

  // Zero sums, the shared slots' places, and (STAGE_W) w's packs copied into them.
  __device__ __forceinline__ void start(const TW* __restrict__ w, unsigned char* dyn_smem) {
#pragma unroll
    for (int i = 0; i < (SHARED_SUMS ? 1 : ITEMS); ++i) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) dw_acc[i][k] = db_acc[i][k] = 0;
    }
    sx = reinterpret_cast<P*>(dyn_smem) + (threadIdx.x / TPR) * (2 * ITEMS * TPR) + lane;
    sg = sx + ITEMS * TPR;
    sums = reinterpret_cast<Chunk*>(sx + 2 * ITEMS * TPR);
    ws = AHEAD ? reinterpret_cast<WP*>(sums + (SHARED_SUMS ? 2 * ITEMS * CHUNKS * TPR : 0))
               : reinterpret_cast<WP*>(dyn_smem) + lane;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if constexpr (SHARED_SUMS) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
          for (int k = 0; k < CHUNK; ++k) dw_sums(i, c).v[k] = db_sums(i, c).v[k] = 0;
        }
      }
      const int col = column(i);
      if (STAGE_W && w != nullptr && col < n && (ROWS == 1 || threadIdx.x < TPR)) {
        ws[i * TPR] = *reinterpret_cast<const WP*>(w + lo + col);
      }
    }
    if constexpr (STAGE_W && ROWS > 1) __syncthreads();  // the first group's copy, for all
    mu_next = r_next = 0;
  }

  // Row r's packs and statistics into set 0, from global memory.
  __device__ __forceinline__ void fetch(const T* __restrict__ x, const i64 x_stride,
                                        const T* __restrict__ dy, const i64 dy_stride,
                                        const A* __restrict__ mean, const A* __restrict__ rstd,
                                        const i64 r) {
    mu_s[0] = RMS ? A(0) : mean[r];
    r_s[0] = rstd[r];
    row_packs<ITEMS, TPR, VEC>(x + r * x_stride + lo, dy + r * dy_stride + lo, lane, n,
                               [&](const int i, const T* xp, const T* gp) {
      rx[0][i] = *reinterpret_cast<const P*>(xp);
      rg[0][i] = *reinterpret_cast<const P*>(gp);
    });
  }

  // AHEAD: row r's packs copied into the thread's slots (cp.async) and its statistics read,
  // where r < M; a commit either way.
  __device__ __forceinline__ void prefetch(const T* __restrict__ x, const i64 x_stride,
                                           const T* __restrict__ dy, const i64 dy_stride,
                                           const A* __restrict__ mean, const A* __restrict__ rstd,
                                           const i64 M, const i64 r) {
    if (r < M) {
      mu_next = RMS ? A(0) : mean[r];
      r_next = rstd[r];
      row_packs<ITEMS, TPR, VEC>(x + r * x_stride + lo, dy + r * dy_stride + lo, lane, n,
                                 [&](const int i, const T* xp, const T* gp) {
        copy_async<sizeof(P)>(sx + i * TPR, xp);
        copy_async<sizeof(P)>(sg + i * TPR, gp);
      });
    }
    commit_copies();
  }

  // The row copied ahead, into register set s.
  __device__ __forceinline__ void take(const int s) {
    wait_copies<0>(0);
    mu_s[s] = mu_next;
    r_s[s] = r_next;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (column(i) < n) {
        rx[s][i] = sx[i * TPR];
        rg[s][i] = sg[i * TPR];
      }
    }
  }

  // xhat, dy and g = dy * w of the pack at col, slot i of set s, widened from the packs as
  // loaded (half the registers of float copies for 16-bit T). Where the launch bounds ask for
  // several blocks per SM, the second pass widens them again and reloads w (from L1).
  __device__ __forceinline__ A xhat(const int s, const int i, const int k) {
    return (widen_at<A>(rx[s][i], k) - mu_s[s]) * r_s[s];
  }
  __device__ __forceinline__ A hi(const int s) { return mu_s[s] * r_s[s]; }
  __device__ __forceinline__ A xhat_lo(const int s, const int i, const int k) {
    return fma(widen_at<A>(rx[s][i], k), r_s[s], -hi(s));
  }
  // plus_lo (a constant of the caller): xhat + lo in xh
  __device__ __forceinline__ void widen_xd(const int s, const int i, A (&xh)[VEC], A (&d)[VEC],
                                           const bool plus_lo) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      xh[k] = plus_lo ? xhat_lo(s, i, k) : xhat(s, i, k);
      d[k] = widen_at<A>(rg[s][i], k);
    }
  }
  __device__ __forceinline__ void times_w(const TW* __restrict__ w, const int i, const int col,
                                          const A (&d)[VEC], A (&g)[VEC]) {
    if (w != nullptr) {
      if constexpr (STAGE_W) {
        load_pack<A, TW, VEC>(reinterpret_cast<const TW*>(ws + i * TPR), g);
      } else {
        load_pack<A, TW, VEC>(w + lo + col, g);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) g[k] = w != nullptr ? d[k] * g[k] : d[k];
  }

  // Row r's dh packs in this thread's slots: loaded into rh (EARLY) or prefetched (PF).
  __device__ __forceinline__ void early_dh(const T* __restrict__ dh, const i64 dh_stride,
                                           const i64 r) {
    const T* __restrict__ dhr = dh + r * dh_stride + lo;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = column(i);
      if (col < n) {
        if constexpr (EARLY) {
          if (i < EARLY_N) rh[i] = *reinterpret_cast<const P*>(dhr + col);
        } else {
          prefetch_l1(dhr + col);
        }
      }
    }
  }

  // Pass 1: this thread's part of the row sums sum(xhat * g), sum(g) of set s (and without
  // SHARED_SUMS its dw/db).
  __device__ __forceinline__ void pass1(const TW* __restrict__ w, const int s, A& s1, A& s2) {
    s1 = s2 = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = column(i);
      if (col < n) {
        A xh[VEC], d[VEC], g[VEC];
        widen_xd(s, i, xh, d, FUSED);
        times_w(w, i, col, d, g);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if constexpr (!SHARED_SUMS) {
            dw_acc[i][k] += d[k] * xh[k];
            if constexpr (!RMS) db_acc[i][k] += d[k];
          }
          s1 += xh[k] * g[k];
          s2 += g[k];
          if constexpr (KEEP_G) kept[i][k] = g[k];
        }
      }
    }
    if constexpr (FUSED) s1 -= fma(mu_s[s], r_s[s], -hi(s)) * s2;  // lo * sum(g)
  }

  // SHARED_SUMS: slot i's dy * xhat and dy added to its dw/db sums.
  __device__ __forceinline__ void add_sums(const int i, const A (&xh)[VEC], const A (&d)[VEC]) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      Chunk sw = dw_sums(i, c), sb = db_sums(i, c);
#pragma unroll
      for (int k = 0; k < CHUNK; ++k) {
        const int e = c * CHUNK + k;
        sw.v[k] += d[e] * xh[e];
        if constexpr (!RMS) sb.v[k] += d[e];
      }
      dw_sums(i, c) = sw;
      if constexpr (!RMS) db_sums(i, c) = sb;
    }
  }

  // Pass 2: dx of the row `row` of set s from the row's mean_N(g * xhat), mean_N(g) (c1, c2).
  __device__ __forceinline__ void pass2(const TW* __restrict__ w, T* __restrict__ dx,
                                        const T* __restrict__ dh, const i64 dh_stride,
                                        const int N, const int s, const i64 row, const A c1,
                                        const A c2_row) {
    const A c2 = RMS ? A(0) : c2_row;
    T* __restrict__ dxr = dx + row * N + lo;
    const T* __restrict__ dhr = DH ? dh + row * dh_stride + lo : nullptr;
    const A r = r_s[s];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = column(i);
      if (col < n) {
        A xh[VEC], d[VEC], g[VEC], o[VEC];
        if constexpr (KEEP_G) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) {
            xh[k] = xhat(s, i, k);
            g[k] = kept[i][k];
          }
        } else {
          widen_xd(s, i, xh, d, false);  // with SHARED_SUMS, g after the sums
          if constexpr (!SHARED_SUMS) times_w(w, i, col, d, g);
        }
        if constexpr (SHARED_SUMS) {  // after the row sums, off the path to the barrier; before
          // dx's values, so that d and o are not live at once (ptxas spilled blocks of 448)
          add_sums(i, xh, d);
          times_w(w, i, col, d, g);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if constexpr (sizeof(T) == 2) {
            o[k] = fma(g[k], r, fma(xh[k], -(c1 * r), -(c2 * r)));
          } else {
            o[k] = (g[k] - (xh[k] * c1 + c2)) * r;
          }
        }
        if (EARLY && i < EARLY_N) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) o[k] += widen_at<A>(rh[i], k);
        } else if constexpr (DH) {
          add_grad<T, A, VEC>(dhr + col, o);
        }
        store_pack<T, A, VEC, (C > 1)>(dxr + col, o);
      }
    }
  }

  // This block's dw/db partial row q (its slice of the cluster's), whole.
  __device__ __forceinline__ void write_partials(A* __restrict__ dw_part,
                                                 A* __restrict__ db_part, const int N,
                                                 const unsigned q) {
    const i64 slot = static_cast<i64>(q) * N + lo;
    A* __restrict__ dw_out = dw_part != nullptr ? dw_part + slot : nullptr;
    A* __restrict__ db_out = RMS ? nullptr : db_part + slot;
    if constexpr (SHARED_SUMS) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = column(i);
        if (col < n) {
#pragma unroll
          for (int c = 0; c < CHUNKS; ++c) {
            if (dw_out != nullptr) {
              store_pack<A, A, CHUNK, (C > 1)>(dw_out + col + c * CHUNK, dw_sums(i, c).v);
            }
            if constexpr (!RMS) {
              store_pack<A, A, CHUNK, (C > 1)>(db_out + col + c * CHUNK, db_sums(i, c).v);
            }
          }
        }
      }
    } else if constexpr (ROWS == 1) {  // (a block of its own: clusters keep the sums shared)
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int col = column(i);
        if (col < n) {
          if (dw_out != nullptr) store_pack<A, A, VEC>(dw_out + col, dw_acc[i]);
          if constexpr (!RMS) store_pack<A, A, VEC>(db_out + col, db_acc[i]);
        }
      }
    } else {
      __shared__ A buf[ROWS * SLOTS];
      A* mine = buf + (threadIdx.x / TPR) * SLOTS;
      const int ncols = N < SLOTS ? N : SLOTS;
#pragma unroll
      for (int pass = 0; pass < 2; ++pass) {
        A* out = pass == 0 ? dw_out : RMS ? nullptr : db_out;
        if (out == nullptr) continue;  // uniform: dw not wanted, or no db
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
          for (int k = 0; k < VEC; ++k)
            mine[(i * TPR + lane) * VEC + k] = pass == 0 ? dw_acc[i][k] : db_acc[i][k];
        }
        __syncthreads();
        for (int c = threadIdx.x; c < ncols; c += BLOCK) {
          A t = buf[c];
#pragma unroll
          for (int g = 1; g < ROWS; ++g) t += buf[g * SLOTS + c];
          out[c] = t;
        }
        __syncthreads();
      }
    }
  }
};

// Tier "reg": x and dy rows in registers, fused dx + dw/db.
//   Layout as ln_fwd_reg (TPR threads per row, ITEMS vectors of VEC per thread). The grid is
//   persistent (G = gridDim.x blocks walk the rows) and each thread keeps dw/db accumulators
//   for its own columns in registers across all rows it visits. At the end the BLOCK / TPR
//   row groups of a block are combined through shared memory in group order and the block
//   writes row blockIdx.x of dw_part / db_part. Row groups of more than a warp in a block of
//   several (TPR = 64 or 128, BWD_GROUP_BLOCK) sum their rows under their own named
//   barrier (group_barrier).
//   x and dy stay in registers as loaded and are widened in each pass (BwdRegBlocks, KEEP_G).
//   With AHEAD, the next row's x and dy come through shared memory: each thread copies its
//   own packs of them with cp.async once its part of the current row's sums is formed (every
//   value it read from its slots went into those sums, so the reads are done) and moves them
//   into registers when it starts that row. Dynamic shared memory: 2 * BLOCK * ITEMS packs.
//   With SHARED_SUMS (a block per row, with AHEAD, 16-byte packs), the dw/db sums live in
//   dynamic shared memory after those packs (2 * BLOCK * ITEMS * VEC values of A), each thread
//   owning its columns' sums as it owned the registers, and are added to in pass 2 (after the
//   row's reduction, off the path to its barrier, and before g is formed again, so that x, dy
//   and g are not all live: ptxas spilled in the blocks of 512 threads, and the register
//   clusters with w staged lost with g formed after the sums): the registers left hold
//   x and dy, and blocks of up to 1024 threads fit.
//   With STAGE_W (w of T's size; backward_plan says where), the block copies its columns of w
//   into shared memory once (TPR * ITEMS packs of TW): with AHEAD each thread its own packs
//   after everything above; without, the first row group for all the block's groups at the
//   start of the dynamic shared memory (then one barrier). Both passes read w from there, not
//   through L1, which the staged rows and sums of the wider blocks leave too small to keep it.
//   ln_bwd_reg_cluster (sm_90+): rows split over a thread-block cluster of C such blocks, a
//   row a cluster: block k holds the columns [k*S, (k+1)*S) of each row (S = BLOCK * ITEMS *
//   VEC; the last block's slice may be shorter, or empty), the cluster walks rows q, q + Q, ...
//   (q of Q clusters), the blocks add their row sums through distributed shared memory in rank
//   order (ClusterExchange), and each block writes its slice of partial row q. Its stores are
//   whole 16-byte words (store_pack's WHOLE: the compiler split them into 2-byte stores).
//   A cluster's rows overlap (LAG): a block holds two rows in registers, and sends the next
//   row's sums before it waits for this row's and writes its dx, so the wait for the cluster's
//   slowest block overlaps a row's first pass. Rows alternate between the two register sets,
//   and the exchanges go through four slots (one outstanding). The launch bounds ask for 512
//   threads an SM (LagBlocks: 128 registers a thread for two rows of 4 packs of x and dy).
// Limits: N <= C * TPR * ITEMS * VEC; 2 * ITEMS * VEC registers of A for the accumulators
// (none with SHARED_SUMS) and up to as many for data (plans: ITEMS * VEC <= 16, or 32 in a
// lone block with SHARED_SUMS, or in a cluster, whose blocks hold two rows); AHEAD needs packs
// of 4, 8 or 16 bytes; C > 1 needs AHEAD, SHARED_SUMS, a block per row and 16-byte packs; row
// groups of more than a warp: at most 15 a block (named barriers 1-15).
template <typename T, typename TW, int VEC, int ITEMS, int TPR, int BLOCK, bool AHEAD,
          bool SHARED_SUMS, int C, bool STAGE_W, bool RMS, bool DH>
__device__ __forceinline__ void bwd_reg_rows(
    const T* __restrict__ dy, const i64 dy_stride, const T* __restrict__ x, const i64 x_stride,
    const TW* __restrict__ w, const typename AccOf<T>::type* __restrict__ mean,
    const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx,
    typename AccOf<T>::type* __restrict__ dw_part, typename AccOf<T>::type* __restrict__ db_part,
    const i64 M, const int N, const typename AccOf<T>::type inv_n,
    typename AccOf<T>::type* xch, const T* __restrict__ dh, const i64 dh_stride) {
  typedef BwdRegRows<T, TW, VEC, ITEMS, TPR, BLOCK, AHEAD, SHARED_SUMS, C, STAGE_W, RMS, DH> R;
  typedef typename AccOf<T>::type A;
  constexpr int ROWS = R::ROWS;
  __shared__ A reds[TPR > 32 ? 2 * BLOCK / 32 : 1];  // group_sum2's, a part per row group
  A* const red = reds + (TPR > 32 && ROWS > 1 ? threadIdx.x / TPR * 2 * (TPR / 32) : 0);
  ClusterExchange<C, A, 2, Sync::kAsync, 4> exchange{xch};

  R t;
  t.lane = threadIdx.x % TPR;
  // the cluster's index q of Q (the block's without a cluster: a cluster is C consecutive
  // blocks), and this block's columns of the row: [lo, lo + n) of N. From the block index, not
  // cluster.cuh's reads of the cluster registers: ptxas recomputes these where it needs them,
  // and keeping the registers' values spilled up to 52 bytes in fp16 blocks of 384 threads.
  const unsigned q = C > 1 ? blockIdx.x / C : blockIdx.x;
  const i64 step = static_cast<i64>(C > 1 ? gridDim.x / C : gridDim.x) * ROWS;
  t.lo = C > 1 ? static_cast<int>(blockIdx.x % C) * R::SLOTS : 0;
  t.n = C > 1 ? N - t.lo : N;
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  t.start(w, dyn_smem);
  auto prefetch = [&](const i64 r) { t.prefetch(x, x_stride, dy, dy_stride, mean, rstd, M, r); };

  i64 row = static_cast<i64>(q) * ROWS + threadIdx.x / TPR;
  if constexpr (AHEAD) prefetch(row);
  if constexpr (C > 1) exchange.start();
  if constexpr (R::LAG) {
    // row r + step's sums go out before row r's dx, so the wait for the cluster's sums of a
    // row overlaps the next row's first pass; rows alternate between the two register sets.
    // Each block sends exchange e + 2 only after its receive of exchange e (and a block
    // barrier, in group_sum2), so four slots hold the exchanges in flight (cluster.cuh).
    auto begin = [&](const int s, const i64 r) {  // row r into set s, and its sums sent
      t.take(s);
      prefetch(r + step);
      A s1, s2;
      t.pass1(w, s, s1, s2);
      group_sum2<TPR, true, BLOCK>(s1, s2, red);
      exchange.send({s1, s2});
    };
    auto finish = [&](const int s, const i64 r) {  // the cluster's sums of row r, its dx
      if constexpr (R::EARLY) t.early_dh(dh, dh_stride, r);
      A sums[2];
      exchange.receive_sums(sums);
      t.pass2(w, dx, dh, dh_stride, N, s, r, sums[0] * inv_n, sums[1] * inv_n);
    };
    if (row < M) begin(0, row);
    for (; row < M; row += 2 * step) {
      if (row + step < M) begin(1, row + step);
      finish(0, row);
      if (row + step >= M) break;
      if (row + 2 * step < M) begin(0, row + 2 * step);
      finish(1, row + step);
    }
  } else {
    for (; row < M; row += step) {
      if constexpr (AHEAD) {
        t.take(0);
      } else {
        t.fetch(x, x_stride, dy, dy_stride, mean, rstd, row);
      }
      if constexpr (R::EARLY || R::PF) t.early_dh(dh, dh_stride, row);
      A s1, s2;
      t.pass1(w, 0, s1, s2);
      // AHEAD: the next row's copies go out before the block's barrier, so they overlap the
      // wait for its slowest warp
      if constexpr (AHEAD) prefetch(row + step);
      group_sum2<TPR, true, BLOCK>(s1, s2, red);
      t.pass2(w, dx, dh, dh_stride, N, 0, row, s1 * inv_n, s2 * inv_n);
    }
  }
  t.write_partials(dw_part, db_part, N, q);
}

template <typename LD, typename ST, int VEC, int ITEMS, int TPR, int BLOCK, bool AHEAD,
          bool SHARED_SUMS, bool STAGE_W>
__global__ void __launch_bounds__(
    BLOCK, BwdRegBlocks<typename LD::X, ITEMS, VEC, TPR, BLOCK, SHARED_SUMS, STAGE_W>::value)
    ln_bwd_reg(CUPYLN_BWD_PARAMS) {
  static_assert(Same<typename ST::Y, typename LD::X>::value, "dy of x's dtype");
  release_dependents();  // ln_partial_reduce, launched after it, waits for the whole grid
  bwd_reg_rows<typename LD::X, typename ST::W, VEC, ITEMS, TPR, BLOCK, AHEAD, SHARED_SUMS, 1,
               STAGE_W, ST::RMS, LD::RES>(
      dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, inv_n, nullptr, dh,
      dh_stride);
}

template <typename LD, typename ST, int VEC, int ITEMS, int BLOCK, int C, bool STAGE_W>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, LagBlocks<BLOCK>::value)
    ln_bwd_reg_cluster(CUPYLN_BWD_PARAMS) {
  static_assert(Same<typename ST::Y, typename LD::X>::value, "dy of x's dtype");
  typedef typename LD::A A;
  __shared__ A xch[4 * C * 2];  // four slots of two sums a block
  release_dependents();
  // 1 / N computed here, not the parameter: taking it changed ptxas's allocation for the worse
  bwd_reg_rows<typename LD::X, typename ST::W, VEC, ITEMS, BLOCK, BLOCK, true, true, C, STAGE_W,
               ST::RMS, LD::RES>(
      dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, A(1) / A(N), xch,
      dh, dh_stride);
}

}  // namespace cupyln
