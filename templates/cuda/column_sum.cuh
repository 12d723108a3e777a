// Finalizes a deterministic column reduction: out[c] = sum over splits s = 0, 1, ... (in order)
// of partials[s][c]. The fp32 partials come from norm and elementwise backward kernels.
#pragma once
#include "common.cuh"

namespace fg {

template <typename T, int N>
__device__ __forceinline__ void column_sum(const float* __restrict__ partials, T* __restrict__ out, int splits) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= N) return;
  // Compensated (Kahan) summation: hundreds of fp32 partials lose no more than a rounding or two.
  float total = 0.f, carry = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float y = partials[(long long)s * N + c] - carry;
    const float t = total + y;
    carry = (t - total) - y;
    total = t;
  }
  out[c] = from_float<T>(total);
}

}  // namespace fg
