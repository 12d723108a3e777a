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
#include "amax.cuh"

// cuda_fp8.hpp converts with one cvt.rn.satfinite instruction per pair from sm_89 on and in
// software below (it tests __CUDA_ARCH__): this test of the arch makes fusegen compile these
// kernels for each arch by itself (toolchain/nvrtc.py TESTS_ARCH), so sm_90's binary is not
// assembled from sm_80's PTX: on the H100 a bf16 [16384, 28672] cast took 1053 us from sm_80's
// PTX, 465 us (3.0 TB/s, a copy's speed) compiled for sm_90; with its transpose 1104 -> 756 us.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FG_FP8_CONVERSION_INSTRUCTIONS 1
#endif

namespace fg {

// 8 consecutive elements (16-byte aligned) as floats: one 16-byte load at 16 bits, two at 32.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ p, float (&f)[8]) {
  if constexpr (sizeof(T) == 4) {
    to_floats(load_raw<T, 4>(p), *reinterpret_cast<float(*)[4]>(f));
    to_floats(load_raw<T, 4>(p + 4), *reinterpret_cast<float(*)[4]>(f + 4));
  } else {
    to_floats(load_raw<T, 8>(p), f);
  }
}

// The same 8 elements as loaded (16 bytes at 16 bits, 32 at 32), to convert later: a thread's
// loads all in flight before it converts any, in half the registers floats take at 16 bits.
template <typename T>
struct Raw8 {
  static constexpr int N = 16 / sizeof(T), PARTS = 8 / N;
  Vec<T, N> part[PARTS];
};

template <typename T>
__device__ __forceinline__ void load8_raw(const T* __restrict__ p, Raw8<T>& raw) {
#pragma unroll
  for (int i = 0; i < Raw8<T>::PARTS; ++i) raw.part[i] = load_raw<T, Raw8<T>::N>(p + i * Raw8<T>::N);
}

template <typename T>
__device__ __forceinline__ void to_floats8(const Raw8<T>& raw, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < Raw8<T>::PARTS; ++i) {
    to_floats(raw.part[i], *reinterpret_cast<float(*)[Raw8<T>::N]>(f + i * Raw8<T>::N));
  }
}

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
    load8(x + i, f);
#pragma unroll
    for (int k = 0; k < E; ++k) m = max(m, abs_bits(f[k]));
  }
  m = block_max<THREADS>(m);
  if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), m);
}

// TE's compute_scale_from_amax: max / max(amax, epsilon); 1 for an amax of 0, inf or NaN;
// ``overflow`` (current scaling: FLT_MAX; block scaling: x's dtype's largest) where the division
// overflows; with power_2, floored to a power of 2.
template <int FP8_MAX>
__device__ __forceinline__ float scale_from_amax(float amax, float epsilon, int power_2,
                                                 float overflow = 3.402823466e38f) {
  if (amax < epsilon) amax = epsilon;
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(static_cast<float>(FP8_MAX), amax);
  if (isinf(scale)) scale = overflow;
  if (power_2) scale = __int_as_float(__float_as_int(scale) & 0xFF800000);
  return scale;
}

// torchao's row-wise scale: max / max(amax, 1e-12) in double, rounded to fp32, with power_2 its
// mantissa dropped (floored to a power of 2: TE's mask, where torchao takes exp2(floor(log2))); a
// NaN amax gives a NaN scale (torch.clamp keeps a NaN).
template <int FP8_MAX>
__device__ __forceinline__ float rowwise_scale(float amax, int power_2) {
  float scale = amax != amax ? amax : static_cast<float>(static_cast<double>(FP8_MAX) / fmax(static_cast<double>(amax), 1e-12));
  if (power_2) scale = __int_as_float(__float_as_int(scale) & 0xFF800000);
  return scale;
}

// The row-wise recipe's cast of x [rows, cols] with a scale per row: a block a row, its amax in a
// first pass over the row, the cast in a second (the row comes back from L2), the scale's inverse
// into scale_inv[row].
template <typename T, typename F8, int FP8_MAX, int THREADS>
__device__ __forceinline__ void cast_rows(const T* __restrict__ x, unsigned char* __restrict__ y,
                                          float* __restrict__ scale_inv, int cols, int power_2) {
  constexpr int E = 8;
  __shared__ float shared_scale;
  const long long base = static_cast<long long>(blockIdx.x) * cols;
  int m = 0;
  for (int c = threadIdx.x * E; c < cols; c += THREADS * E) {
    float f[E];
    load8(x + base + c, f);
#pragma unroll
    for (int k = 0; k < E; ++k) m = max(m, abs_bits(f[k]));
  }
  m = block_max<THREADS>(m);
  if (threadIdx.x == 0) {
    shared_scale = rowwise_scale<FP8_MAX>(__int_as_float(m), power_2);
    scale_inv[blockIdx.x] = __frcp_rn(shared_scale);
  }
  __syncthreads();
  const float scale = shared_scale;
  for (int c = threadIdx.x * E; c < cols; c += THREADS * E) {
    float f[E];
    load8(x + base + c, f);
    Vec<unsigned char, E> out;
#pragma unroll
    for (int k = 0; k < E; ++k) out.v[k] = F8(f[k] * scale).__x;
    *reinterpret_cast<Vec<unsigned char, E>*>(y + base + c) = out;
  }
}

// |x|'s max per column of x [rows, cols] into amax[cols] (zeroed by the launcher): a block covers
// 256 columns (8 a thread) of ROWS_PER_BLOCK rows, 8 threads a column group taking every 8th row,
// one atomic max a column and block.
constexpr int AMAX_COLS_ROWS = 256;

template <typename T>
__device__ __forceinline__ void amax_cols_pass(const T* __restrict__ x, float* __restrict__ amax, int rows, int cols) {
  constexpr int E = 8, LANES = 8;
  __shared__ int partial[LANES][32 * E];
  const int group = threadIdx.x % 32, lane = threadIdx.x / 32;
  const int col = blockIdx.x * 32 * E + group * E;
  const int first = blockIdx.y * AMAX_COLS_ROWS;
  int m[E] = {};
  if (col < cols) {
    for (int row = first + lane; row < min(rows, first + AMAX_COLS_ROWS); row += LANES) {
      float f[E];
      load8(x + static_cast<long long>(row) * cols + col, f);
#pragma unroll
      for (int k = 0; k < E; ++k) m[k] = max(m[k], abs_bits(f[k]));
    }
  }
#pragma unroll
  for (int k = 0; k < E; ++k) partial[lane][group * E + k] = m[k];
  __syncthreads();
  const int c = threadIdx.x;  // one column of the block's 256 a thread
  int best = 0;
#pragma unroll
  for (int l = 0; l < LANES; ++l) best = max(best, partial[l][c]);
  if (blockIdx.x * 32 * E + c < cols) atomicMax(reinterpret_cast<int*>(amax + blockIdx.x * 32 * E + c), best);
}

// One tile of QR rows x QC columns per block of QT threads, a warp per 4 consecutive rows: lane
// l casts 8 consecutive columns (8l..8l+7) of each, loaded as one 16-byte vector a row at 16 bits
// (two at 32), so a warp's load is 512 contiguous bytes of a row and its store of 8 FP8 bytes a
// lane 256. For the transpose, each column's 4 bytes (the warp's 4 rows) make one 32-bit word of
// a shared [column][row / 4] array (padded by a word: the stores conflict 8-way, far below what
// the memory traffic leaves the SM), and each column goes out as QR bytes, 16 a thread. Rows
// past ``rows`` are skipped (y_t's columns past them stay as the launcher made them: zeros where
// the weight grad pads its reduction to a multiple of 16).
constexpr int QR = 32, QC = 256, QT = 256;

// With PER_COLUMN (the row-wise recipe's weight-grad operands): each column its own scale, from
// its amax over the rows (col_amax, amax_cols_pass), its inverse into scale_inv[column]; only the
// transpose is written (y is null): a row of it is a column, scaled as one.
template <typename T, typename F8, int FP8_MAX, bool PER_COLUMN = false>
__device__ __forceinline__ void cast_tile(
    const T* __restrict__ x, unsigned char* __restrict__ y, unsigned char* __restrict__ y_t,
    const float* __restrict__ scale_in, const float* __restrict__ amax_in, float* __restrict__ scale_inv,
    float* __restrict__ amax_out, int rows, int cols, int t_cols, int eps_bits, int power_2) {
  constexpr int E = 8, WORDS = QR / 4 + 1;
  static_assert(QT / 32 * 4 == QR && 32 * E == QC, "a warp per 4 rows, 8 columns a lane");
  __shared__ unsigned int tile[QC * WORDS];  // [column][row / 4], 4 rows' bytes a word
  const int warp = threadIdx.x / 32, c = (threadIdx.x % 32) * E;
  const int row0 = blockIdx.y * QR + 4 * warp, col = blockIdx.x * QC + c;
  float scales[E];
  if constexpr (PER_COLUMN) {  // amax_in: the columns' amaxes
#pragma unroll
    for (int k = 0; k < E; ++k) {
      scales[k] = col + k < cols ? rowwise_scale<FP8_MAX>(amax_in[col + k], power_2) : 1.0f;
      if (blockIdx.y == 0 && warp == 0 && col + k < cols) scale_inv[col + k] = __frcp_rn(scales[k]);
    }
  } else {
    const float scale = amax_in != nullptr ? scale_from_amax<FP8_MAX>(*amax_in, __int_as_float(eps_bits), power_2)
                                           : *scale_in;
    if (scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __frcp_rn(scale);
#pragma unroll
    for (int k = 0; k < E; ++k) scales[k] = scale;
  }
  int m = 0;
  unsigned int words[E] = {};  // column k's 4 bytes, row row0 + j in byte j
  if (col < cols) {
    // the 4 rows' loads first, all in flight before the first store (interleaved with the stores
    // they went one at a time: 2.47 TB/s against 2.62 on an H100, a copy's 3.0)
    Raw8<T> raw[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (row0 + j < rows) load8_raw(x + static_cast<long long>(row0 + j) * cols + col, raw[j]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = row0 + j;
      if (row < rows) {
        float f[E];
        to_floats8(raw[j], f);
        Vec<unsigned char, E> out;
#pragma unroll
        for (int k = 0; k < E; ++k) {
          m = max(m, abs_bits(f[k]));
          out.v[k] = F8(f[k] * scales[k]).__x;  // the fp32 product, converted saturating
          words[k] |= static_cast<unsigned int>(out.v[k]) << (8 * j);
        }
        if constexpr (!PER_COLUMN) {
          *reinterpret_cast<Vec<unsigned char, E>*>(y + static_cast<long long>(row) * cols + col) = out;
        }
      }
    }
  }
  if (amax_out != nullptr) {
    m = block_max<QT>(m);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax_out), m);
  }
  if (y_t == nullptr) return;
#pragma unroll
  for (int k = 0; k < E; ++k) tile[(c + k) * WORDS + warp] = words[k];
  __syncthreads();
  // the transpose: QC columns of QR bytes, 16 bytes (4 words) a thread
#pragma unroll
  for (int pass = 0; pass < QC * QR / 16 / QT; ++pass) {
    const int item = pass * QT + threadIdx.x;
    const int column = item / (QR / 16), part = item % (QR / 16);
    const int out_col = blockIdx.x * QC + column, row = blockIdx.y * QR + part * 16;
    if (out_col >= cols || row >= rows) continue;
    Vec<unsigned int, 4> four;
#pragma unroll
    for (int w = 0; w < 4; ++w) four.v[w] = tile[column * WORDS + part * 4 + w];
    unsigned char* out = y_t + static_cast<long long>(out_col) * t_cols + row;
    if (row + 16 <= rows) {
      *reinterpret_cast<Vec<unsigned int, 4>*>(out) = four;
    } else {
      const unsigned char* bytes = reinterpret_cast<const unsigned char*>(four.v);
      for (int k = 0; k < 16 && row + k < rows; ++k) out[k] = bytes[k];
    }
  }
}

// Delayed scaling's update after a step for one state's slot, a block a slot (blockIdx.x; TE's
// fused kernel, kernel_bulk of common/recipe/delayed_scaling.cu): the step's amax is the reduced
// one where given and not 0, else the history's first row; where it is not 0 the history [len, n]
// rolls up by a row, its first zeroed and the amax last; the amax to scale from is the max over
// the old window but its first row and the step's (fmaxf: a NaN drops out) or, most_recent, the
// step's; the scale max * 2^-margin / amax where that is finite and positive, else kept, FLT_MAX
// where it overflows. The block's threads share the window (TE's default is 1,024 rows), a row a
// thread at a time, in order: each pass reads its rows, waits for the block, and only then writes
// them back a row up, so no thread reads a row another already moved (a thread a slot walking
// 1,024 dependent loads took 78 us a state on an H100).
template <int THREADS>
__device__ __forceinline__ void delayed_update_slot(float* __restrict__ history, float* __restrict__ scale,
                                                    const float* __restrict__ amax, int length, int n,
                                                    int most_recent, float scaled_max) {
  __shared__ float maxima[THREADS / 32];
  const int i = blockIdx.x;
  const float last = (amax != nullptr && amax[i] != 0.0f) ? amax[i] : history[i];
  if (last == 0.0f) return;  // nothing rolls, and the scale from an amax of 0 is kept
  float chosen = 0.0f;
  for (int first = 0; first < length; first += THREADS) {
    const int k = first + threadIdx.x;  // the new row k holds the old row k + 1, the last the amax
    const float held = k < length - 1 ? history[(k + 1) * n + i] : last;
    if (k < length) chosen = fmaxf(chosen, held);
    __syncthreads();  // the pass's rows all read before any is written back
    if (k < length) history[k * n + i] = k > 0 ? held : 0.0f;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) chosen = fmaxf(chosen, __shfl_xor_sync(0xffffffffu, chosen, offset));
  if (threadIdx.x % 32 == 0) maxima[threadIdx.x / 32] = chosen;
  __syncthreads();
  if (threadIdx.x != 0) return;
  chosen = 0.0f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) chosen = fmaxf(chosen, maxima[w]);
  if (most_recent) chosen = last;
  float updated = scale[i];
  if (isfinite(chosen) && chosen > 0.0f) updated = __fdiv_rn(scaled_max, chosen);
  if (isinf(updated)) updated = 3.402823466e38f;
  scale[i] = updated;
}

}  // namespace fg
