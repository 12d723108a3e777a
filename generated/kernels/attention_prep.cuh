// The attention prep kernels' math (templates/attention_prep/): between the fused QKV projection
// and FlashAttention-2, and back.
//
// A row holds HEADS + 2 KV_HEADS heads of D: the q heads, then the k heads, then the v heads. The
// forward reads them from the projection (q, k, v: pointers into one row-strided tensor) and writes
// one dense [rows, HEADS + 2 KV_HEADS, D] buffer: rotary(q), rotary(k), v. The backward reads dq,
// dk, dv and writes the projection's grad [rows, (HEADS + 2 KV_HEADS) D]: the rotary's transpose
// (the same rotation by the negated angle) of dq and dk, dv copied; without rotary, a copy.
//
// Rotary, rotate-half (Llama, GPT-NeoX): a head [a | b] (halves of D / 2) becomes
// [a cos - b sin | b cos + a sin], angle_i = position * inv_freq_i for the half's i, position = row -
// the start of the row's packed sequence (cu_seqlens, a device buffer: no host work, so a CUDA
// graph captures it with the offsets in a graph buffer). inv_freq_i = base^(-2i / D) rounded once
// to fp32 (computed at generation time, the kernel's table), the angle is their fp32 product, and
// sincosf is the accurate one (no fast math: angles reach 10^5 radians). The math is fp32 and each
// output is rounded once to T.
#pragma once
#include "common.cuh"

namespace fg {

// The start of the packed sequence that holds ``row``: the largest cu_seqlens[s] <= row (an empty
// sequence starts where the next one does, so the search passes over it).
__device__ __forceinline__ int sequence_start(const int* __restrict__ cu_seqlens, int batch, int row) {
  int lo = 0, hi = batch;  // cu_seqlens[lo] = 0 <= row < rows = cu_seqlens[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (__ldg(cu_seqlens + mid) <= row) lo = mid;
    else hi = mid;
  }
  return __ldg(cu_seqlens + lo);
}

// Each unit's two vectors (the VEC elements at lane * VEC of its head's first half and of its
// second half) loaded from the projection (q, k, v: pointers into one row-strided tensor), the
// ``units`` of this block's rows from ``first_row`` on: the loads in flight while the block works
// out its rows' angles. Shared by the prep kernels and their table variant.
template <typename T, int HEADS, int KV_HEADS, int D, int VEC, int THREADS, int PER_THREAD>
__device__ __forceinline__ void load_head_halves(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, int q_stride, int kv_stride, int first_row,
                                                 int units, Vec<T, VEC> (&first)[PER_THREAD],
                                                 Vec<T, VEC> (&second)[PER_THREAD]) {
  constexpr int HALF = D / 2, LANES = HALF / VEC, ROTATED = HEADS + KV_HEADS, ROW_UNITS = (HEADS + 2 * KV_HEADS) * LANES;
#pragma unroll
  for (int u = 0; u < PER_THREAD; ++u) {
    const int unit = threadIdx.x + u * THREADS;
    if (unit >= units) break;
    const int row = first_row + unit / ROW_UNITS, head = unit % ROW_UNITS / LANES, lane = unit % LANES;
    const T* src = head < HEADS     ? q + (long long)row * q_stride + head * D
                   : head < ROTATED ? k + (long long)row * kv_stride + (head - HEADS) * D
                                    : v + (long long)row * kv_stride + (head - ROTATED) * D;
    first[u] = load_raw<T, VEC>(src + lane * VEC);
    second[u] = load_raw<T, VEC>(src + HALF + lane * VEC);
  }
}

// ROWS rows a block (grid = ceil(rows / ROWS), block = THREADS): enough bytes a block that its
// fixed latencies (the offsets' search, the angles, the barrier) hide behind its loads (one 12 KB
// bf16 row a block ran at 59% of a copy on an H100, 24 KB at 96%). A unit of work is (row, head,
// lane): the VEC elements at lane * VEC of the head's first half and the VEC at the same place of
// its second half, the pair rotate-half mixes. Every unit's two vectors are loaded before the
// angles are computed, so the loads are in flight while the block works out its rows' cos and sin
// (shared memory).
template <typename T, int HEADS, int KV_HEADS, int D, int VEC, int THREADS, int ROWS, bool ROTARY, bool INVERSE>
__device__ __forceinline__ void attention_prep(const T* __restrict__ q, const T* __restrict__ k,
                                               const T* __restrict__ v, T* __restrict__ out,
                                               const int* __restrict__ cu_seqlens,
                                               const float* __restrict__ inv_freq, int q_stride, int kv_stride,
                                               int batch, int rows) {
  constexpr int HALF = D / 2, LANES = HALF / VEC, ROTATED = HEADS + KV_HEADS, ALL = HEADS + 2 * KV_HEADS;
  constexpr int ROW_UNITS = ALL * LANES, UNITS = ROWS * ROW_UNITS, PER_THREAD = (UNITS + THREADS - 1) / THREADS;
  static_assert(D % 2 == 0 && HALF % VEC == 0, "a vector stays inside one half of a head");
  __shared__ float cos_rows[ROTARY ? ROWS * HALF : 1], sin_rows[ROTARY ? ROWS * HALF : 1];
  const int first_row = blockIdx.x * ROWS;
  const int units = min(ROWS, rows - first_row) * ROW_UNITS;  // the last block may hold fewer rows
  Vec<T, VEC> first[PER_THREAD], second[PER_THREAD];
  load_head_halves<T, HEADS, KV_HEADS, D, VEC, THREADS, PER_THREAD>(q, k, v, q_stride, kv_stride, first_row, units,
                                                                    first, second);
  if (ROTARY) {
    for (int j = threadIdx.x; j < ROWS * HALF; j += THREADS) {
      const int row = min(first_row + j / HALF, rows - 1), i = j % HALF;
      const float position = (float)(row - sequence_start(cu_seqlens, batch, row));  // exact below 2^24
      float s, c;
      sincosf(__fmul_rn(position, inv_freq[i]), &s, &c);
      cos_rows[j] = c;
      sin_rows[j] = INVERSE ? -s : s;
    }
    __syncthreads();
  }
#pragma unroll
  for (int u = 0; u < PER_THREAD; ++u) {
    const int unit = threadIdx.x + u * THREADS;
    if (unit >= units) break;
    const int in_block = unit / ROW_UNITS, head = unit % ROW_UNITS / LANES, lane = unit % LANES;
    T* dst = out + (long long)(first_row + in_block) * (ALL * D) + head * D + lane * VEC;
    if (!ROTARY || head >= ROTATED) {  // v (or no rotary): moved as loaded
      *reinterpret_cast<Vec<T, VEC>*>(dst) = first[u];
      *reinterpret_cast<Vec<T, VEC>*>(dst + HALF) = second[u];
      continue;
    }
    float a[VEC], b[VEC], ya[VEC], yb[VEC];
    to_floats<T, VEC>(first[u], a);
    to_floats<T, VEC>(second[u], b);
    const float* cos_row = cos_rows + (ROTARY ? in_block * HALF : 0);
    const float* sin_row = sin_rows + (ROTARY ? in_block * HALF : 0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float c = cos_row[lane * VEC + e], s = sin_row[lane * VEC + e];
      ya[e] = a[e] * c - b[e] * s;
      yb[e] = b[e] * c + a[e] * s;
    }
    store<T, VEC>(dst, ya);
    store<T, VEC>(dst + HALF, yb);
  }
}

}  // namespace fg
