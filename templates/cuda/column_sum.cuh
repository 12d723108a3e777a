// Finalizes a deterministic column reduction: out[c] = the sum over splits s of partials[s][c].
// The fp32 partials come from norm and elementwise backward kernels, one row per block of theirs:
// as many rows as their grid's wave holds (up to a few thousand at narrow widths).
//
// A block takes COLS consecutive columns with LANES threads each: lane l sums splits l, l + LANES,
// ... (a warp reads COLS consecutive floats of one split), then lane 0 adds the LANES lane sums in
// lane order. The order is fixed, so the result is the same run to run; both levels are
// compensated (Kahan), so thousands of fp32 partials lose no more than a rounding or two.
#pragma once
#include "common.cuh"

namespace fg {

constexpr int COLUMN_SUM_COLS = 32;   // blockDim.x: columns per block
constexpr int COLUMN_SUM_LANES = 32;  // blockDim.y: threads summing one column

struct Compensated {
  float total = 0.f, carry = 0.f;
  __device__ __forceinline__ void add(float v) {
    const float y = v - carry;
    const float t = total + y;
    carry = (t - total) - y;
    total = t;
  }
};

template <typename T, int N>
__device__ __forceinline__ void column_sum(const float* __restrict__ partials, T* __restrict__ out, int splits) {
  __shared__ float lane_sums[COLUMN_SUM_LANES][COLUMN_SUM_COLS + 1];  // +1: no bank conflicts
  const int c = blockIdx.x * COLUMN_SUM_COLS + threadIdx.x;
  Compensated lane;
  if (c < N) {
    for (int s = threadIdx.y; s < splits; s += COLUMN_SUM_LANES) lane.add(partials[(long long)s * N + c]);
  }
  lane_sums[threadIdx.y][threadIdx.x] = lane.total;
  __syncthreads();
  if (threadIdx.y != 0 || c >= N) return;
  Compensated column;
#pragma unroll
  for (int l = 0; l < COLUMN_SUM_LANES; ++l) column.add(lane_sums[l][threadIdx.x]);
  out[c] = from_float<T>(column.total);
}

}  // namespace fg
