// A producer kernel's FP8 output (issue 40): an elementwise kernel whose output only an FP8 GEMM
// reads writes it cast to FP8 with its transpose, as the quantize family's cast would from the
// high-precision tensor, which is then never written (nor read back). Each value is rounded to the
// kernel's dtype T first, as the tensor would hold it: the FP8 bytes, the transpose and the amax
// are bit for bit those of the unfused kernel followed by fp8_cast (and its CPU reference).
//
// A block is 32 x 8 threads over a tile of FP8_TILE_ROWS (32) rows and 32 * VEC columns: thread
// (x, y) computes VEC columns of rows 4y .. 4y + 3 (FP8_ROWS_A_THREAD) and packs each column's 4
// bytes into one 32-bit word (Fp8Tile::put); fp8_tile_store writes the rows (8 bytes a row a
// thread at VEC 8) and, through a shared [column][row / 4] array, the transpose: each column's 32
// bytes as two 16-byte stores, as quantize.cuh's cast_tile does. The scale is the recipe state's
// (delayed) or TE's from a finished amax pass (current: the same kernel run first with its stores
// off, keeping the amax only). Plain CUDA C++; the elementwise templates only instantiate it.
#pragma once
#include "quantize.cuh"

namespace fg {

constexpr int FP8_TILE_ROWS = 32, FP8_ROWS_A_THREAD = 4, FP8_TILE_THREADS = 256;

// The scale a producer casts with: the state's (``scale``, delayed scaling) or TE's from the
// amax (``amax``, current scaling's second launch); 1 where neither is given (the amax launch,
// which stores nothing). Block (0, 0)'s first thread writes its inverse into ``scale_inv``.
__device__ __forceinline__ float fp8_producer_scale(const float* __restrict__ scale, const float* __restrict__ amax,
                                                    float* __restrict__ scale_inv, int e5m2, int eps_bits,
                                                    int power_2) {
  float s = 1.0f;
  if (amax != nullptr) {
    const float epsilon = __int_as_float(eps_bits);
    s = e5m2 ? scale_from_amax<57344>(*amax, epsilon, power_2) : scale_from_amax<448>(*amax, epsilon, power_2);
  } else if (scale != nullptr) {
    s = *scale;
  }
  if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    *scale_inv = __frcp_rn(s);
  }
  return s;
}

// One thread's VEC columns of its FP8_ROWS_A_THREAD rows: column k's bytes in words[k], row j in
// byte j, and the running max of |value| as stored in T (fg::abs_bits).
template <typename T, int VEC>
struct Fp8Tile {
  unsigned int words[VEC];
  int amax_bits;

  __device__ __forceinline__ Fp8Tile() : amax_bits(0) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) words[k] = 0;
  }

  __device__ __forceinline__ void put(int j, const float (&v)[VEC], float scale, int e5m2) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float stored = to_float<T>(from_float<T>(v[k]));  // as the high-precision tensor holds it
      amax_bits = max(amax_bits, abs_bits(stored));
      const unsigned int byte = e5m2 ? __nv_fp8_e5m2(stored * scale).__x : __nv_fp8_e4m3(stored * scale).__x;
      words[k] |= byte << (8 * j);
    }
  }
};

// The tile's stores: the rows into y [rows, cols] (null: none) and the transpose into y_t
// [cols, t_cols] (null: none; rows past ``rows`` are left as the launcher made them), ``col``
// being the thread's first column in y and ``tile_col`` the block's. Every thread of the block
// calls it (a barrier, where y_t is given); ``shared`` holds 32 * VEC * (FP8_TILE_ROWS / 4 + 1)
// words.
template <int VEC>
__device__ __forceinline__ void fp8_tile_store(const unsigned int (&words)[VEC], unsigned char* __restrict__ y,
                                               unsigned char* __restrict__ y_t, unsigned int* shared, int col,
                                               int tile_col, int rows, int cols, int t_cols) {
  constexpr int WORDS = FP8_TILE_ROWS / 4 + 1, COLUMNS = 32 * VEC;
  const int row0 = blockIdx.y * FP8_TILE_ROWS + threadIdx.y * FP8_ROWS_A_THREAD;
  if (y != nullptr) {
#pragma unroll
    for (int j = 0; j < FP8_ROWS_A_THREAD; ++j) {
      if (row0 + j < rows) {
        Vec<unsigned char, VEC> out;
#pragma unroll
        for (int k = 0; k < VEC; ++k) out.v[k] = static_cast<unsigned char>(words[k] >> (8 * j));
        *reinterpret_cast<Vec<unsigned char, VEC>*>(y + static_cast<long long>(row0 + j) * cols + col) = out;
      }
    }
  }
  if (y_t == nullptr) return;
  __syncthreads();  // (the shared array's previous use, a second lane's tile, is done)
#pragma unroll
  for (int k = 0; k < VEC; ++k) shared[(threadIdx.x * VEC + k) * WORDS + threadIdx.y] = words[k];
  __syncthreads();
  const int thread = threadIdx.y * 32 + threadIdx.x;
#pragma unroll
  for (int pass = 0; pass < COLUMNS * (FP8_TILE_ROWS / 16) / FP8_TILE_THREADS; ++pass) {
    const int item = pass * FP8_TILE_THREADS + thread;
    const int column = item / (FP8_TILE_ROWS / 16), part = item % (FP8_TILE_ROWS / 16);
    const int row = blockIdx.y * FP8_TILE_ROWS + part * 16;
    if (row >= rows) continue;
    Vec<unsigned int, 4> four;
#pragma unroll
    for (int w = 0; w < 4; ++w) four.v[w] = shared[column * WORDS + part * 4 + w];
    unsigned char* out = y_t + static_cast<long long>(tile_col + column) * t_cols + row;
    if (row + 16 <= rows) {
      *reinterpret_cast<Vec<unsigned int, 4>*>(out) = four;
    } else {
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(four.v);
      for (int k = 0; k < 16 && row + k < rows; ++k) out[k] = bytes[k];
    }
  }
}

}  // namespace fg
