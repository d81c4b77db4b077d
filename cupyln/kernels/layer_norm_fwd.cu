// cupyln/kernels/layer_norm_fwd.cu -- LayerNorm forward: y = (x - mean) * rstd * w + b; the
// register tiers. The stream tier is in layer_norm_fwd_stream.cu, the staged tiers (ring,
// cluster, row) in layer_norm_fwd_staged.cu; this header is the family's overview.
//
// Parameters: CUPYLN_FWD_PARAMS (args.cuh), the same list for every kernel of this file.
// Inputs : x [M, N] of T, row r at x + r * x_stride (last dim contiguous); w [N] of TW and
//          b [N] of TB, each optional (nullptr = no scale / no shift). T is the Load's, TW and
//          TB the Store's (policy.cuh).
// Outputs: y [M, N] of the Store's TY, contiguous; mean [M] and rstd [M] of A = AccOf<T>
//          (float, or double for double input), rstd = 1 / sqrt(biased variance + eps); both
//          nullptr: not stored (inference, where no backward needs them).
//
// Statistics are exact two-pass from on-chip storage: the row is read from HBM once, its sum
// gives the mean, the sum of squared deviations from that mean gives the variance (never
// E[x^2] - E[x]^2; the stream tier merges exact per-pack statistics by Chan et al.'s update),
// and y is written once. Values are shifted by the row's first element
// before summing, so rows with a large mean (1e4 + noise) keep full float32 precision.
// Padding lanes hold 0 in the first pass and are skipped in the second. RMSNorm's register
// rows sum x^2 in one pass instead (a sum of non-negative terms: nothing cancels).
//
// Block-wide sums alternate between two shared buffers (mean, variance), so each costs one
// barrier: two per row.
// Rows are walked with a grid-stride loop (64-bit row offsets; any M with any grid: the plans
// give the register tier a block per group of rows, the other tiers their resident capacity),
// except in the stream tier, a block per row.
// Vector width VEC is chosen by the host so that N, the row stride and every pointer are
// multiples of VEC elements (16-byte accesses where possible).
// On sm_90, 16-bit rows of some widths from 512 to 20K elements stream instead (ln_fwd_stream:
// the threads of a row read it from HBM and again from L1 or L2, at more resident threads than
// registers holding the row allow). Rows too wide for one block's registers at several blocks
// an SM split over a thread-block cluster of register blocks (ln_fwd_reg_cluster). Other rows
// past the register tier that fit shared memory take the ring tier, ln_fwd_ring (the next rows
// load while one is reduced), and rows too wide for one block's ring the cluster tier
// (ln_fwd_cluster, sm_90); what remains, the row tier (ln_fwd_row). cupyln/_plans/forward.py
// chooses; docs/tuning.md has the measurements behind each choice.
#include "args.cuh"
#include "cluster.cuh"
#include "common.cuh"
#include "ring.cuh"

namespace cupyln {

// The sums over the packs a thread holds in registers (slot i where held(i)), as loaded or as
// centered copies (T is then A): of v - k, and of the squared deviations (v - k - d)^2; k a
// shift near the data, d the mean of v - k.
template <typename A, typename T, int VEC, int ITEMS, typename Held>
__device__ __forceinline__ A held_sum(const Pack<T, VEC> (&v)[ITEMS], const A k, Held held) {
  A s = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (held(i)) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += widen_at<A>(v[i], e) - k;
    }
  }
  return s;
}
template <typename A, typename T, int VEC, int ITEMS, typename Held>
__device__ __forceinline__ A held_squares(const Pack<T, VEC> (&v)[ITEMS], const A k, const A d,
                                          Held held) {
  A ss = 0;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (held(i)) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const A dev = widen_at<A>(v[i], e) - k - d;
        ss += dev * dev;
      }
    }
  }
  return ss;
}

// dst[i] = src[i] - k for the held slots i (dst in A; dst and src may be the same array).
template <typename A, typename S, int VEC, int ITEMS, typename Held>
__device__ __forceinline__ void center(Pack<A, VEC> (&dst)[ITEMS], const S (&src)[ITEMS],
                                       const A k, Held held) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (held(i)) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[i].v[e] = widen_at<A>(src[i], e) - k;
    }
  }
}

// Tier "reg": the row lives in registers.
//   TPR threads share a row, each holding ITEMS vectors of VEC elements, vector i of thread t at
//   columns [(i * TPR + t) * VEC, +VEC) (so a warp's accesses to one vector slot are contiguous).
//   TPR <= 32: BLOCK / TPR rows per block, reductions by warp shuffles inside the row's lanes.
//   TPR == BLOCK > 32: one row per block, reductions across warps through shared memory.
//   All of a row's loads are issued before the first is used, so each thread has ITEMS * 16
//   bytes in flight. Then the passes read the row in one of two forms:
//   * as loaded (CENTER false), widened again in each of the three passes: for 16-bit T half
//     the registers of float copies, so wide rows keep more of themselves on an SM;
//   * centered (CENTER): x - shift in A, once, then less the mean too, so each pass costs
//     one instruction (sum, square, scale) where the loaded form costs three or four. 16-bit
//     rows are bound by issuing instructions more than by memory, so narrow rows keep float
//     copies; float32 rows, which convert nothing, gain nothing from them. The copy is a
//     separate array for 16-bit T, the loaded one itself where T is A.
//   WHOLE: slots i < WHOLE are inside the row for every thread, read and written without the
//   per-slot check against N: at 64 registers ptxas keeps the centered copies of unchecked
//   slots and spills checked ones. Rows as loaded keep their checks (with none, ptxas widens
//   every element once, holds the floats and spills).
//   The next row is not loaded ahead of the current row's reductions: registers for it cost
//   more occupancy than the overlap gains (docs/tuning.md has this and the cp.async form).
//   MINB: blocks per SM asked of ptxas (launch bounds), so registers do not cap occupancy.
//   LD, ST: the Load and the Store (policy.cuh). A Load with a residual: the thread loads its
//   packs of x and res, stores h = x + res and holds h's packs, which the passes read as they
//   read x's: one read of x and res, one write of h and y.
// Limits: N <= TPR * ITEMS * VEC, and WHOLE * TPR * VEC <= N; registers grow with ITEMS * VEC
// (the plans keep it <= 64 values as loaded, 16 for double; centered, <= 128 bytes of A).
template <typename LD, typename ST, int VEC, int ITEMS, int TPR, int BLOCK, int MINB, bool CENTER,
          int WHOLE>
__global__ void __launch_bounds__(BLOCK, sm_blocks(MINB))
    ln_fwd_reg(CUPYLN_FWD_PARAMS) {
  typedef typename LD::A A;
  typedef typename LD::H TI;  // what the row holds: h, or x
  typedef Pack<TI, VEC> P;
  static_assert(TPR <= 32 ? (32 % TPR == 0 && BLOCK % 32 == 0) : TPR == BLOCK, "bad tiling");
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "bad block");
  constexpr int ROWS = BLOCK / TPR;
  __shared__ A red[2][TPR > 32 ? TPR / 32 : 1];  // the mean's and the variance's sums

  const int lane = threadIdx.x % TPR;
  const A inv_n = A(1) / A(N);
  const i64 step = static_cast<i64>(gridDim.x) * ROWS;

  // whether the thread holds slot i: the first WHOLE slots of every thread are inside the row
  auto held = [&](const int i) { return i < WHOLE || (i * TPR + lane) * VEC < N; };
  auto col = [&](const int i) { return (i * TPR + lane) * VEC; };
  const ElementsAt<VEC, TPR> at{lane};
  const QuantOut quant{qscale, qin, qamax, qvalue};
  float seen = 0.0f;  // a quantized y's largest |y| (ST::end)
  int parity = 0;     // RMSNorm's buffer of red for this row

  for (i64 row = static_cast<i64>(blockIdx.x) * ROWS + threadIdx.x / TPR; row < M; row += step) {
    const typename LD::X* __restrict__ xr = x + row * x_stride;
    const typename LD::R* __restrict__ rr =
        static_cast<const typename LD::R*>(res) + row * res_stride;
    TI* __restrict__ hr = static_cast<TI*>(h) + row * N;
    const TI first = LD::first(xr, rr);  // the shift
    P raw[ITEMS];                        // the row's elements as loaded (or as added)
    LD::template gather<VEC, ITEMS>(xr, rr, hr, held, at, col, raw);
    // what the passes read: raw, or (CENTER) x - shift in A, then less the mean too (in raw
    // itself where T is A)
    constexpr bool COPY = CENTER && sizeof(TI) != sizeof(A);
    Pack<A, VEC> centered[COPY ? ITEMS : 1];
    auto& held_x = choose<COPY>(centered, raw);
    const A shift = static_cast<A>(widen(first));
    // k and d: what each pass subtracts from the held values (x - k - d, in that order; the
    // centered form has subtracted them already, with the same roundings)
    A k = shift;
    if constexpr (CENTER) {
      center(held_x, raw, k, held);
      k = 0;
    }
    A d = 0, r;
    if constexpr (ST::RMS && !CENTER) {
      // RMSNorm: mean(x^2) in one pass and one sum (no cancellation to guard against), the
      // buffers alternating by row; y = x * rstd * w from the values as loaded
      r = ST::rstd(group_sum<TPR, false>(held_squares(held_x, A(0), A(0), held), red[parity]) *
                       inv_n,
                   A(0), eps);
      parity ^= 1;
      k = 0;
      if (lane == 0) ST::stats(mean, rstd, row, A(0), r);
    } else {
      const A mu = group_sum<TPR, false>(held_sum(held_x, k, held), red[0]) * inv_n;
      d = mu;
      if constexpr (CENTER) {
        center(held_x, held_x, d, held);
        d = 0;
      }
      const A ss = held_squares(held_x, k, d, held);
      r = ST::rstd(group_sum<TPR, false>(ss, red[1]) * inv_n, shift + mu, eps);
      if (lane == 0) ST::stats(mean, rstd, row, shift + mu, r);
      if constexpr (ST::RMS) {  // y = x * rstd * w: centered values less -(shift + mu)
        d = -(shift + mu);
        k = 0;
      }
    }

    ST::template write<TPR, BLOCK, VEC, ITEMS>(held_x, k, d, r, w, b, held, lane, y, row, N, quant,
                                               seen);
  }
  ST::template end<BLOCK>(quant, seen);
}

// Tier "reg" split over a cluster (sm_90): rows too wide for one block's registers at the
// block size that lets several blocks share an SM.
//   Clusters of C blocks of BLOCK threads; block k of a cluster holds the packs
//   [k*P/C, (k+1)*P/C) of a row (P = N / VEC) in registers, ITEMS per thread, vector i of thread
//   t at pack lo + i * BLOCK + t (ln_fwd_reg's layout with TPR == BLOCK). Each block forms its
//   slice's exact statistics, shifted by the slice's first element, and the blocks exchange and
//   merge them as ln_fwd_cluster does (bitwise the same mean and rstd in every block); then
//   each writes y for its slice. The plans give as many clusters as the device holds at once,
//   each walking rows r, r + clusters, ... (so each is started once, and each block keeps its
//   column slice, its w and b, for all its rows), rather than a cluster per row. MINB
//   blocks per SM (launch bounds): one block's
//   loads overlap another's reductions and stores, which a lone 1024-thread block holding the
//   whole row cannot.
//   STAGE_WB: each block copies its slice's columns of w and b into dynamic shared memory once
//   and reads them there for every row, instead of through L1, which the slices of an SM's
//   blocks can outgrow (the plans say where).
//   LAG: a block holds two rows in registers, in sets that alternate: it issues the next row's
//   loads before it waits for the cluster's statistics of this row and writes its y, and forms
//   the next row's statistics after, so the loads in flight cover the wait and the stores (one
//   block of up to 512 threads an SM, 117 registers a thread for float32). Sending the next
//   row's statistics before this row's y instead (an exchange outstanding) lost: its loads then
//   hold up this row's stores. The plans take LAG for float32 rows in blocks of FWD_LAG_BLOCK
//   threads or more, rather than two rows a thread at a time (docs/tuning.md has both).
//   LD, ST: as ln_fwd_reg's (with a residual, each block adds, stores and holds its slice of
//   h).
// Limits: ceil(P / C) <= ITEMS * BLOCK, and P >= C (every block gets packs). STAGE_WB: dynamic
// shared memory of ITEMS * BLOCK * VEC * (sizeof(TW) + sizeof(TB)) bytes. LAG: 2 * ITEMS * VEC
// registers of data a thread; not with a residual.
template <typename LD, typename ST, int VEC, int ITEMS, int BLOCK, int C, int MINB, bool STAGE_WB,
          bool LAG>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, sm_blocks(MINB))
    ln_fwd_reg_cluster(CUPYLN_FWD_PARAMS) {
  typedef typename LD::A A;
  typedef typename ST::W TW;
  typedef typename ST::B TB;
  typedef typename LD::H TI;  // what the slice holds: h, or x
  typedef Pack<TI, VEC> P;
  static_assert(BLOCK % 32 == 0 && BLOCK > 32 && BLOCK <= 1024 && C <= 32, "bad block");
  static_assert(!(LD::RES && LAG), "a residual takes one register set");
  // LAG: exchanges through four slots, though a receive comes between any two sends and two
  // would hold them (docs/tuning.md, "Choices inside the kernels")
  constexpr int SLOTS = LAG ? 4 : 2;
  __shared__ A red[2][BLOCK / 32];  // the slice's sum and sum of squared deviations
  __shared__ A xch[SLOTS * C * 3];
  ClusterExchange<C, A, 3, Sync::kAsyncCluster, SLOTS> exchange{xch};
  const int t = threadIdx.x;
  const unsigned rank = cluster_rank();
  const ColumnSlices<C, VEC> slices{N / VEC};
  const int lo = slices.start(rank), nv = slices.start(rank + 1) - lo;  // this block's slice
  const bool stats = (ST::RMS ? rstd : mean) != nullptr && rank == 0 && t == 0;
  // where the rows read w and b: wr and br, the slice's first element at column base
  const TW* __restrict__ wr = w;
  const TB* __restrict__ br = b;
  int base = lo * VEC;
  if constexpr (STAGE_WB) {
    // room for ITEMS * BLOCK packs of w, then of b; each pack is copied with cp.async by the
    // thread that reads it, which waits for its own copies before its first row's y (no barrier)
    extern __shared__ __align__(16) unsigned char dyn_smem[];
    TW* ws = reinterpret_cast<TW*>(dyn_smem);
    TB* bs = reinterpret_cast<TB*>(dyn_smem + ITEMS * BLOCK * VEC * sizeof(TW));
    for (int v = t; v < nv; v += BLOCK) {
      if (w != nullptr) copy_async<VEC * sizeof(TW)>(ws + v * VEC, w + (lo + v) * VEC);
      if (b != nullptr) copy_async<VEC * sizeof(TB)>(bs + v * VEC, b + (lo + v) * VEC);
    }
    commit_copies();
    wr = w != nullptr ? ws : nullptr;
    br = b != nullptr ? bs : nullptr;
    base = 0;
  }
  exchange.start();

  // the slice's elements as loaded and its shift (LAG: two rows', set s of two)
  constexpr int SETS = LAG ? 2 : 1;
  P raw[SETS][ITEMS];
  A shift[SETS];
  auto held = [&](const int i) { return i * BLOCK + t < nv; };
  auto col = [&](const int i) { return (i * BLOCK + t) * VEC; };
  const PacksAt<VEC, BLOCK> at{t};
  auto load = [&](const int s, const i64 row) {
    const i64 from = static_cast<i64>(lo) * VEC;  // the slice's first column
    const typename LD::X* __restrict__ xs = x + row * x_stride + from;
    const typename LD::R* __restrict__ rs =
        static_cast<const typename LD::R*>(res) + row * res_stride + lo * VEC;
    TI* __restrict__ hs = static_cast<TI*>(h) + row * N + from;
    const TI first = LD::first(xs, rs);
    LD::template gather<VEC, ITEMS>(xs, rs, hs, held, at, col, raw[s]);
    shift[s] = static_cast<A>(widen(first));
  };
  // the slice's statistics of set s, sent to the cluster (divisions once a row: a register
  // held across the loop spills some variants)
  auto send = [&](const int s) {
    const A k = shift[s];
    const A d = group_sum<BLOCK, false>(held_sum(raw[s], k, held), red[0]) / A(nv * VEC);
    exchange.send({k, d, group_sum<BLOCK, false>(held_squares(raw[s], k, d, held), red[1])});
  };
  // the cluster's statistics of set s's row, then its y
  auto finish = [&](const int s, const i64 row) {
    A off, rs;  // the row's mean minus this slice's shift, and its rstd
    merge_slices<ST::RMS>(exchange.receive(), slices, N, eps, shift[s], off, rs,
                          stats ? mean + row : nullptr, stats || !ST::RMS ? rstd + row : nullptr);
    typename ST::Y* __restrict__ ys = y + row * N + static_cast<i64>(lo) * VEC;
    if constexpr (STAGE_WB) wait_copies<0>(0);  // (copies pending only at the first row)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = i * BLOCK + t;
      if (held(i)) ST::apply(raw[s][i], shift[s], off, rs, wr, br, base + v * VEC, ys + v * VEC);
    }
  };

  const i64 step = cluster_count();
  i64 row = cluster_index();
  if constexpr (LAG) {
    // the next row's loads go out before this row's wait for the cluster's statistics and its
    // y, its statistics after them; rows alternate between the two register sets
    if (row < M) {
      load(0, row);
      send(0);
    }
    for (; row < M; row += 2 * step) {
      if (row + step < M) load(1, row + step);
      finish(0, row);
      if (row + step >= M) break;
      send(1);
      if (row + 2 * step < M) load(0, row + 2 * step);
      finish(1, row + step);
      if (row + 2 * step < M) send(0);
    }
  } else {
    for (; row < M; row += step) {
      load(0, row);
      send(0);
      finish(0, row);
    }
  }
}

}  // namespace cupyln
