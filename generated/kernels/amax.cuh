// A tensor's amax (max |x|) as FP8 scaling reads it, kept by the kernel that writes the tensor
// (issue 40): current scaling's cast then needs no amax pass of its own over the tensor. The
// quantize family's amax pass uses the same bits. Plain CUDA C++; templates only instantiate it.
#pragma once
#include "common.cuh"

namespace fg {

// Maxima of |x| are kept as the bits of fabsf(x), an int: non-negative floats order as their
// bits do, and a NaN's (0x7fc00000 and up) is above +inf's, so a NaN wins the max (fmaxf would
// drop it) and reaches the scale, which is then 1 (current) or kept (delayed), as TE's.
__device__ __forceinline__ int abs_bits(float v) { return __float_as_int(fabsf(v)); }

// The max of |v| over VEC values as a T tensor stores them (rounded to T, as fg::store does), into
// the thread's running max ``m``: the amax of the stored tensor, bit for bit what an amax pass
// over it finds.
template <typename T, int VEC>
__device__ __forceinline__ void max_stored(const float (&v)[VEC], int& m) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) m = max(m, abs_bits(to_float<T>(from_float<T>(v[k]))));
}

// The active threads' running maxima into *amax (atomic max on the bits; the caller zeroed it).
// One atomic a warp at most, none where *amax already holds as much: a plain read, which may be
// stale but never above the true value (the value only grows), so a skipped atomic is never
// needed. Threads that returned early are not in __activemask and take no part.
__device__ __forceinline__ void warp_amax_to(float* amax, int m) {
  const unsigned mask = __activemask();
  const int best = __reduce_max_sync(mask, m);
  unsigned lane;  // (the hardware's: a 2-D block's warps span rows of threadIdx.x)
  asm("mov.u32 %0, %%laneid;" : "=r"(lane));
  if (lane == static_cast<unsigned>(__ffs(mask) - 1) && best > *reinterpret_cast<const int*>(amax)) {
    atomicMax(reinterpret_cast<int*>(amax), best);
  }
}

}  // namespace fg
