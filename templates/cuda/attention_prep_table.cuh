// The attention prep kernels' table variant (templates/attention_prep/, specs in
// stages/attention/kernels.py): rotary by TE's per-call table, forward(rotary_pos_emb=...), instead
// of angles from a base. The layout, the units of work and the loads are attention_prep.cuh's.
//
// The table is float32 [table_rows, D] angles: a head [a | b] (halves of D / 2) at position p (row
// - the start of its packed sequence) becomes [a_i cos t_i - b_i sin t_i | b_i cos t_{i+D/2} + a_i
// sin t_{i+D/2}], t = table[p] (TE's apply_rotary_pos_emb, non-interleaved). TE's own tables repeat
// the first half's angles in the second (cat(freqs, freqs)), a user's need not: each half reads its
// own, so any table is exact. INVERSE is the transpose (the backward): [a_i cos t_i + b_i sin
// t_{i+D/2} | b_i cos t_{i+D/2} - a_i sin t_i]. The position is clamped below table_rows, so a
// table too short for the call never reads out of bounds (the module's host check raises first).
// Math in fp32, sincosf the accurate one, each output rounded once to T.
#pragma once
#include "attention_prep.cuh"

namespace fg {

template <typename T, int HEADS, int KV_HEADS, int D, int VEC, int THREADS, int ROWS, bool INVERSE>
__device__ __forceinline__ void attention_prep_table(const T* __restrict__ q, const T* __restrict__ k,
                                                     const T* __restrict__ v, T* __restrict__ out,
                                                     const int* __restrict__ cu_seqlens,
                                                     const float* __restrict__ table, int table_rows, int q_stride,
                                                     int kv_stride, int batch, int rows) {
  constexpr int HALF = D / 2, LANES = HALF / VEC, ROTATED = HEADS + KV_HEADS, ALL = HEADS + 2 * KV_HEADS;
  constexpr int ROW_UNITS = ALL * LANES, UNITS = ROWS * ROW_UNITS, PER_THREAD = (UNITS + THREADS - 1) / THREADS;
  static_assert(D % 2 == 0 && HALF % VEC == 0, "a vector stays inside one half of a head");
  __shared__ float cos_rows[ROWS * D], sin_rows[ROWS * D];  // both halves' angles: a table's may differ
  const int first_row = blockIdx.x * ROWS;
  const int units = min(ROWS, rows - first_row) * ROW_UNITS;  // the last block may hold fewer rows
  Vec<T, VEC> first[PER_THREAD], second[PER_THREAD];  // in flight while the angles are read
  load_head_halves<T, HEADS, KV_HEADS, D, VEC, THREADS, PER_THREAD>(q, k, v, q_stride, kv_stride, first_row, units,
                                                                    first, second);
  for (int j = threadIdx.x; j < ROWS * D; j += THREADS) {
    const int row = min(first_row + j / D, rows - 1), i = j % D;
    const int position = min(row - sequence_start(cu_seqlens, batch, row), table_rows - 1);
    float s, c;
    sincosf(__ldg(table + (long long)position * D + i), &s, &c);
    cos_rows[j] = c;
    sin_rows[j] = s;
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < PER_THREAD; ++u) {
    const int unit = threadIdx.x + u * THREADS;
    if (unit >= units) break;
    const int in_block = unit / ROW_UNITS, head = unit % ROW_UNITS / LANES, lane = unit % LANES;
    T* dst = out + (long long)(first_row + in_block) * (ALL * D) + head * D + lane * VEC;
    if (head >= ROTATED) {  // v: moved as loaded
      *reinterpret_cast<Vec<T, VEC>*>(dst) = first[u];
      *reinterpret_cast<Vec<T, VEC>*>(dst + HALF) = second[u];
      continue;
    }
    float a[VEC], b[VEC], ya[VEC], yb[VEC];
    to_floats<T, VEC>(first[u], a);
    to_floats<T, VEC>(second[u], b);
    const float* cos_row = cos_rows + in_block * D + lane * VEC;
    const float* sin_row = sin_rows + in_block * D + lane * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float c1 = cos_row[e], s1 = sin_row[e], c2 = cos_row[HALF + e], s2 = sin_row[HALF + e];
      ya[e] = INVERSE ? a[e] * c1 + b[e] * s2 : a[e] * c1 - b[e] * s1;
      yb[e] = INVERSE ? b[e] * c2 - a[e] * s1 : b[e] * c2 + a[e] * s2;
    }
    store<T, VEC>(dst, ya);
    store<T, VEC>(dst + HALF, yb);
  }
}

}  // namespace fg
