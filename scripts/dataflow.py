"""LayerNorm's data flow without its arithmetic: the kernels and runs of
docs/benchmark-log.md's section on where the widest forward rows lose.

Each block (or thread-block cluster) loads its part of a row into registers in the register
rows' layout (16-byte packs, thread t holding packs t, t + BLOCK, ..., all loads issued before
any is used), forms DEP block-wide XOR reductions of them (one barrier each; 2 stands for the
mean and the variance), exchanges the blocks' values through distributed shared memory where C
> 1 blocks share a row (one cluster barrier a row), then stores y = x ^ (v == magic), which
depends on every load of the row. DEP 0 keeps the tiling with no reduction: a copy. Nothing is
widened, and no w or b is read. A block (cluster) takes one row, or walks rows on a persistent
grid: r, r + blocks, ... ("stride", as the package's clusters do), or each next row from an
atomic ticket that rank 0 takes before its reductions ("tickets"), so that the rows in flight
stay a window of consecutive rows. Bytes are those of bf16 rows of N; M * N = 2**27, and 4x the
rows for the variants timed at both (steady state and what a launch costs beyond its rows).
Each is timed as cupyln.bench times the forward (CUDA events, L2 flushed before every call,
least of 3 medians), beside cupyln.forward with and without w and b (sm_90: the clusters).

    python scripts/dataflow.py
"""

import os
import sys

import cupy as cp
import ml_dtypes  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupyln  # noqa: E402
from cupyln import bench  # noqa: E402
from cupyln import reference as ref  # noqa: E402

SRC = r"""
__device__ __forceinline__ unsigned dsmem_load(const unsigned* p, unsigned rank) {
  unsigned a = (unsigned)__cvta_generic_to_shared(p), r, v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(r) : "memory");
  return v;
}
template <int BLOCK>
__device__ __forceinline__ unsigned block_xor(unsigned v, unsigned* red) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned s = 0;
#pragma unroll
  for (int w = 0; w < BLOCK / 32; ++w) s ^= red[w];
  return s;
}
// WALK 0: a block (cluster) a row; 1: a persistent grid walking rows r, r + blocks, ...;
// 2: a persistent grid whose blocks take each next row from an atomic ticket (rank 0 takes it
// before its reductions and the row's barriers hand it to the block, or the cluster)
template <int ITEMS, int BLOCK, int DEP, int C, int WALK>
__device__ __forceinline__ void dataflow_body(const uint4* __restrict__ x,
    uint4* __restrict__ y, const long long rows, unsigned* __restrict__ ticket) {
  static_assert(WALK != 2 || DEP > 0, "a ticket travels with a reduction's barrier");
  constexpr int PACKS = ITEMS * BLOCK;  // a block's packs of a row
  __shared__ unsigned red[4][BLOCK / 32];
  __shared__ unsigned xch[2];
  __shared__ unsigned nxt[2];
  unsigned rank = 0, cid = blockIdx.x, ncl = gridDim.x;
  if constexpr (C > 1) {
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
    asm("mov.u32 %0, %%nclusterid.x;" : "=r"(ncl));
  }
  int it = 0;
  long long row = cid;
  while (row < rows) {
    const uint4* xr = x + row * (PACKS * C) + rank * PACKS;
    uint4* yr = y + row * (PACKS * C) + rank * PACKS;
    uint4 v[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) v[i] = xr[i * BLOCK + threadIdx.x];
    if (WALK == 2 && rank == 0 && threadIdx.x == 0) nxt[it & 1] = ncl + atomicAdd(ticket, 1u);
    long long next = WALK == 1 ? row + ncl : rows;
    unsigned flag = 0;
    if constexpr (DEP > 0) {
      unsigned s = 0;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) s ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
      s = block_xor<BLOCK>(s, red[(2 * it) & 3]);
      if constexpr (DEP > 1) {
        unsigned q = 0;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i)
          q ^= (v[i].x ^ s) + (v[i].y ^ s) + (v[i].z ^ s) + (v[i].w ^ s);
        s ^= block_xor<BLOCK>(q, red[(2 * it + 1) & 3]);
      }
      if constexpr (C > 1) {
        if (threadIdx.x == 0) xch[it & 1] = s;
        asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
        asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#pragma unroll
        for (int r = 0; r < C; ++r) if (r != (int)rank) s ^= dsmem_load(&xch[it & 1], r);
        if constexpr (WALK == 2) next = dsmem_load(&nxt[it & 1], 0);
      } else if constexpr (WALK == 2) {
        next = nxt[it & 1];
      }
      flag = s == 0x9e3779b9u;
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      uint4 o = v[i];
      o.x ^= flag;
      yr[i * BLOCK + threadIdx.x] = o;
    }
    row = next;
    ++it;
  }
  if constexpr (C > 1) {  // no block leaves while a partner may still read its xch or nxt
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  }
}
template <int ITEMS, int BLOCK, int MINB, int DEP, int C, int WALK>
__global__ void __launch_bounds__(BLOCK, MINB) dataflow(const uint4* __restrict__ x,
    uint4* __restrict__ y, const long long rows, unsigned* __restrict__ ticket) {
  dataflow_body<ITEMS, BLOCK, DEP, C, WALK>(x, y, rows, ticket);
}
template <int ITEMS, int BLOCK, int MINB, int DEP, int C, int WALK>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(BLOCK, MINB) dataflow_cl(
    const uint4* __restrict__ x, uint4* __restrict__ y, const long long rows,
    unsigned* __restrict__ ticket) {
  dataflow_body<ITEMS, BLOCK, DEP, C, WALK>(x, y, rows, ticket);
}
"""
# label: (N, packs a thread, threads a block, blocks an SM, reductions, blocks a row, walk)
# walk: "row" a block (cluster) a row; "stride" and "tickets" persistent grids (WALK 1, 2)
WALKS = {"row": 0, "stride": 1, "tickets": 2}
VARIANTS = {
    "32768 copy tiling 512 x 8, a block a row": (32768, 8, 512, 2, 0, 1, "row"),
    "32768 1 reduction": (32768, 8, 512, 2, 1, 1, "row"),
    "32768 2 reductions": (32768, 8, 512, 2, 2, 1, "row"),
    "32768 2 reductions, persistent grid": (32768, 8, 512, 2, 2, 1, "stride"),
    "32768 2 reductions, persistent grid, rows by ticket": (32768, 8, 512, 2, 2, 1, "tickets"),
    "32768 2 reductions, 1024 x 4, two blocks an SM": (32768, 4, 1024, 2, 2, 1, "row"),
    "32768 2 reductions + exchange, clusters of 2 x 512 x 4": (32768, 4, 512, 4, 2, 2, "stride"),
    "65536 copy tiling 2 x 512 x 8, clusters, persistent": (65536, 8, 512, 2, 0, 2, "stride"),
    "65536 2 reductions + exchange, clusters of 2 x 512 x 8": (65536, 8, 512, 2, 2, 2, "stride"),
    "65536 2 reductions + exchange, 2 x 512 x 8, by ticket": (65536, 8, 512, 2, 2, 2, "tickets"),
    "65536 2 reductions + exchange, a cluster a row": (65536, 8, 512, 2, 2, 2, "row"),
    "65536 1 reduction + exchange, the same": (65536, 8, 512, 2, 1, 2, "stride"),
    "65536 2 reductions + exchange, clusters of 4 x 512 x 4": (65536, 4, 512, 4, 2, 4, "stride"),
    "65536 2 reductions, one block of 1024 x 8 a row": (65536, 8, 1024, 1, 2, 1, "row"),
    "65536 copy tiling 1024 x 8": (65536, 8, 1024, 1, 0, 1, "row"),
}
SCALED = (  # also timed at 4x the rows
    "32768 copy tiling 512 x 8, a block a row",
    "32768 2 reductions",
    "65536 2 reductions + exchange, clusters of 2 x 512 x 8",
)
ELEMENTS = 2**27


def expression(items, block, minb, dep, c, walk):
    fn = "dataflow_cl" if c > 1 else "dataflow"
    return f"{fn}<{items}, {block}, {minb}, {dep}, {c}, {WALKS[walk]}>"


def written(x, y, rows, dep):
    """Whether every row was written once: y == x, but where a row's value met the magic word,
    which flips bit 0 of the first word of each of that row's packs (the rows' y start as all
    ones, which no x word is: x < 2**31)."""
    d = (y ^ x).reshape(rows, -1, 4)
    if dep == 0:
        return bool((d == 0).all())
    flip = d[:, :1, 0]  # a row's flag, as its first pack took it
    return bool((d[..., 1:] == 0).all() and (d[..., 0] == flip).all() and (flip <= 1).all())


def main():
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    names = [expression(*v[1:]) for v in VARIANTS.values()]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=names)
    copy = bench.copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    tickets = cp.zeros(1 << 14, cp.uint32)  # a zeroed counter for each launch
    used = [0]
    for (label, (n, _, block, minb, dep, c, walk)), name in zip(VARIANTS.items(), names):
        k = mod.get_function(name)
        times = {}
        for scale in (1, 4) if label in SCALED else (1,):
            nbytes = 2 * ELEMENTS * scale  # x's bytes as bf16
            rows = nbytes // (2 * n)
            xs = [
                cp.random.randint(0, 2**31, size=nbytes // 4, dtype=cp.int64).astype(cp.uint32)
                for _ in range(2)
            ]
            y = cp.full(nbytes // 4, 0xFFFFFFFF, cp.uint32)
            grid = rows * c if walk == "row" else sms * minb
            grid -= grid % c
            turn = [0]

            def call(k=k, xs=xs, y=y, grid=grid, block=block, rows=rows, turn=turn):
                turn[0] += 1
                used[0] += 1
                if used[0] == tickets.size:
                    raise RuntimeError("out of ticket counters")
                counter = tickets[used[0] :]
                k((grid,), (block,), (xs[turn[0] % 2], y, cp.int64(rows), counter))

            call()
            cp.cuda.Device().synchronize()
            ok = written(xs[turn[0] % 2], y, rows, dep)
            t = min(bench.time_ms(call) for _ in range(3))
            times[scale] = t
            g = 2 * nbytes / t * 1e-6
            print(
                f"  {label:56s} x{scale}: {g:5.0f} GB/s ({g / copy:.1%}) {t * 1e3:6.1f} us"
                f"{'' if ok else '  WRONG'}",
                flush=True,
            )
            del xs, y
        if 4 in times:
            per = (times[4] - times[1]) / 3  # ms per 2 * ELEMENTS bytes of x more
            steady = 2 * 2 * ELEMENTS / per * 1e-6
            print(
                f"    steady state {steady:.0f} GB/s ({steady / copy:.1%}), a launch "
                f"+{(times[1] - per) * 1e3:.1f} us",
                flush=True,
            )
    dt = cp.dtype("bfloat16")
    for n in (32768, 65536):
        m = ELEMENTS // n
        xs = [ref.sample((m, n), dt, seed=n + i) for i in range(2)]
        w = ref.sample((n,), dt, loc=1.0, scale=0.2, seed=1)
        b = ref.sample((n,), dt, loc=0.0, scale=0.2, seed=2)
        for label, wb in (("w and b", (w, b)), ("no w or b", (None, None))):
            turn = [0]

            def fwd(xs=xs, wb=wb, turn=turn):
                turn[0] += 1
                return cupyln.forward(xs[turn[0] % 2], *wb)

            t = min(bench.time_ms(fwd) for _ in range(3))
            g = 2 * xs[0].nbytes / t * 1e-6
            print(
                f"  {n} cupyln.forward, bf16, {label:9s}{' ' * 23}: {g:5.0f} GB/s "
                f"({g / copy:.1%}) {t * 1e3:6.1f} us",
                flush=True,
            )
        del xs


if __name__ == "__main__":
    main()
