"""Rows of N = 49152 and 65536 whole in one block an SM, with w and b split over a thread-block
cluster's shared memory: the prototype of docs/benchmark-log.md's section on w and b where the
widest forward rows need them (a kernel outside the package, built on its headers).

Clusters of two blocks of BLOCK threads (1024 at 65536, 768 at 49152) hold ITEMS = 8 packs of
16 bytes a thread: one block holds a whole row, one block an SM. Each block copies its half of
w and b into its shared memory once (128 KB at 65536) and reads the other half from its
partner's through DSMEM (``mapa``, then plain loads through the generic window). Each block
normalizes rows of its own, so nothing of a row is exchanged: rows r, r + blocks, ... ("stride")
or each next row from an atomic ticket that thread 0 draws after the row's loads and the row's
two barriers hand to the block ("ticket"), with w and b or without them. Each variant is checked
against float64 (outputs poisoned with NaN) and timed as ``cupyln.bench`` times the forward
(CUDA events, L2 flushed before every call, least of 3 medians), beside ``cupyln.forward``.

    python scripts/wbshare.py
"""

import os
import sys

import cupy as cp
import ml_dtypes  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupyln  # noqa: E402
from cupyln import _compile, bench  # noqa: E402
from cupyln import reference as ref  # noqa: E402
from cupyln._driver import max_active_clusters  # noqa: E402

KERNEL = r"""
namespace cupyln {
// the generic address of *p (shared memory) in block r of the cluster
template <typename U>
__device__ __forceinline__ const U* map_rank(const U* p, const unsigned r) {
  unsigned long long out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(r));
  return reinterpret_cast<const U*>(out);
}
// WALK 1: rows r, r + blocks, ...; 2: each next row from the atomic ticket *ticket (zeroed)
template <typename T, int VEC, int ITEMS, int BLOCK, int WALK, bool AFFINE>
__global__ void CUPYLN_CLUSTER(2) __launch_bounds__(BLOCK, 1)
    ln_fwd_wbshare(const T* __restrict__ x, T* __restrict__ y, const T* __restrict__ w,
                   const T* __restrict__ b, float* __restrict__ mean, float* __restrict__ rstd,
                   const i64 M, const int N, const float eps, unsigned* __restrict__ ticket) {
  typedef float A;
  typedef Pack<T, VEC> P;
  constexpr int PER = ITEMS / 2;   // slots whose w and b a block keeps
  constexpr int SP = PER * BLOCK;  // packs of w (and of b) a block keeps
  static_assert(ITEMS % 2 == 0, "slices of whole slots");
  __shared__ A red[2][BLOCK / 32];
  __shared__ i64 nxt[2];
  extern __shared__ __align__(16) unsigned char dyn[];
  P* ws = reinterpret_cast<P*>(dyn);  // this block's packs of w, then of b
  const int t = threadIdx.x;
  const unsigned rank = cluster_rank();
  if constexpr (AFFINE) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      ws[j * BLOCK + t] = reinterpret_cast<const P*>(w)[rank * SP + j * BLOCK + t];
      ws[SP + j * BLOCK + t] = reinterpret_cast<const P*>(b)[rank * SP + j * BLOCK + t];
    }
  }
  cluster_sync();
  const P* wo = AFFINE ? map_rank(ws, rank ^ 1u) : nullptr;  // the partner's
  const A inv_n = A(1) / A(N);
  // every slot is inside the row (N == ITEMS * BLOCK * VEC); without the check, which the
  // package's register rows keep too, ptxas spilled 136-256 bytes a thread at 1024 threads
  auto held = [&](const int i) { return (i * BLOCK + t) * VEC < N; };
  i64 row = blockIdx.x;
  for (int it = 0; row < M; ++it) {
    const T* __restrict__ xr = x + row * N;
    const T first = xr[0];
    P raw[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (held(i)) raw[i] = reinterpret_cast<const P*>(xr)[i * BLOCK + t];
    }
    if (WALK == 2 && t == 0) nxt[it & 1] = gridDim.x + static_cast<i64>(atomicAdd(ticket, 1u));
    const A k = static_cast<A>(widen(first));
    const A mu = group_sum<BLOCK, false>(held_sum(raw, k, held), red[0]) * inv_n;
    const A ss = group_sum<BLOCK, false>(held_squares(raw, k, mu, held), red[1]);
    const A r = rsqrt_acc(ss * inv_n + eps);
    if (t == 0) {
      mean[row] = k + mu;
      rstd[row] = r;
    }
    T* __restrict__ yr = y + row * N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      A o[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) o[e] = (widen_at<A>(raw[i], e) - k - mu) * r;
      if constexpr (AFFINE) {
        const int j = (i % PER) * BLOCK + t;
        const P* src = (i / PER == static_cast<int>(rank)) ? ws : wo;
        const P wp = src[j], bp = src[j + SP];
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[e] = o[e] * widen_at<A>(wp, e) + widen_at<A>(bp, e);
      }
      store_pack<T, A, VEC>(yr + (i * BLOCK + t) * VEC, o);
    }
    row = WALK == 2 ? nxt[it & 1] : row + gridDim.x;  // nxt: read after the row's barriers
  }
  cluster_sync();  // the partner reads this block's shared memory until it is done
}
}  // namespace cupyln
"""

CTYPE = {"bfloat16": "cupyln::bf16_t", "float16": "cupyln::half_t"}
SHAPES = ((65536, 1024), (49152, 768))  # (N, BLOCK); 8 packs of 8 elements a thread
ITEMS = 8
VARIANTS = (("stride", 1, True), ("ticket", 2, True), ("stride, no w or b", 1, False),
            ("ticket, no w or b", 2, False))  # fmt: skip


class Prototype:
    def __init__(self, dtype: str, block: int, walk: int, affine: bool):
        expr = (f"cupyln::ln_fwd_wbshare<{CTYPE[dtype]}, 8, {ITEMS}, {block}, {walk}, "
                f"{'true' if affine else 'false'}>")  # fmt: skip
        text, _ = _compile.source(_compile.FWD_SOURCE)
        mod = cp.RawModule(code=text + KERNEL, options=_compile.OPTIONS, name_expressions=(expr,))
        self.kernel = mod.get_function(expr)
        self.smem = ITEMS * block * 16 if affine else 0  # half of w and of b
        self.kernel.max_dynamic_shared_size_bytes = max(self.smem, 1)
        clusters = max_active_clusters(self.kernel, 2, block, self.smem)
        self.grid = 2 * (clusters or cp.cuda.Device().attributes["MultiProcessorCount"] // 2)
        self.block = block

    def __call__(self, x, w, b, y, mean, rstd, ticket):
        m, n = x.shape
        args = (x, y, w, b, mean, rstd, cp.int64(m), cp.int32(n), cp.float32(1e-5), ticket)
        self.kernel((self.grid,), (self.block,), args, shared_mem=self.smem)


def main():
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    tickets = cp.zeros(1 << 14, cp.uint32)  # a zeroed counter for each launch
    used = [0]
    lines = []
    for dtype in CTYPE:
        for n, block in SHAPES:
            m = 2**27 // n
            xs = [ref.sample((m, n), dtype, seed=n + i) for i in range(2)]
            w = ref.sample((n,), dtype, loc=1.0, scale=0.2, seed=1)
            b = ref.sample((n,), dtype, loc=0.0, scale=0.2, seed=2)
            y = cp.empty_like(xs[0])
            mean, rstd = cp.empty(m, cp.float32), cp.empty(m, cp.float32)
            expect = {True: ref.forward(xs[0], w, b), False: ref.forward(xs[0])}
            gbs = {}  # milliseconds
            for label, wb in (("package", (w, b)), ("package, no w or b", (None, None))):
                turn = [0]

                def fwd(xs=xs, wb=wb, turn=turn):
                    turn[0] += 1
                    return cupyln.forward(xs[turn[0] % 2], *wb)

                gbs[label] = min(bench.time_ms(fwd) for _ in range(3))
            for label, walk, affine in VARIANTS:
                proto = Prototype(dtype, block, walk, affine)

                def launch(x, proto=proto, w=w, b=b, y=y, mean=mean, rstd=rstd):
                    used[0] += 1
                    if used[0] == tickets.size:
                        raise RuntimeError("out of ticket counters")
                    proto(x, w, b, y, mean, rstd, tickets[used[0] :])

                for _ in range(2):  # each launch with a zeroed counter of its own
                    y.view(cp.uint16).fill(0xFFFF)  # NaN in bf16 and fp16
                    mean.fill(cp.nan)
                    rstd.fill(cp.nan)
                    launch(xs[0])
                    for out, want, what in zip(
                        (y, mean, rstd), expect[affine], "y mean rstd".split()
                    ):
                        ref.assert_close(out, want, f"{label} {what}, {dtype} {m} x {n}")
                turn = [0]

                def run(launch=launch, turn=turn, xs=xs):
                    turn[0] += 1
                    launch(xs[turn[0] % 2])

                gbs[label] = min(bench.time_ms(run) for _ in range(3))
            rate = {label: 2 * xs[0].nbytes / ms * 1e-6 for label, ms in gbs.items()}
            line = f"{dtype:8s} {m:4d} x {n} (2 x {block} x {ITEMS}): " + ", ".join(
                f"{label} {g:.0f} ({g / copy:.1%})" for label, g in rate.items()
            )
            print(line, flush=True)
            lines.append(line)
    print(f"\ncopy {copy:.0f} GB/s")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
