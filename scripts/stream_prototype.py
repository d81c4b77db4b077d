"""Prototype of a streaming forward for 16-bit rows (a block per row, the row read twice): the
kernel and the runs of docs/benchmark-log.md's section on a forward that streams 16-bit rows
through L2.

Pass 1 walks the row in chunks of CH 16-byte packs a thread (a chunk's loads issued one chunk
ahead), forms each chunk's exact mean and squared deviations from registers and merges them
into the thread's (mean, M2) by Chan's update (counts known at compile time: no division);
the block merges the threads' states (two block sums). Pass 2 reads x again (from L2) with w
and b and writes y. HINT: pass 1 loads with an L2 evict_last policy, pass 2 evict_first.
Compared in one process against cupyln.forward (best of ROUNDS medians, L2 flushed).

    [ROT=3] [BLOCKS=256,512,1024] python scripts/stream_prototype.py bfloat16 4096,8192,12288

ROT: x tensors rotated between calls (with ROT, only the hinted variant at 2048 threads);
BLOCKS: the block sizes tried (each with 2-4 packs a thread where they divide the row).
"""

import os
import sys

import cupy as cp
import ml_dtypes  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import cupyln  # noqa: E402
from cupyln import bench  # noqa: E402
from cupyln import reference as ref  # noqa: E402

ROUNDS = 3
SRC = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>

__device__ __forceinline__ float2 two(unsigned u, __nv_bfloat16) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
__device__ __forceinline__ float2 two(unsigned u, __half) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}
__device__ __forceinline__ unsigned pack2(float a, float b, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}
__device__ __forceinline__ unsigned pack2(float a, float b, __half) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}
template <int HINT>
__device__ __forceinline__ uint4 ld(const uint4* p, unsigned long long pol) {
  uint4 r;
  if (HINT)
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
  else
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
__device__ __forceinline__ void unpack8(const uint4 u, float (&v)[8], float k,
                                        __nv_bfloat16 tag) {
  float2 f = two(u.x, tag); v[0] = f.x - k; v[1] = f.y - k;
  f = two(u.y, tag); v[2] = f.x - k; v[3] = f.y - k;
  f = two(u.z, tag); v[4] = f.x - k; v[5] = f.y - k;
  f = two(u.w, tag); v[6] = f.x - k; v[7] = f.y - k;
}
__device__ __forceinline__ void unpack8(const uint4 u, float (&v)[8], float k, __half tag) {
  float2 f = two(u.x, tag); v[0] = f.x - k; v[1] = f.y - k;
  f = two(u.y, tag); v[2] = f.x - k; v[3] = f.y - k;
  f = two(u.z, tag); v[4] = f.x - k; v[5] = f.y - k;
  f = two(u.w, tag); v[6] = f.x - k; v[7] = f.y - k;
}

template <int BLOCK>
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float t = red[0];
#pragma unroll
  for (int i = 1; i < BLOCK / 32; ++i) t += red[i];
  return t;
}

// one row a block; P = N / 8 packs = NCH * BLOCK * CH
template <typename T, int BLOCK, int CH, int NCH, int HINT, int OCC>
__global__ void __launch_bounds__(BLOCK, OCC / BLOCK)
ln_stream(const uint4* __restrict__ x, uint4* __restrict__ y, const uint4* __restrict__ w,
          const uint4* __restrict__ b, float* __restrict__ mean, float* __restrict__ rstd,
          const float eps) {
  constexpr int P = NCH * BLOCK * CH;
  constexpr float NB = 8.f * CH;
  __shared__ float red[2][BLOCK / 32];
  const T tag{};
  unsigned long long keep = 0, drop = 0;
  if (HINT) {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(drop));
  }
  const long long row = blockIdx.x;
  const uint4* xr = x + row * P;
  const int t = threadIdx.x;
  const float k = two(__ldg(reinterpret_cast<const unsigned*>(xr)), tag).x;  // the shift
  uint4 buf[2][CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) buf[0][c] = ld<HINT>(xr + (0 * CH + c) * BLOCK + t, keep);
  float mu = 0.f, m2 = 0.f;
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    if (j + 1 < NCH) {
#pragma unroll
      for (int c = 0; c < CH; ++c)
        buf[(j + 1) & 1][c] = ld<HINT>(xr + ((j + 1) * CH + c) * BLOCK + t, keep);
    }
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      float v[8];
      unpack8(buf[j & 1][c], v, k, tag);
#pragma unroll
      for (int e = 0; e < 8; ++e) s += v[e];
    }
    const float mj = s * (1.f / NB);
    float q = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      float v[8];
      unpack8(buf[j & 1][c], v, k + mj, tag);
#pragma unroll
      for (int e = 0; e < 8; ++e) q += v[e] * v[e];
    }
    if (j == 0) {
      mu = mj; m2 = q;
    } else {
      const float na = j * NB, inv = 1.f / ((j + 1) * NB);  // constants once unrolled
      const float delta = mj - mu;
      mu += delta * (NB * inv);
      m2 += q + delta * delta * (na * NB * inv);
    }
  }
  const float rmu = block_sum<BLOCK>(mu, red[0]) * (1.f / BLOCK);
  const float dm = mu - rmu;
  const float M2 = block_sum<BLOCK>(m2 + (NCH * NB) * dm * dm, red[1]);
  const float r = rsqrtf(M2 * (1.f / (P * 8)) + eps);
  if (t == 0) { mean[row] = k + rmu; rstd[row] = r; }
  const float off = k + rmu;
  uint4* yr = y + row * P;
#pragma unroll
  for (int c = 0; c < CH; ++c) buf[0][c] = ld<HINT>(xr + (0 * CH + c) * BLOCK + t, drop);
#pragma unroll
  for (int j = 0; j < NCH; ++j) {
    if (j + 1 < NCH) {
#pragma unroll
      for (int c = 0; c < CH; ++c)
        buf[(j + 1) & 1][c] = ld<HINT>(xr + ((j + 1) * CH + c) * BLOCK + t, drop);
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int pk = (j * CH + c) * BLOCK + t;
      float v[8], wv[8], bv[8];
      unpack8(buf[j & 1][c], v, off, tag);
      unpack8(__ldg(w + pk), wv, 0.f, tag);
      unpack8(__ldg(b + pk), bv, 0.f, tag);
      uint4 o;
      o.x = pack2(v[0] * r * wv[0] + bv[0], v[1] * r * wv[1] + bv[1], tag);
      o.y = pack2(v[2] * r * wv[2] + bv[2], v[3] * r * wv[3] + bv[3], tag);
      o.z = pack2(v[4] * r * wv[4] + bv[4], v[5] * r * wv[5] + bv[5], tag);
      o.w = pack2(v[6] * r * wv[6] + bv[6], v[7] * r * wv[7] + bv[7], tag);
      yr[pk] = o;
    }
  }
}
"""


def gbs(nbytes, ms):
    return nbytes / ms * 1e-6


def compare(dtype, n: int, copy: float) -> str:
    """cupyln.forward and every prototype variant that divides the row of N, checked against
    cupyln's outputs on NaN-filled ones (a wrong variant is reported and skipped)."""
    tname = "__nv_bfloat16" if dtype == cp.dtype("bfloat16") else "__half"
    m = 2**27 // n
    x, w, b, _ = bench._inputs(m, n, dtype)  # the benchmark's data
    yc, mc, rc = cupyln.forward(x, w, b)
    rot = int(os.environ.get("ROT", "0"))
    xs = [x] + [ref.sample((m, n), dtype, seed=n + 7 * i) for i in range(1, rot)]
    turn = [0]

    def nxt():
        turn[0] += 1
        return xs[turn[0] % len(xs)]

    p = n // 8
    fns, names = [lambda: cupyln.forward(nxt(), w, b)], ["cupyln"]
    y = cp.empty_like(x)
    mean = cp.empty(m, cp.float32)
    rstd = cp.empty(m, cp.float32)
    variants = ((0, 2048), (1, 2048)) if not rot else ((1, 2048),)
    blocks = [int(v) for v in os.environ.get("BLOCKS", "256,512,1024").split(",")]
    for block in blocks:  # one pack a thread a step (CH = 1), 2-4 steps
        if p % block or not 2 <= p // block <= 4:
            continue
        nch = p // block
        for hint, occ in variants:
            name = f"ln_stream<{tname}, {block}, 1, {nch}, {hint}, {occ}>"
            mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=[name])
            k = mod.get_function(name)
            y.fill(cp.nan)
            mean.fill(cp.nan)
            rstd.fill(cp.nan)
            args = (x, y, w, b, mean, rstd, cp.float32(1e-5))
            k((m,), (block,), args)
            cp.cuda.Device().synchronize()
            ey = float(cp.abs(y.astype(cp.float32) - yc.astype(cp.float32)).max())
            em = float(cp.abs(mean - mc).max())
            er = float((cp.abs(rstd - rc) / rc).max())
            scale = float(cp.abs(yc.astype(cp.float32)).max())
            if not (ey <= 0.02 * scale and em < 1e-4 and er < 1e-4):  # NaN fails too
                print(n, name, "WRONG", ey, em, er)
                continue
            fns.append(lambda k=k, block=block, args=args: k((m,), (block,), (nxt(), *args[1:])))
            names.append(f"{block}x1x{nch}{'h' if hint else ''}/{occ}")
    best = [0.0] * len(fns)
    for _ in range(ROUNDS):
        for j, f in enumerate(fns):
            best[j] = max(best[j], gbs(2 * x.nbytes, bench.time_ms(f)))
    return f"{n} " + " ".join(f"{nm} {v:.0f} ({v / copy:.1%})" for nm, v in zip(names, best))


def main():
    dtype = cp.dtype(sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
    widths = sys.argv[2] if len(sys.argv) > 2 else "4096,8192,12288,16384,32768"
    copy = max(bench.copy_bandwidth() for _ in range(2))
    print(f"{dtype} copy 1 GiB {copy:.0f} GB/s")
    for n in (int(v) for v in widths.split(",")):
        print(compare(dtype, n, copy), flush=True)


if __name__ == "__main__":
    main()
