// cupyln/kernels/layer_norm_fwd.cu -- LayerNorm forward: y = (x - mean) * rstd * w + b.
//
// Parameters: CUPYLN_FWD_PARAMS (args.cuh), the same list for every kernel of this file.
// Inputs : x [M, N] of T, row r at x + r * x_stride (last dim contiguous); w [N] of TW and
//          b [N] of TB, each optional (nullptr = no scale / no shift).
// Outputs: y [M, N] of T, contiguous; mean [M] and rstd [M] of A = AccOf<T> (float, or double
//          for double input), rstd = 1 / sqrt(biased variance + eps); both nullptr: not
//          stored (inference, where no backward needs them).
//
// Statistics are exact two-pass from on-chip storage: the row is read from HBM once, its sum
// gives the mean, the sum of squared deviations from that mean gives the variance (never
// E[x^2] - E[x]^2; the stream tier merges exact per-pack statistics by Chan et al.'s update),
// and y is written once. Values are shifted by the row's first element
// before summing, so rows with a large mean (1e4 + noise) keep full float32 precision.
// Padding lanes hold 0 in the first pass and are skipped in the second.
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
#include "ring_forward.cuh"

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
//     rows are bound by issuing instructions more than by memory, so narrow rows kept as float
//     copies run faster; float32 rows, which convert nothing, gain nothing. The copy is a
//     separate array for 16-bit T, the loaded one itself where T is A.
//   WHOLE: slots i < WHOLE are inside the row for every thread, read and written without the
//   per-slot check against N: at 64 registers ptxas keeps the centered copies of unchecked
//   slots and spills checked ones. Rows as loaded keep their checks (with none, ptxas widens
//   every element once, holds the floats and spills).
//   Loading the next row ahead of the current row's reductions measured slower, into
//   registers (they cost more occupancy than the overlap gains) and with cp.async into shared
//   memory.
//   MINB: blocks per SM asked of ptxas (launch bounds), so registers do not cap occupancy.
// Limits: N <= TPR * ITEMS * VEC, and WHOLE * TPR * VEC <= N; registers grow with ITEMS * VEC
// (the plans keep it <= 64 values as loaded, 16 for double; centered, <= 128 bytes of A).
template <typename T, typename TW, typename TB, int VEC, int ITEMS, int TPR, int BLOCK, int MINB,
          bool CENTER, int WHOLE>
__global__ void __launch_bounds__(BLOCK, MINB)
    ln_fwd_reg(CUPYLN_FWD_PARAMS) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  static_assert(TPR <= 32 ? (32 % TPR == 0 && BLOCK % 32 == 0) : TPR == BLOCK, "bad tiling");
  static_assert(BLOCK % 32 == 0 && BLOCK <= 1024, "bad block");
  constexpr int ROWS = BLOCK / TPR;
  __shared__ A red[2][TPR > 32 ? TPR / 32 : 1];  // the mean's and the variance's sums

  const int lane = threadIdx.x % TPR;
  const A inv_n = A(1) / A(N);
  const i64 step = static_cast<i64>(gridDim.x) * ROWS;

  // whether the thread holds slot i: the first WHOLE slots of every thread are inside the row
  auto held = [&](const int i) { return i < WHOLE || (i * TPR + lane) * VEC < N; };

  for (i64 row = static_cast<i64>(blockIdx.x) * ROWS + threadIdx.x / TPR; row < M; row += step) {
    const T* __restrict__ xr = x + row * x_stride;
    const T first = xr[0];  // the shift
    P raw[ITEMS];           // the row's elements as loaded
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (held(i)) raw[i] = *reinterpret_cast<const P*>(xr + (i * TPR + lane) * VEC);
    }
    // what the passes read: raw, or (CENTER) x - shift in A, then less the mean too (in raw
    // itself where T is A)
    constexpr bool COPY = CENTER && sizeof(T) != sizeof(A);
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
    const A mu = group_sum<TPR, false>(held_sum(held_x, k, held), red[0]) * inv_n;
    A d = mu;
    if constexpr (CENTER) {
      center(held_x, held_x, d, held);
      d = 0;
    }
    const A ss = held_squares(held_x, k, d, held);
    const A r = rsqrt_acc(group_sum<TPR, false>(ss, red[1]) * inv_n + eps);
    if (lane == 0 && mean != nullptr) {
      mean[row] = shift + mu;
      rstd[row] = r;
    }

    T* __restrict__ yr = y + row * N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int col = (i * TPR + lane) * VEC;
      if (held(i)) normalize_store<T, TW, TB, A, VEC>(held_x[i], k, d, r, w, b, col, yr + col);
    }
  }
}

// Tier "stream" (sm_90, 16-bit rows of 512-20K elements in long launches, and in short ones
// that the register rows would run in more than one wave; the plans say which): TPR threads
// per row that read the row twice and hold none of it, a block per row (TPR == BLOCK) or, for
// rows of a warp, BLOCK / TPR rows a block.
//   N = NCH * TPR * VEC (16-byte packs; PARTIAL below): thread t of a row owns packs
//   t + j * TPR, j < NCH, one pack a step. Pass 1 loads the packs under an L2 evict_last
//   policy, the next in flight while one is summed; each pack's exact mean mj of x - k (k the
//   row's first element) and its squared deviations x - (k + mj) merge into the thread's
//   (mean, M2) by Chan et al.'s update, whose weights are compile-time constants (equal counts:
//   no division). The row's threads then merge their states (across warps through shared
//   memory, or within a warp), of equal counts too: the row's mean is the mean of theirs, its
//   M2 the sum of theirs plus each count * (thread mean - row mean)^2 (never
//   E[x^2] - E[x]^2). The statistics are stored, then pass 2 loads the row again under
//   evict_first, from L1 or L2 where pass 1 left it and without allocating it in L1 (the
//   other blocks' rows and w and b stay there), the next pack in flight, and writes
//   y = (x - (k + mean)) * rstd * w + b.
//   A thread needs 32 registers: MINB * BLOCK = 2048 threads an SM (1792-1920 in blocks that do
//   not divide it), where the register rows that hold the row get 1536 at 40, and x is still
//   read from HBM once (Nsight Compute). Its shape is measured: a grid-stride loop over rows,
//   the statistics stored after y, pass 2 without the L2 policies, more packs a thread and x
//   loaded past L1 in pass 1 too (pass 2 then misses L1) were each slower. The loads of x are
//   volatile (load_hinted): pass 2 reads memory again. Each thread stores only
//   packs it has read itself, after every thread of its row has read the shift (the row's sums,
//   barriers or warp shuffles, come between), so y may be x.
//   HAS_W / HAS_B: w / b given (non-null); compile-time flags, as a run-time test of each
//   pointer inside pass 2 made ptxas spill at 3 and 4 packs.
//   ROLL: pass 2 is a loop, not unrolled (the plans say where: rows of 64-128 threads of 2
//   packs). Rolled, no shape spills; unrolled, ptxas interleaves a pack's y with the next
//   pack's loads and some shapes spill, but rolled lost on wider rows: the spills do not decide.
//   COHERENT_WB: pass 2 reads w and b through ld.global (load_read_only<true>) instead of the
//   read-only path their plain reads compile to; ptxas then stores each pack's y before the
//   next pack's arithmetic, and rows with float16 in x, w or b spill nothing with w and b
//   given. bf16 rows did not gain: the plans take it where x, w or b is float16.
//   Narrow rows (N = 512-4096) stream at 2 packs a thread, 32-256 threads a row; one pack a
//   thread, 3-4 packs a warp, and 3 packs where 2 fit were slower.
//   PARTIAL: the row's packs P fill only some of the NCH * TPR slots, P > (NCH - 1) * TPR (every
//   thread holds its first pack): a thread skips its packs past the row, and the row's threads
//   merge their states weighted by their counts (rows of 64 threads; rows filling less, or of
//   more threads, were slower).
// Limits: 16-byte packs; N == NCH * TPR * VEC, or PARTIAL and (NCH - 1) * TPR < N / VEC <=
// NCH * TPR; TPR == BLOCK, or TPR <= 32 dividing BLOCK; ceil(M / (BLOCK / TPR)) blocks, a row
// a block or a group of rows, M < 2**31.
template <typename T, typename TW, typename TB, int VEC, int TPR, int BLOCK, int NCH, int MINB,
          bool PARTIAL, bool ROLL, bool COHERENT_WB, bool HAS_W, bool HAS_B>
__global__ void __launch_bounds__(BLOCK, MINB)
    ln_fwd_stream(CUPYLN_FWD_PARAMS) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  static_assert(sizeof(P) == 16 && BLOCK % 32 == 0 && BLOCK <= 1024 && NCH >= 1, "bad tiling");
  static_assert(TPR == BLOCK || (TPR <= 32 && BLOCK % TPR == 0), "a row a block or a warp");
  const int NR = PARTIAL ? N : NCH * TPR * VEC;  // N
  const int packs = NR / VEC;
  __shared__ A red[2][TPR > 32 ? TPR / 32 : 1];  // the mean's and the deviations' sums
  int t = threadIdx.x;
  i64 row = blockIdx.x;
  if constexpr (TPR < BLOCK) {
    row = row * (BLOCK / TPR) + t / TPR;
    t %= TPR;
  }
  if (row >= M) return;
  // PARTIAL: packs t + j * TPR past the row's are not read; every thread holds pack t (j = 0)
  auto held = [&](const int j) { return !PARTIAL || j * TPR + t < packs; };

  const P* __restrict__ xr = reinterpret_cast<const P*>(x + row * x_stride);
  const A k = static_cast<A>(widen(x[row * x_stride]));  // the shift
  const unsigned long long keep = l2_policy<true>();
  P cur = load_hinted(xr + t, keep);
  A mu = 0, m2 = 0;  // this thread's mean of x - k and its squared deviations
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    P next;
    if (j + 1 < NCH && held(j + 1)) next = load_hinted(xr + (j + 1) * TPR + t, keep);
    if (!held(j)) break;
    A s = 0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s += widen_at<A>(cur, e) - k;
    const A mj = s * (A(1) / VEC);
    const A kj = k + mj;
    A q = 0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const A d = widen_at<A>(cur, e) - kj;
      q += d * d;
    }
    if (j == 0) {
      mu = mj;
      m2 = q;
    } else {  // counts j * VEC and VEC
      const A delta = mj - mu;
      mu += delta * (A(1) / A(j + 1));
      m2 += q + delta * delta * (A(VEC * j) / A(j + 1));
    }
    if (j + 1 < NCH) cur = next;
  }
  A mr, ss;  // the row's mean of x - k and its squared deviations
  if constexpr (PARTIAL) {  // the threads' counts differ: weighted by them
    const A c = A(VEC * min(NCH, (packs - 1 - t) / TPR + 1));
    mr = group_sum<TPR, false>(c * mu, red[0]) / A(NR);
    const A dm = mu - mr;
    ss = group_sum<TPR, false>(m2 + c * dm * dm, red[1]);
  } else {
    mr = group_sum<TPR, false>(mu, red[0]) * (A(1) / A(TPR));
    const A dm = mu - mr;
    ss = group_sum<TPR, false>(m2 + A(NCH * VEC) * dm * dm, red[1]);
  }
  const A r = rsqrt_acc(ss * (A(1) / A(NR)) + eps);
  const A off = k + mr;
  if (t == 0 && mean != nullptr) {
    mean[row] = off;
    rstd[row] = r;
  }

  T* __restrict__ yr = y + row * NR;
  const unsigned long long drop = l2_policy<false>();
  cur = load_hinted<false>(xr + t, drop);  // read for the last time: past L1
#pragma unroll(ROLL ? 1 : NCH)
  for (int j = 0; j < NCH; ++j) {
    P next;
    if (j + 1 < NCH && held(j + 1)) next = load_hinted<false>(xr + (j + 1) * TPR + t, drop);
    if (!held(j)) break;
    const int col = (j * TPR + t) * VEC;
    A o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = (widen_at<A>(cur, e) - off) * r;
    if constexpr (HAS_W) {
      const auto pw = load_read_only<COHERENT_WB>(reinterpret_cast<const Pack<TW, VEC>*>(w + col));
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] *= widen_at<A>(pw, e);
    }
    if constexpr (HAS_B) {
      const auto pb = load_read_only<COHERENT_WB>(reinterpret_cast<const Pack<TB, VEC>*>(b + col));
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] += widen_at<A>(pb, e);
    }
    store_pack<T, A, VEC>(yr + col, o);
    if (j + 1 < NCH) cur = next;
  }
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
//   column slice, its w and b, for all its rows): a cluster per row measured slower. MINB
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
//   threads or more. Two rows a thread at a time, w and b read once for both at half the
//   vectors a row, measured slower.
// Limits: ceil(P / C) <= ITEMS * BLOCK, and P >= C (every block gets packs). STAGE_WB: dynamic
// shared memory of ITEMS * BLOCK * VEC * (sizeof(TW) + sizeof(TB)) bytes. LAG: 2 * ITEMS * VEC
// registers of data a thread.
template <typename T, typename TW, typename TB, int VEC, int ITEMS, int BLOCK, int C, int MINB,
          bool STAGE_WB = false, bool LAG = false>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, MINB)
    ln_fwd_reg_cluster(CUPYLN_FWD_PARAMS) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  static_assert(BLOCK % 32 == 0 && BLOCK > 32 && BLOCK <= 1024 && C <= 32, "bad block");
  // LAG: exchanges through four slots, though a receive comes between any two sends and two
  // would hold them: four measured faster (not profiled)
  constexpr int SLOTS = LAG ? 4 : 2;
  __shared__ A red[2][BLOCK / 32];  // the slice's sum and sum of squared deviations
  __shared__ A xch[SLOTS * C * 3];
  ClusterExchange<C, A, 3, Sync::kAsyncCluster, SLOTS> exchange{xch};
  const int t = threadIdx.x;
  const unsigned rank = cluster_rank();
  const ColumnSlices<C, VEC> slices{N / VEC};
  const int lo = slices.start(rank), nv = slices.start(rank + 1) - lo;  // this block's slice
  const bool stats = mean != nullptr && rank == 0 && t == 0;
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
  auto load = [&](const int s, const i64 row) {
    const T* __restrict__ xs = x + row * x_stride + static_cast<i64>(lo) * VEC;
    const T first = xs[0];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (held(i)) raw[s][i] = reinterpret_cast<const P*>(xs)[i * BLOCK + t];
    }
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
    merge_slices(exchange.receive(), slices, N, eps, shift[s], off, rs,
                 stats ? mean + row : nullptr, rstd + row);
    T* __restrict__ ys = y + row * N + static_cast<i64>(lo) * VEC;
    if constexpr (STAGE_WB) wait_copies<0>(0);  // (copies pending only at the first row)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = i * BLOCK + t;
      if (held(i)) {
        normalize_store<T, TW, TB, A, VEC>(raw[s][i], shift[s], off, rs, wr, br, base + v * VEC,
                                           ys + v * VEC);
      }
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

// Tier "ring": rows of x [M, N] through the staging rings of ring_forward.cuh, each row a sequence of one row, group q of
// the G groups taking rows [q*M/G, (q+1)*M/G). The dynamic shared memory is split evenly into
// the BLOCK/GROUP groups' rings; each must hold a row (the host's plan sees to it).
template <typename T, typename TW, typename TB, int VEC, int BLOCK, int GROUP>
__global__ void __launch_bounds__(BLOCK, RingBlocks<T, BLOCK>::value)
    ln_fwd_ring(CUPYLN_FWD_PARAMS) {
  typedef typename AccOf<T>::type A;
  typedef Pack<T, VEC> P;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ A red[2 * (BLOCK / 32)];
  unsigned smem_bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem_bytes));
  constexpr int GROUPS = BLOCK / GROUP;
  const int ring = static_cast<int>(smem_bytes / (GROUPS * sizeof(P)));
  const i64 G = static_cast<i64>(gridDim.x) * GROUPS;
  const i64 g = static_cast<i64>(blockIdx.x) * GROUPS + threadIdx.x / GROUP;
  P* slots = reinterpret_cast<P*>(smem_raw) + (threadIdx.x / GROUP) * ring;
  ring_forward<T, TW, TB, DenseRows, VEC, BLOCK, GROUP>(
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
// Limits: any N < 2^31 - UNROLL * BLOCK * VEC.
template <typename T, typename TW, typename TB, int VEC, int BLOCK, bool STAGE>
__global__ void __launch_bounds__(BLOCK, 1)
    ln_fwd_row(CUPYLN_FWD_PARAMS) {
  typedef typename AccOf<T>::type A;
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
    const A r = rsqrt_acc(group_sum<BLOCK, false>(ss, red[1]) * inv_n + eps);
    if (threadIdx.x == 0 && mean != nullptr) {
      mean[row] = shift + mu;
      rstd[row] = r;
    }

    T* __restrict__ yr = y + row * N;
    walk_vectors<T, VEC, BLOCK, UNROLL>(src, nv, threadIdx.x, [&](const i64 v, const P& pk) {
      const int col = static_cast<int>(v) * VEC;
      normalize_store<T, TW, TB, A, VEC>(pk, shift, mu, r, w, b, col, yr + col);
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
//   writes y for its slice; block 0 writes mean and rstd.
// Limits: one row's slice fits the ring (the host sizes the ring to a third of the SM).
template <typename T, typename TW, typename TB, int VEC, int BLOCK, int C>
__global__ void CUPYLN_CLUSTER(C) __launch_bounds__(BLOCK, 1)
    ln_fwd_cluster(CUPYLN_FWD_PARAMS) {
  typedef typename AccOf<T>::type A;
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
  const bool stats = mean != nullptr && rank == 0 && t == 0;
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
    merge_slices(exchange.receive(), slices, N, eps, k, off, rs, stats ? mean + row : nullptr,
                 rstd + row);
    T* __restrict__ yr = y + row * N + lo * VEC;
    for (int v = t, i = r.wrap(r.head + t); v < nv; v += BLOCK, i = r.wrap(i + BLOCK)) {
      normalize_store<T, TW, TB, A, VEC>(r.slot[i], k, off, rs, w, b, (lo + v) * VEC,
                                         yr + v * VEC);
    }
    r.release(nv);
    __syncthreads();  // every thread is done with the row's slots before they are reused
  }
}

}  // namespace cupyln
