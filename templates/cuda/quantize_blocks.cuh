// TE's Float8BlockScaling casts (issue 40): x [rows, cols] cast to FP8 with a scale per block,
// 1x128 (a row's 128 consecutive values: "1D") or 128x128 ("2D"), as TE's
// quantize_transpose_vector_blockwise.cu and quantize_transpose_square_blockwise.cu make them: the
// scale is compute_scale_from_amax of the block's amax with the value for an overflowing scale
// being x's dtype's largest (TE's TypeInfo<IType>::max_finite_value), the cast the fp32 product
// converted saturating. Both copies a GEMM reads are cast from x itself in one pass: the row-wise
// one (y [rows, cols], for the forward GEMM and the dgrad) and the transposed one (y_t [cols,
// rows rounded up to 128], the weight grad's), each with its own blocks (1D: along its rows, so
// the transposed copy's blocks are 128 rows of a column of x; 2D: the same blocks, transposed).
// Plain CUDA C++; templates/quantize/ only instantiates it.
#pragma once
#include "quantize.cuh"

namespace fg {

template <typename T> __device__ __forceinline__ float largest_finite();
template <> __device__ __forceinline__ float largest_finite<float>() { return 3.402823466e38f; }
template <> __device__ __forceinline__ float largest_finite<__half>() { return 65504.0f; }
template <> __device__ __forceinline__ float largest_finite<__nv_bfloat16>() { return 3.38953139e38f; }

// One value to FP8. From sm_89 on a conversion instruction; below, cuda_fp8.hpp converts in
// software (some 30 instructions), which a call keeps out of cast_blocks' unrolled loops: inlined
// there, the sm_80 binary was 900 KB.
template <typename F8>
#ifdef FG_FP8_CONVERSION_INSTRUCTIONS
__device__ __forceinline__
#else
__device__ __noinline__
#endif
unsigned char fp8_byte(float v) {
  return F8(v).__x;
}

// A block of BT threads casts one tile of BR x BR values of x: warp w holds rows 16w..16w+15 of
// it, lane l columns 4l..4l+3 of each (a warp's load of a row is 128 contiguous values), 64 values
// a thread in registers, so x is read once. The scales' inverses go out as the GEMM reads them:
// 1D row-wise s [cols / 128, rows] (a column of it per block of columns), 1D transposed s_t
// [rows / 128 rounded up, cols]; 2D s [rows / 128 rounded up, cols / 128] and s_t its transpose.
// The transposed copy goes through shared memory as [column][16-byte chunk of 16 rows], the
// chunk index XOR-ed with (column / 4) % 8 so that neither its writes (a lane's 4 columns) nor
// its reads (8 threads a column) meet in a bank. Rows past ``rows`` are zeros: the transposed
// copy's padding, which the weight grad's reduction reads. A null y (y_t) writes no row-wise
// (transposed) copy; cols is a multiple of 128.
constexpr int BR = 128, BT = 256;

template <typename T, typename F8, int FP8_MAX>
__device__ __forceinline__ void cast_blocks(const T* __restrict__ x, unsigned char* __restrict__ y,
                                            float* __restrict__ s, unsigned char* __restrict__ y_t,
                                            float* __restrict__ s_t, int rows, int cols, int t_cols, int square,
                                            int eps_bits, int power_2) {
  constexpr int R = 16, E = 4, WARPS = BT / 32;
  static_assert(WARPS * R == BR && 32 * E == BR, "a warp per 16 rows, 4 columns a lane");
  __shared__ int column_max[WARPS][BR];
  __shared__ Vec<unsigned int, 4> chunks[BR * BR / 16];  // [column][chunk], swizzled
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile_row = blockIdx.y * BR, tile_col = blockIdx.x * BR;
  const int row0 = tile_row + warp * R, col = tile_col + lane * E;
  const float epsilon = __int_as_float(eps_bits), overflow = largest_finite<T>();

  Vec<T, E> raw[R];  // all 16 loads in flight before any math
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (row0 + j < rows) {
      raw[j] = load_raw<T, E>(x + static_cast<long long>(row0 + j) * cols + col);
    } else {
#pragma unroll
      for (int k = 0; k < E; ++k) raw[j].v[k] = from_float<T>(0.0f);
    }
  }
  // the values stay as loaded (half the registers at 16 bits: 3 blocks an SM where floats fit 2),
  // converted where used (to_float: exact)
  int row_max[R], col_max[E] = {};
#pragma unroll
  for (int j = 0; j < R; ++j) {
    int m = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      m = max(m, abs_bits(to_float<T>(raw[j].v[k])));
      col_max[k] = max(col_max[k], abs_bits(to_float<T>(raw[j].v[k])));
    }
    row_max[j] = __reduce_max_sync(0xffffffffu, m);  // the row's 128 values
  }
#pragma unroll
  for (int k = 0; k < E; ++k) column_max[warp][lane * E + k] = col_max[k];
  __syncthreads();
  int tile_max = 0;  // (2D) the whole tile's
#pragma unroll
  for (int k = 0; k < E; ++k) {
    int m = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = max(m, column_max[w][lane * E + k]);
    col_max[k] = m;  // now over the tile's 128 rows
    tile_max = max(tile_max, m);
  }
  tile_max = __reduce_max_sync(0xffffffffu, tile_max);
  const float tile_scale = scale_from_amax<FP8_MAX>(__int_as_float(tile_max), epsilon, power_2, overflow);

  if (y != nullptr) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int row = row0 + j;
      if (row >= rows) break;
      const float scale = square ? tile_scale : scale_from_amax<FP8_MAX>(__int_as_float(row_max[j]), epsilon,
                                                                           power_2, overflow);
      Vec<unsigned char, E> out;
#pragma unroll
      for (int k = 0; k < E; ++k) out.v[k] = fp8_byte<F8>(to_float<T>(raw[j].v[k]) * scale);
      *reinterpret_cast<Vec<unsigned char, E>*>(y + static_cast<long long>(row) * cols + col) = out;
      if (!square && lane == 0) s[static_cast<long long>(blockIdx.x) * rows + row] = __frcp_rn(scale);
    }
    if (square && threadIdx.x == 0) s[blockIdx.y * (cols / BR) + blockIdx.x] = __frcp_rn(tile_scale);
  }
  if (y_t == nullptr) return;
#pragma unroll
  for (int k = 0; k < E; ++k) {
    const float scale = square ? tile_scale : scale_from_amax<FP8_MAX>(__int_as_float(col_max[k]), epsilon,
                                                                         power_2, overflow);
    if (!square && warp == 0) s_t[static_cast<long long>(blockIdx.y) * cols + col + k] = __frcp_rn(scale);
    Vec<unsigned int, 4> four = {};  // the column's 16 rows, row 4i + b in byte b of word i
#pragma unroll
    for (int j = 0; j < R; ++j) {
      four.v[j / 4] |= static_cast<unsigned int>(fp8_byte<F8>(to_float<T>(raw[j].v[k]) * scale)) << (8 * (j % 4));
    }
    const int column = lane * E + k;
    chunks[column * 8 + (warp ^ (column / 4 % 8))] = four;
  }
  if (square && threadIdx.x == 0) s_t[blockIdx.x * gridDim.y + blockIdx.y] = __frcp_rn(tile_scale);
  __syncthreads();
#pragma unroll
  for (int pass = 0; pass < BR * BR / 16 / BT; ++pass) {
    const int item = pass * BT + threadIdx.x;
    const int column = item / 8, chunk = item % 8;
    *reinterpret_cast<Vec<unsigned int, 4>*>(y_t + static_cast<long long>(tile_col + column) * t_cols + tile_row +
                                             chunk * 16) = chunks[column * 8 + (chunk ^ (column / 4 % 8))];
  }
}

}  // namespace fg
