// cupyln/kernels/layer_norm_fwd_stream.cu -- LayerNorm forward, the stream tier (sm_90).
//
// Parameters, inputs, outputs and statistics: as every forward kernel (layer_norm_fwd.cu's
// header, CUPYLN_FWD_PARAMS in args.cuh). The threads of a row hold none of it: they read it
// from HBM once for its statistics and again from L1 or L2 for y, at more resident threads
// than registers holding the row allow. cupyln/_plans/forward.py says which rows stream.
#include "args.cuh"
#include "common.cuh"

namespace cupyln {

// One 16-byte pack at p that this thread stored earlier in the kernel, through the coherent path
// (ld.global: the non-coherent one may not see the kernel's own stores), past L1, under an
// l2_policy.
template <typename P>
__device__ __forceinline__ P load_own(const P* p, const unsigned long long policy) {
  static_assert(sizeof(P) == 16, "16-byte packs");
  unsigned w[4];
  asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %4;"
               " ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [g], %5; }"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "l"(p), "l"(policy)
               : "memory");
  P out;
  memcpy(&out, w, sizeof(out));
  return out;
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
//   read from HBM once (Nsight Compute). Its shape was chosen against a grid-stride loop over
//   rows, the statistics stored after y, pass 2 without the L2 policies, more packs a thread
//   and x loaded past L1 in pass 1 too (docs/tuning.md). The loads of x are
//   volatile (load_hinted): pass 2 reads memory again. Each thread stores only
//   packs it has read itself, after every thread of its row has read the shift (the row's sums,
//   barriers or warp shuffles, come between), so y may be x.
//   The Store's TW / TB is void where w / b is not given: known when compiling, as a run-time
//   test of each pointer inside pass 2 made ptxas spill at 3 and 4 packs.
//   ROLL: pass 2 is a loop, not unrolled (the plans say where: rows of 64-128 threads of 2
//   packs). Rolled, no shape spills; unrolled, ptxas interleaves a pack's y with the next
//   pack's loads and some shapes spill, but rolled lost on wider rows: the spills do not decide.
//   COHERENT_WB: pass 2 reads w and b through ld.global (load_read_only<true>) instead of the
//   read-only path their plain reads compile to; ptxas then stores each pack's y before the
//   next pack's arithmetic, and rows with float16 in x, w or b spill nothing with w and b
//   given. bf16 rows did not gain: the plans take it where x, w or b is float16.
//   Narrow rows (N = 512-4096) stream at 2 packs a thread, 32-256 threads a row (docs/tuning.md
//   has the other shapes tried).
//   PARTIAL: the row's packs P fill only some of the NCH * TPR slots, P > (NCH - 1) * TPR (every
//   thread holds its first pack): a thread skips its packs past the row, and the row's threads
//   merge their states weighted by their counts (rows of 64 threads, FWD_STREAM_PARTIAL and
//   FWD_STREAM_FILL in the plans).
//   A Load with a residual (of T, h of T: TR = TH = T): pass 1 loads the packs of x
//   and res, stores h = x + res (rounded to T) and forms the statistics of h; pass 2 reads h
//   back (its own stores, through the coherent path) in place of x.
// Limits: 16-byte packs; N == NCH * TPR * VEC, or PARTIAL and (NCH - 1) * TPR < N / VEC <=
// NCH * TPR; TPR == BLOCK, or TPR <= 32 dividing BLOCK; ceil(M / (BLOCK / TPR)) blocks, a row
// a block or a group of rows, M < 2**31.
template <typename LD, typename ST, int VEC, int TPR, int BLOCK, int NCH, int MINB, bool PARTIAL,
          bool ROLL, bool COHERENT_WB>
__global__ void __launch_bounds__(BLOCK, MINB)
    ln_fwd_stream(CUPYLN_FWD_PARAMS) {
  typedef typename LD::X T;
  typedef typename LD::A A;
  typedef Pack<T, VEC> P;
  constexpr bool RES = LD::RES;
  static_assert(!RES || (Same<typename LD::R, T>::value && Same<typename LD::H, T>::value),
                "a residual of x's dtype");
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
  // RES: res's row, and h's, which pass 2 reads in place of x
  const P* __restrict__ rr = nullptr;
  P* hr = nullptr;
  A k = static_cast<A>(widen(x[row * x_stride]));  // the shift
  if constexpr (RES) {
    rr = static_cast<const P*>(res) + row * (res_stride / VEC);
    hr = static_cast<P*>(h) + row * (NR / VEC);
    k = widen(narrow<T>(k + static_cast<A>(widen(rr[0].v[0]))));
  }
  const unsigned long long keep = l2_policy<true>();
  P cur = load_hinted(xr + t, keep), cur_r;
  if constexpr (RES) cur_r = load_hinted(rr + t, keep);
  A mu = 0, m2 = 0;  // this thread's mean of x - k and its squared deviations
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    P next, next_r;
    if (j + 1 < NCH && held(j + 1)) {
      next = load_hinted(xr + (j + 1) * TPR + t, keep);
      if constexpr (RES) next_r = load_hinted(rr + (j + 1) * TPR + t, keep);
    }
    if (!held(j)) break;
    if constexpr (RES) cur = add_residual<A>(cur, cur_r, hr[j * TPR + t].v);
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
    if (j + 1 < NCH) {
      cur = next;
      if constexpr (RES) cur_r = next_r;
    }
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
  const A r = ST::rstd(ss * (A(1) / A(NR)), k + mr, eps);
  const A off = ST::RMS ? A(0) : k + mr;  // y of x - off
  if (t == 0) ST::stats(mean, rstd, row, k + mr, r);

  typename ST::Y* __restrict__ yr = y + row * NR;
  const unsigned long long drop = l2_policy<false>();
  // x (or h) read for the last time: past L1 (written out at each use: a lambda around the
  // two loads changed ptxas's allocation of the LayerNorm rows, which spilled)
  if constexpr (RES) {
    cur = load_own(hr + t, drop);
  } else {
    cur = load_hinted<false>(xr + t, drop);
  }
#pragma unroll(ROLL ? 1 : NCH)
  for (int j = 0; j < NCH; ++j) {
    P next;
    if constexpr (RES) {
      if (j + 1 < NCH && held(j + 1)) next = load_own(hr + (j + 1) * TPR + t, drop);
    } else {
      if (j + 1 < NCH && held(j + 1)) next = load_hinted<false>(xr + (j + 1) * TPR + t, drop);
    }
    if (!held(j)) break;
    const int col = (j * TPR + t) * VEC;
    A o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = (widen_at<A>(cur, e) - off) * r;
    if constexpr (ST::HAS_W) {
      typedef Pack<typename ST::W, VEC> PW;
      const auto pw = load_read_only<COHERENT_WB>(reinterpret_cast<const PW*>(w + col));
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] *= widen_at<A>(pw, e);
    }
    if constexpr (ST::HAS_B) {
      typedef Pack<typename ST::B, VEC> PB;
      const auto pb = load_read_only<COHERENT_WB>(reinterpret_cast<const PB*>(b + col));
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] += widen_at<A>(pb, e);
    }
    store_pack<typename ST::Y, A, VEC>(yr + col, o);
    if (j + 1 < NCH) cur = next;
  }
}

}  // namespace cupyln
