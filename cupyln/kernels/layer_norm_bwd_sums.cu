// cupyln/kernels/layer_norm_bwd_sums.cu -- the dw/db sums of the backward: the row tier's
// column kernel, and the fixed-order reduce of every tier's partial rows.
//
// ln_bwd_dwdb_cols takes CUPYLN_BWD_PARAMS (args.cuh) and reads dy, x, mean, rstd and
// rows_per_slice; it writes one partial row of dw/db per slice of rows (also used by the jagged
// backward, with each row's sequence statistics); a Store of RMS: mean 0, and db_part may be
// nullptr. ln_partial_reduce sums G partial rows of A in a fixed order into dw and db: the same
// inputs give bitwise-identical results, no atomics.
#include "args.cuh"
#include "common.cuh"

namespace cupyln {

// dw/db partials for the "row" tier: column tiles over row slices.
//   Block (32, 8): threadIdx.x picks a column of the tile, threadIdx.y strides over the rows of
//   slice blockIdx.y (rows [blockIdx.y * rows_per_slice, +rows_per_slice)). The 8 partial sums
//   are added in y order and the block writes row blockIdx.y of dw_part / db_part.
template <typename LD, typename ST>
__global__ void __launch_bounds__(256, 1)
    ln_bwd_dwdb_cols(CUPYLN_BWD_PARAMS) {
  typedef typename LD::A A;
  constexpr bool RMS = ST::RMS;
  release_dependents();
  const int col = blockIdx.x * 32 + threadIdx.x;
  const i64 r0 = static_cast<i64>(blockIdx.y) * rows_per_slice;
  const i64 r1 = r0 + rows_per_slice < M ? r0 + rows_per_slice : M;
  A dwa = 0, dba = 0;
  if (col < N) {
#pragma unroll 4
    for (i64 row = r0 + threadIdx.y; row < r1; row += 8) {
      const A g = static_cast<A>(widen(dy[row * dy_stride + col]));
      const A mu = RMS ? A(0) : mean[row];
      const A xhat = (static_cast<A>(widen(x[row * x_stride + col])) - mu) * rstd[row];
      dwa += g * xhat;
      dba += g;
    }
  }
  sum_over_y<8>(dwa, dba);
  if (threadIdx.y == 0 && col < N) {
    const i64 o = static_cast<i64>(blockIdx.y) * N + col;
    if (dw_part != nullptr) dw_part[o] = dwa;
    if (db_part != nullptr) db_part[o] = dba;
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
          pb[u] = db_part != nullptr ? db_part[o] : A(0);
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
        if (db_part != nullptr) dba += db_part[o];
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
        if (db != nullptr) db[col] = narrow<TB>(tb);
      }
    }
  }
}

}  // namespace cupyln
