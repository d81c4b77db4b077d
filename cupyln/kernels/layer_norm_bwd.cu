// cupyln/kernels/layer_norm_bwd.cu -- LayerNorm backward: dx, and dw/db as float32 partials.
//
// With xhat = (x - mean) * rstd and g = dy * w (g = dy without w):
//   dx = rstd * (g - mean_N(g) - xhat * mean_N(g * xhat))
//   dw = sum over rows of dy * xhat,    db = sum over rows of dy.
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
// of T, and w with STAGE_W): no more of them than sm_90's 227 KB hold, so a lone block of 512
// threads with 4 slots gets the registers it needs (96) instead of spilling at 64.
// Blocks of several row groups of more than a warp (the plan's BWD_GROUP_BLOCK) whose threads
// hold at most 12 elements of x (BWD_GROUP_VALUES) also get 1024 threads (64 registers, as the
// lone 64-thread blocks of those rows reach unasked; 768 threads an SM measured slower). Groups
// of wider rows (short launches) keep the 768 threads of their lone blocks.
template <typename T, int ITEMS, int VEC, int TPR, int BLOCK, bool SHARED_SUMS, bool STAGE_W>
struct BwdRegBlocks {
  static constexpr bool lean = TPR > 32 && TPR < BLOCK && ITEMS * VEC <= 12;
  static constexpr int threads = SHARED_SUMS || lean ? 1024
                                 : sizeof(T) == 2 ? 768 : ITEMS <= 4 ? 640 : 0;
  static constexpr int by_threads = threads / BLOCK > 0 ? threads / BLOCK : 1;
  static constexpr long values = static_cast<long>(BLOCK) * ITEMS * (16 / sizeof(T));
  static constexpr long smem = 2 * values * (sizeof(T) + sizeof(typename AccOf<T>::type)) +
                               (STAGE_W ? values * sizeof(T) : 0);
  static constexpr int by_smem = SHARED_SUMS ? static_cast<int>(227L * 1024 / smem) : by_threads;
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
//   clusters with w staged ran slower with g formed after the sums): the registers left hold
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
          bool SHARED_SUMS, int C, bool STAGE_W>
__device__ __forceinline__ void bwd_reg_rows(
    const T* __restrict__ dy, const i64 dy_stride, const T* __restrict__ x, const i64 x_stride,
    const TW* __restrict__ w, const typename AccOf<T>::type* __restrict__ mean,
    const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx,
    typename AccOf<T>::type* __restrict__ dw_part, typename AccOf<T>::type* __restrict__ db_part,
    const i64 M, const int N, const typename AccOf<T>::type inv_n,
    typename AccOf<T>::type* xch) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  static_assert(TPR <= 32 ? 32 % TPR == 0 : TPR % 32 == 0, "bad tiling");
  static_assert(BLOCK % 32 == 0 && BLOCK % TPR == 0 && BLOCK <= 1024, "bad block");
  constexpr int ROWS = BLOCK / TPR;
  constexpr int SLOTS = TPR * ITEMS * VEC;  // padded row length owned by one row group
  static_assert(C == 1 || (AHEAD && SHARED_SUMS && ROWS == 1 && C <= 32),
                "a cluster: a block per row, AHEAD, the sums in shared memory");
  constexpr bool LAG = C > 1;  // a cluster's rows overlap
  __shared__ A reds[TPR > 32 ? 2 * BLOCK / 32 : 1];  // group_sum2's, a part per row group
  A* const red = reds + (TPR > 32 && ROWS > 1 ? threadIdx.x / TPR * 2 * (TPR / 32) : 0);
  typedef BwdRegBlocks<T, ITEMS, VEC, TPR, BLOCK, SHARED_SUMS, STAGE_W> Blocks;
  ClusterExchange<C, A, 2, Sync::kAsync, 4> exchange{xch};

  const int lane = threadIdx.x % TPR;
  // the cluster's index q of Q (the block's without a cluster: a cluster is C consecutive
  // blocks), and this block's columns of the row: [lo, lo + n) of N. From the block index, not
  // cluster.cuh's reads of the cluster registers: ptxas recomputes these where it needs them,
  // and keeping the registers' values spilled up to 52 bytes in fp16 blocks of 384 threads.
  const unsigned q = C > 1 ? blockIdx.x / C : blockIdx.x;
  const i64 step = static_cast<i64>(C > 1 ? gridDim.x / C : gridDim.x) * ROWS;
  const int lo = C > 1 ? static_cast<int>(blockIdx.x % C) * SLOTS : 0, n = C > 1 ? N - lo : N;

  A dw_acc[SHARED_SUMS ? 1 : ITEMS][VEC], db_acc[SHARED_SUMS ? 1 : ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < (SHARED_SUMS ? 1 : ITEMS); ++i) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) dw_acc[i][k] = db_acc[i][k] = 0;
  }

  // the row's x and dy as loaded, and its statistics (LAG: two rows', set s of two)
  constexpr int SETS = LAG ? 2 : 1;
  P rx[SETS][ITEMS], rg[SETS][ITEMS];
  A mu_s[SETS], r_s[SETS];
  auto fetch = [&](const i64 r) {
    mu_s[0] = mean[r];
    r_s[0] = rstd[r];
    row_packs<ITEMS, TPR, VEC>(x + r * x_stride + lo, dy + r * dy_stride + lo, lane, n,
                               [&](const int i, const T* xp, const T* gp) {
      rx[0][i] = *reinterpret_cast<const P*>(xp);
      rg[0][i] = *reinterpret_cast<const P*>(gp);
    });
  };

  // AHEAD: this thread's slots, x's vector i at sx[i * TPR] and dy's at sg[i * TPR]
  extern __shared__ __align__(16) unsigned char dyn_smem[];
  P* const sx = reinterpret_cast<P*>(dyn_smem) + (threadIdx.x / TPR) * (2 * ITEMS * TPR) + lane;
  P* const sg = sx + ITEMS * TPR;
  // SHARED_SUMS: the thread's dw/db sums of slot i in 16-byte chunks, chunk c of dw at
  // sums[(i * CHUNKS + c) * TPR] and of db CHUNKS * ITEMS * TPR chunks later (after the AHEAD
  // packs), so a warp's accesses are consecutive 16-byte words
  constexpr int CHUNK = 16 / sizeof(A);  // values of A a chunk
  typedef Pack<A, CHUNK> Chunk;
  constexpr int CHUNKS = VEC / CHUNK;
  static_assert(!SHARED_SUMS || (AHEAD && ROWS == 1 && sizeof(P) == 16 &&
                                 CHUNKS * CHUNK == VEC),
                "SHARED_SUMS: a block per row, the next row ahead in 16-byte packs");
  Chunk* const sums = reinterpret_cast<Chunk*>(sx + 2 * ITEMS * TPR);
  auto dw_sums = [&](const int i, const int c) -> Chunk& { return sums[(i * CHUNKS + c) * TPR]; };
  auto db_sums = [&](const int i, const int c) -> Chunk& {
    return sums[((ITEMS + i) * CHUNKS + c) * TPR];
  };
  // STAGE_W: the block's packs of w, copied once, slot i of the thread at `lane` at ws[i * TPR]:
  // after the sums (or after the AHEAD packs), or without AHEAD at the start of the dynamic
  // shared memory, one copy that the block's row groups share (the first group makes it)
  static_assert(!STAGE_W || (sizeof(TW) == sizeof(T) && (!AHEAD || ROWS == 1)),
                "STAGE_W: w of T's size");
  typedef Pack<TW, VEC> WP;
  WP* const ws = AHEAD ? reinterpret_cast<WP*>(sums + (SHARED_SUMS ? 2 * ITEMS * CHUNKS * TPR : 0))
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
    const int col = (i * TPR + lane) * VEC;
    if (STAGE_W && w != nullptr && col < n && (ROWS == 1 || threadIdx.x < TPR)) {
      ws[i * TPR] = *reinterpret_cast<const WP*>(w + lo + col);
    }
  }
  if constexpr (STAGE_W && ROWS > 1) __syncthreads();  // the first group's copy, for every group
  A mu_next = 0, r_next = 0;
  auto prefetch = [&](const i64 r) {
    if (r < M) {
      mu_next = mean[r];
      r_next = rstd[r];
      row_packs<ITEMS, TPR, VEC>(x + r * x_stride + lo, dy + r * dy_stride + lo, lane, n,
                                 [&](const int i, const T* xp, const T* gp) {
        copy_async<sizeof(P)>(sx + i * TPR, xp);
        copy_async<sizeof(P)>(sg + i * TPR, gp);
      });
    }
    commit_copies();
  };

  auto take = [&](const int s) {  // the row copied ahead, into register set s
    wait_copies<0>(0);
    mu_s[s] = mu_next;
    r_s[s] = r_next;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if ((i * TPR + lane) * VEC < n) {
        rx[s][i] = sx[i * TPR];
        rg[s][i] = sg[i * TPR];
      }
    }
  };

  // xhat, dy and g = dy * w of the pack at col, slot i of set s, widened from the packs as
  // loaded (half the registers of float copies for 16-bit T). Where the launch bounds ask for
  // several blocks per SM, the second pass widens them again and reloads w (from L1); with one
  // block per SM it keeps g from the first (KEEP_G), which measured faster than reloading.
  auto xhat = [&](const int s, const int i, const int k) {
    return (widen_at<A>(rx[s][i], k) - mu_s[s]) * r_s[s];
  };
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
  constexpr bool FUSED = sizeof(T) == 2 && SHARED_SUMS;
  auto hi = [&](const int s) { return mu_s[s] * r_s[s]; };
  auto xhat_lo = [&](const int s, const int i, const int k) {
    return fma(widen_at<A>(rx[s][i], k), r_s[s], -hi(s));
  };
  // plus_lo (a constant of the caller): xhat + lo in xh
  auto widen_xd = [&](const int s, const int i, A (&xh)[VEC], A (&d)[VEC], const bool plus_lo) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      xh[k] = plus_lo ? xhat_lo(s, i, k) : xhat(s, i, k);
      d[k] = widen_at<A>(rg[s][i], k);
    }
  };
  auto times_w = [&](const int i, const int col, const A (&d)[VEC], A (&g)[VEC]) {
    if (w != nullptr) {
      if constexpr (STAGE_W) {
        load_pack<A, TW, VEC>(reinterpret_cast<const TW*>(ws + i * TPR), g);
      } else {
        load_pack<A, TW, VEC>(w + lo + col, g);
      }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) g[k] = w != nullptr ? d[k] * g[k] : d[k];
  };
  constexpr bool KEEP_G = Blocks::value == 1 && !SHARED_SUMS;
  A kept[KEEP_G ? ITEMS : 1][VEC];

  // pass 1: this thread's part of the row sums sum(xhat * g), sum(g) of set s (and without
  // SHARED_SUMS its dw/db)
  auto pass1 = [&](const int s, A& s1, A& s2) {
    s1 = s2 = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) {
        A xh[VEC], d[VEC], g[VEC];
        widen_xd(s, i, xh, d, FUSED);
        times_w(i, col, d, g);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if constexpr (!SHARED_SUMS) {
            dw_acc[i][k] += d[k] * xh[k];
            db_acc[i][k] += d[k];
          }
          s1 += xh[k] * g[k];
          s2 += g[k];
          if constexpr (KEEP_G) kept[i][k] = g[k];
        }
      }
    }
    if constexpr (FUSED) s1 -= fma(mu_s[s], r_s[s], -hi(s)) * s2;  // lo * sum(g)
  };
  // pass 2: dx of the row `row` of set s from the row's mean_N(g * xhat), mean_N(g) (c1, c2)
  auto pass2 = [&](const int s, const i64 row, const A c1, const A c2) {
    T* __restrict__ dxr = dx + row * N + lo;
    const A r = r_s[s];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * TPR + lane) * VEC;
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
          if constexpr (!SHARED_SUMS) times_w(i, col, d, g);
        }
        if constexpr (SHARED_SUMS) {  // after the row sums, off the path to the barrier; before
          // dx's values, so that d and o are not live at once (ptxas spilled blocks of 448)
#pragma unroll
          for (int c = 0; c < CHUNKS; ++c) {
            Chunk sw = dw_sums(i, c), sb = db_sums(i, c);
#pragma unroll
            for (int k = 0; k < CHUNK; ++k) {
              const int e = c * CHUNK + k;
              sw.v[k] += d[e] * xh[e];
              sb.v[k] += d[e];
            }
            dw_sums(i, c) = sw;
            db_sums(i, c) = sb;
          }
          times_w(i, col, d, g);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          if constexpr (sizeof(T) == 2) {
            o[k] = fma(g[k], r, fma(xh[k], -(c1 * r), -(c2 * r)));
          } else {
            o[k] = (g[k] - (xh[k] * c1 + c2)) * r;
          }
        }
        store_pack<T, A, VEC, (C > 1)>(dxr + col, o);
      }
    }
  };

  i64 row = static_cast<i64>(q) * ROWS + threadIdx.x / TPR;
  if constexpr (AHEAD) prefetch(row);
  if constexpr (C > 1) exchange.start();
  if constexpr (LAG) {
    // row r + step's sums go out before row r's dx, so the wait for the cluster's sums of a
    // row overlaps the next row's first pass; rows alternate between the two register sets.
    // Each block sends exchange e + 2 only after its receive of exchange e (and a block
    // barrier, in group_sum2), so four slots hold the exchanges in flight (cluster.cuh).
    auto begin = [&](const int s, const i64 r) {  // row r into set s, and its sums sent
      take(s);
      prefetch(r + step);
      A s1, s2;
      pass1(s, s1, s2);
      group_sum2<TPR, true, BLOCK>(s1, s2, red);
      exchange.send({s1, s2});
    };
    auto finish = [&](const int s, const i64 r) {  // the cluster's sums of row r, its dx
      A sums[2];
      exchange.receive_sums(sums);
      pass2(s, r, sums[0] * inv_n, sums[1] * inv_n);
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
        take(0);
      } else {
        fetch(row);
      }
      A s1, s2;
      pass1(0, s1, s2);
      // AHEAD: the next row's copies go out before the block's barrier, so they overlap the
      // wait for its slowest warp
      if constexpr (AHEAD) prefetch(row + step);
      group_sum2<TPR, true, BLOCK>(s1, s2, red);
      pass2(0, row, s1 * inv_n, s2 * inv_n);
    }
  }

  // ---- this block's dw/db partial row (its slice of the cluster's)
  const i64 slot = static_cast<i64>(q) * N + lo;
  A* __restrict__ dw_out = dw_part != nullptr ? dw_part + slot : nullptr;
  A* __restrict__ db_out = db_part + slot;
  if constexpr (SHARED_SUMS) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
          if (dw_out != nullptr) {
            store_pack<A, A, CHUNK, (C > 1)>(dw_out + col + c * CHUNK, dw_sums(i, c).v);
          }
          store_pack<A, A, CHUNK, (C > 1)>(db_out + col + c * CHUNK, db_sums(i, c).v);
        }
      }
    }
  } else if constexpr (ROWS == 1) {  // (a block of its own: clusters keep the sums shared)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (col < n) {
        if (dw_out != nullptr) store_pack<A, A, VEC>(dw_out + col, dw_acc[i]);
        store_pack<A, A, VEC>(db_out + col, db_acc[i]);
      }
    }
  } else {
    __shared__ A buf[ROWS * SLOTS];
    A* mine = buf + (threadIdx.x / TPR) * SLOTS;
    const int ncols = N < SLOTS ? N : SLOTS;
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      A* out = pass == 0 ? dw_out : db_out;
      if (out == nullptr) continue;  // uniform: dw not wanted
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

template <typename T, typename TW, int VEC, int ITEMS, int TPR, int BLOCK, bool AHEAD,
          bool SHARED_SUMS, bool STAGE_W>
__global__ void __launch_bounds__(
    BLOCK, BwdRegBlocks<T, ITEMS, VEC, TPR, BLOCK, SHARED_SUMS, STAGE_W>::value)
    ln_bwd_reg(CUPYLN_BWD_PARAMS) {
  release_dependents();  // ln_partial_reduce, launched after it, waits for the whole grid
  bwd_reg_rows<T, TW, VEC, ITEMS, TPR, BLOCK, AHEAD, SHARED_SUMS, 1, STAGE_W>(
      dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, inv_n, nullptr);
}

template <typename T, typename TW, int VEC, int ITEMS, int BLOCK, int C, bool STAGE_W>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, LagBlocks<BLOCK>::value)
    ln_bwd_reg_cluster(CUPYLN_BWD_PARAMS) {
  typedef typename AccOf<T>::type A;
  __shared__ A xch[4 * C * 2];  // four slots of two sums a block
  release_dependents();
  // 1 / N computed here, not the parameter: taking it changed ptxas's allocation for the worse
  bwd_reg_rows<T, TW, VEC, ITEMS, BLOCK, BLOCK, true, true, C, STAGE_W>(
      dy, dy_stride, x, x_stride, w, mean, rstd, dx, dw_part, db_part, M, N, A(1) / A(N), xch);
}

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
template <typename T, typename TW, int VEC, int ITEMS, int BLOCK, int C, int LAG>
__device__ __forceinline__ void bwd_ring_rows(
    const T* __restrict__ dy, const i64 dy_stride, const T* __restrict__ x, const i64 x_stride,
    const TW* __restrict__ w, const typename AccOf<T>::type* __restrict__ mean,
    const typename AccOf<T>::type* __restrict__ rstd, T* __restrict__ dx,
    typename AccOf<T>::type* __restrict__ dw_part, typename AccOf<T>::type* __restrict__ db_part,
    const i64 M, const int N, const typename AccOf<T>::type inv_n) {
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
          db_acc[i][k] += gk;
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
    const A k1 = -rs * rs * c1, k0 = -rs * c2;
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
        store_pack<T, A, VEC>(dxr + v * VEC, o);
      }
    }
    r.release(2 * nv);
    __syncthreads();  // every thread is done with the row's slots before they are reused
  };

  i64 next = row_begin;  // the next row to stage
  A mu_held = 0, rs_held = 0;  // statistics of the row whose pass 2 is pending (LAG == 1)
  // each row's statistics are loaded a row ahead, so their latency is not waited for
  A mu_next = row_begin < row_end ? mean[row_begin] : A(0);
  A rs_next = row_begin < row_end ? rstd[row_begin] : A(0);
  for (i64 row = row_begin; row < row_end + LAG; ++row) {
    A s1 = 0, s2 = 0, mu = 0, rs = 0;
    if (row < row_end) {
      mu = mu_next;
      rs = rs_next;
      if (row + 1 < row_end) {
        mu_next = mean[row + 1];
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
      store_pack<A, A, VEC>(db_part + slot + v * VEC, db_acc[i]);
    }
  }
}

template <typename T, typename TW, int VEC, int ITEMS, int BLOCK>
__global__ void __launch_bounds__(BLOCK, 1)
    ln_bwd_ring(CUPYLN_BWD_PARAMS) {
  release_dependents();
  bwd_ring_rows<T, TW, VEC, ITEMS, BLOCK, 1, 0>(dy, dy_stride, x, x_stride, w, mean, rstd,
                                                dx, dw_part, db_part, M, N, inv_n);
}

template <typename T, typename TW, int VEC, int ITEMS, int BLOCK, int C, int LAG>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, 1)
    ln_bwd_cluster(CUPYLN_BWD_PARAMS) {
  release_dependents();
  bwd_ring_rows<T, TW, VEC, ITEMS, BLOCK, C, LAG>(dy, dy_stride, x, x_stride, w, mean, rstd,
                                                  dx, dw_part, db_part, M, N, inv_n);
}

// Tier "row": dx for rows too wide for registers, one block per row.
//   Pass 1 reads x and dy, UNROLL vectors of each per thread before using them (copying them to
//   shared memory with STAGE: 2 * N elements of T), and forms the two row sums; pass 2
//   recomputes xhat and g from shared memory (or from global memory without STAGE) and writes dx.
//   dw/db come from ln_bwd_dwdb_cols.
// Limits: any N < 2^31 - UNROLL * BLOCK * VEC.
template <typename T, typename TW, int VEC, int BLOCK, bool STAGE>
__global__ void __launch_bounds__(BLOCK, 1)
    ln_bwd_row(CUPYLN_BWD_PARAMS) {
  typedef typename AccOf<T>::type A;
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
    const A mu = mean[row];
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
    const A c1 = s1 * inv_cols, c2 = s2 * inv_cols;

    const T* __restrict__ src_x = STAGE ? stage_x : xr;
    const T* __restrict__ src_g = STAGE ? stage_g : gr;
    T* __restrict__ dxr = dx + row * N;
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
          store_pack<T, A, VEC>(dxr + col, xv[u]);
        }
      }
    }
  }
}

// dw/db partials for the "row" tier: column tiles over row slices.
//   Block (32, 8): threadIdx.x picks a column of the tile, threadIdx.y strides over the rows of
//   slice blockIdx.y (rows [blockIdx.y * rows_per_slice, +rows_per_slice)). The 8 partial sums
//   are added in y order and the block writes row blockIdx.y of dw_part / db_part.
template <typename T, typename TW = T>
__global__ void __launch_bounds__(256, 1)
    ln_bwd_dwdb_cols(CUPYLN_BWD_PARAMS) {
  typedef typename AccOf<T>::type A;
  release_dependents();
  const int col = blockIdx.x * 32 + threadIdx.x;
  const i64 r0 = static_cast<i64>(blockIdx.y) * rows_per_slice;
  const i64 r1 = r0 + rows_per_slice < M ? r0 + rows_per_slice : M;
  A dwa = 0, dba = 0;
  if (col < N) {
#pragma unroll 4
    for (i64 row = r0 + threadIdx.y; row < r1; row += 8) {
      const A g = static_cast<A>(widen(dy[row * dy_stride + col]));
      const A xhat = (static_cast<A>(widen(x[row * x_stride + col])) - mean[row]) * rstd[row];
      dwa += g * xhat;
      dba += g;
    }
  }
  sum_over_y<8>(dwa, dba);
  if (threadIdx.y == 0 && col < N) {
    const i64 o = static_cast<i64>(blockIdx.y) * N + col;
    if (dw_part != nullptr) dw_part[o] = dwa;
    db_part[o] = dba;
  }
}

// dw[c] = sum_g dw_part[g, c], db[c] = sum_g db_part[g, c], in a fixed order, cast to TW / TB.
//   Block (32, Y) over C columns (8, 16 or 32): lane x of warp y takes column x % C and row phase
//   p = y * 32 / C + x / C of the block's P = Y * 32 / C, adding the partial rows p, p + P, ...
//   in row order, U rows of each array loaded before it adds them (the partials are read once,
//   by N / C blocks, so each thread keeps 2 * U loads in flight). Then the Y sums of each lane
//   are added in y order, and the 32 / C lanes of a column in lane order. With C = 8 a warp's
//   load reads 32 bytes of each of 4 partial rows, 4 times the blocks of C = 32 for narrow N.
//   The grid is at most what the device holds at once; block b sums the column chunks b,
//   b + gridDim.x, ... (the plans' reduce_kernel picks Y and C).
template <typename A, typename TW, typename TB, int Y, int C>
__global__ void __launch_bounds__(32 * Y, 1)
    ln_partial_reduce(const A* __restrict__ dw_part, const A* __restrict__ db_part, const int G,
                      const int N, TW* __restrict__ dw, TB* __restrict__ db) {
  static_assert(C == 8 || C == 16 || C == 32, "columns per block");
  wait_prior_grid();  // the partials' kernel may still run (programmatic launch, sm_90)
  constexpr int U = 4;
  constexpr int P = Y * (32 / C);  // row phases
  for (int cb = blockIdx.x; cb * C < N; cb += gridDim.x) {
    if (cb != blockIdx.x) __syncthreads();  // the last chunk's shared sums are read
    const int col = cb * C + threadIdx.x % C;
    A dwa = 0, dba = 0;
    if (col < N) {
      int g = threadIdx.y * (32 / C) + threadIdx.x / C;
      for (; g + (U - 1) * P < G; g += U * P) {
        A pw[U], pb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const i64 o = static_cast<i64>(g + u * P) * N + col;
          pw[u] = dw_part != nullptr ? dw_part[o] : A(0);
          pb[u] = db_part[o];
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          dwa += pw[u];
          dba += pb[u];
        }
      }
      for (; g < G; g += P) {
        const i64 o = static_cast<i64>(g) * N + col;
        if (dw_part != nullptr) dwa += dw_part[o];
        dba += db_part[o];
      }
    }
    sum_over_y<Y>(dwa, dba);
    if (threadIdx.y == 0) {  // warp 0, every lane: lanes x, x + C, ... hold column x's sums
      A tw = dwa, tb = dba;
#pragma unroll
      for (int j = 1; j < 32 / C; ++j) {
        tw += __shfl_down_sync(0xffffffffu, dwa, j * C);
        tb += __shfl_down_sync(0xffffffffu, dba, j * C);
      }
      if (threadIdx.x < C && col < N) {
        if (dw != nullptr) dw[col] = narrow<TW>(tw);
        db[col] = narrow<TB>(tb);
      }
    }
  }
}

}  // namespace cupyln
