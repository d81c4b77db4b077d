// cupyln/kernels/args.cuh -- the dense kernels' parameters: one list per direction.
//
// Every forward kernel takes CUPYLN_FWD_PARAMS and every backward kernel CUPYLN_BWD_PARAMS, in
// this order; cupyln/_launcher/dense.py packs each list with one struct format (FWD_ARGS, BWD_ARGS
// there; ln_partial_reduce's own list is REDUCE_ARGS). The lists are kernel parameters, not a
// struct passed by value, because only __restrict__ kernel parameters keep the read-only
// (non-coherent) loads of x, w and b across the kernels' inline asm: a struct's members, or
// restrict-qualified copies of them, lose them.
// The element types come from the kernel's policies (policy.cuh): LD::X of x (and dx), ST::Y
// of y (and dy), ST::W and ST::B of w and b, LD::A the arithmetic type of the statistics.
#pragma once
#include "common.cuh"
#include "policy.cuh"

// x [M, N]: row r at x + r * x_stride, its last dimension contiguous; y [M, N] contiguous;
// w, b [N] or nullptr (no scale, no shift); mean, rstd [M], or nullptr (not stored),
// rstd = 1 / sqrt(biased variance + eps). res [M, N] at res_stride and h [M, N] contiguous: the
// residual and h = x + res, of the Load's TR and TH, read and written only by the kernels that
// fuse the residual add (a Load with a residual); the others take nullptr. qscale, qin, qamax,
// qvalue: a quantized y's scales and operands (policy.cuh QuantOut), read by the kernels whose
// Store quantizes (y is then its elements' bytes); the others take nullptr and 0.
#define CUPYLN_FWD_PARAMS                                                              \
  const typename LD::X *__restrict__ x, const i64 x_stride,                            \
      typename ST::Y *__restrict__ y, const typename ST::W *__restrict__ w,            \
      const typename ST::B *__restrict__ b, typename LD::A *__restrict__ mean,         \
      typename LD::A *__restrict__ rstd, const i64 M, const int N,                     \
      const typename LD::A eps, const void *__restrict__ res, const i64 res_stride,    \
      void *__restrict__ h, void *__restrict__ qscale, const float *__restrict__ qin,  \
      float *__restrict__ qamax, const float qvalue

// dy, x [M, N] at their row strides; w [N] or nullptr; mean, rstd [M] from the forward;
// dx [M, N] contiguous; dw_part, db_part [G, N]: one partial row of the dw/db sums per block
// (dw_part nullptr without w); inv_n: 1 / N rounded to A; rows_per_slice: the rows each of
// ln_bwd_dwdb_cols' G slices sums; dh [M, N] at dh_stride or nullptr: a gradient added to dx
// (the residual stream's). A kernel leaves unnamed the parameters it does not read.
#define CUPYLN_BWD_PARAMS                                                              \
  const typename ST::Y *__restrict__ dy, const i64 dy_stride,                          \
      const typename LD::X *__restrict__ x, const i64 x_stride,                        \
      const typename ST::W *__restrict__ w, const typename LD::A *__restrict__ mean,   \
      const typename LD::A *__restrict__ rstd, typename LD::X *__restrict__ dx,        \
      typename LD::A *__restrict__ dw_part, typename LD::A *__restrict__ db_part,      \
      const i64 M, const int N, const typename LD::A inv_n, const i64 rows_per_slice,  \
      const typename LD::R *__restrict__ dh, const i64 dh_stride
