// FP8 casts as Transformer Engine makes them (issue 40): an amax pass (current scaling's first
// kernel, common/recipe/current_scaling.cu) and a cast that multiplies by the scale in fp32 and
// converts saturating (__nv_fp8_e4m3 / __nv_fp8_e5m2's float constructors use __NV_SATFINITE:
// cuda_fp8.hpp), writing the FP8 tensor, optionally its transpose (TE's cast-transpose: the
// weight grad's and the dgrad's operands), the scale's inverse (the GEMM's dequantizing factor)
// and, for delayed scaling, the tensor's amax into its history slot. The scale is the recipe
// state's (delayed) or computed from a finished amax pass (current: compute_scale_from_amax,
// common/recipe/recipe_common.cuh). Plain CUDA C++; templates/quantize/ only instantiates it.
#pragma once
#include <cuda_fp8.h>
#include "common.cuh"

namespace fg {

// Maxima of |x| are kept as the bits of fabsf(x), an int: non-negative floats order as their
// bits do, and a NaN's (0x7fc00000 and up) is above +inf's, so a NaN wins the max (fmaxf would
// drop it) and reaches the scale, which is then 1 (current) or kept (delayed), as TE's.
__device__ __forceinline__ int abs_bits(float v) { return __float_as_int(fabsf(v)); }

// Block-wide max of such bits; the result is valid in thread 0.
template <int THREADS>
__device__ __forceinline__ int block_max(int v) {
  __shared__ int warps[THREADS / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < THREADS / 32 ? warps[threadIdx.x] : 0;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// |x|'s max over n elements (n a multiple of 8, x 16-byte aligned) into *amax (atomic max: the
// caller zeroes it first for current scaling; delayed scaling's history slot takes it as it is).
// A grid-stride loop of 8-element vectors.
template <typename T, int THREADS>
__device__ __forceinline__ void amax_pass(const T* __restrict__ x, float* __restrict__ amax, long long n) {
  constexpr int E = 8;
  int m = 0;
  for (long long i = (static_cast<long long>(blockIdx.x) * THREADS + threadIdx.x) * E; i < n;
       i += static_cast<long long>(gridDim.x) * THREADS * E) {
    float f[E];
    if constexpr (sizeof(T) == 4) {
      to_floats(load_raw<T, 4>(x + i), *reinterpret_cast<float(*)[4]>(f));
      to_floats(load_raw<T, 4>(x + i + 4), *reinterpret_cast<float(*)[4]>(f + 4));
    } else {
      to_floats(load_raw<T, E>(x + i), f);
    }
#pragma unroll
    for (int k = 0; k < E; ++k) m = max(m, abs_bits(f[k]));
  }
  m = block_max<THREADS>(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), m);
}

// TE's compute_scale_from_amax: max / max(amax, epsilon); 1 for an amax of 0, inf or NaN;
// FLT_MAX where the division overflows; with power_2, floored to a power of 2.
template <int FP8_MAX>
__device__ __forceinline__ float scale_from_amax(float amax, float epsilon, int power_2) {
  if (amax < epsilon) amax = epsilon;
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(static_cast<float>(FP8_MAX), amax);
  if (isinf(scale)) scale = 3.402823466e38f;
  if (power_2) scale = __int_as_float(__float_as_int(scale) & 0xFF800000);
  return scale;
}

// One tile of QR rows x QC columns per block of QT threads: each thread casts 8 consecutive
// elements of a row (a 16-byte load at 16 bits), writing 8 FP8 bytes; with y_t, the tile goes
// through shared memory and out transposed, each thread writing 16 bytes of a column. Rows past
// ``rows`` are skipped (y_t's columns past them stay as the launcher made them: zeros where the
// weight grad pads its reduction to a multiple of 16).
constexpr int QR = 32, QC = 128, QT = 256;

template <typename T, typename F8, int FP8_MAX>
__device__ __forceinline__ void cast_tile(
    const T* __restrict__ x, unsigned char* __restrict__ y, unsigned char* __restrict__ y_t,
    const float* __restrict__ scale_in, const float* __restrict__ amax_in, float* __restrict__ scale_inv,
    float* __restrict__ amax_out, int rows, int cols, int t_cols, int eps_bits, int power_2) {
  constexpr int E = 8, PER_ROW = QC / E, ROWS_PER_PASS = QT / PER_ROW;
  __shared__ __align__(16) unsigned char tile[QC][QR + 16];  // [column][row], padded
  const float scale = amax_in != nullptr ? scale_from_amax<FP8_MAX>(*amax_in, __int_as_float(eps_bits), power_2)
                                         : *scale_in;
  if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
  const int row0 = blockIdx.y * QR, col0 = blockIdx.x * QC;
  const int c = (threadIdx.x % PER_ROW) * E;
  int m = 0;
#pragma unroll
  for (int pass = 0; pass < QR / ROWS_PER_PASS; ++pass) {
    const int r = pass * ROWS_PER_PASS + threadIdx.x / PER_ROW;
    const int row = row0 + r, col = col0 + c;
    if (row < rows && col < cols) {
      const long long at = static_cast<long long>(row) * cols + col;
      float f[E];
      if constexpr (sizeof(T) == 4) {
        to_floats(load_raw<T, 4>(x + at), *reinterpret_cast<float(*)[4]>(f));
        to_floats(load_raw<T, 4>(x + at + 4), *reinterpret_cast<float(*)[4]>(f + 4));
      } else {
        to_floats(load_raw<T, E>(x + at), f);
      }
      Vec<unsigned char, E> out;
#pragma unroll
      for (int k = 0; k < E; ++k) {
        m = max(m, abs_bits(f[k]));
        out.v[k] = F8(f[k] * scale).__x;  // fp32 product, saturating conversion
      }
      *reinterpret_cast<Vec<unsigned char, E>*>(y + at) = out;
      if (y_t != nullptr) {
#pragma unroll
        for (int k = 0; k < E; ++k) tile[c + k][r] = out.v[k];
      }
    }
  }
  if (amax_out != nullptr) {
    m = block_max<QT>(m);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax_out), m);
  }
  if (y_t == nullptr) return;
  __syncthreads();
  // the transpose: QC columns of QR bytes, two threads a column, 16 bytes each
  const int column = threadIdx.x / 2, half = (threadIdx.x % 2) * 16;
  const int col = col0 + column;
  if (col >= cols) return;
  const int row = row0 + half;
  const Vec<unsigned char, 16> bytes = *reinterpret_cast<const Vec<unsigned char, 16>*>(&tile[column][half]);
  unsigned char* out = y_t + static_cast<long long>(col) * t_cols + row;
  if (row + 16 <= rows) {
    *reinterpret_cast<Vec<unsigned char, 16>*>(out) = bytes;
  } else {
    for (int k = 0; k < 16 && row + k < rows; ++k) out[k] = bytes.v[k];
  }
}

}  // namespace fg
