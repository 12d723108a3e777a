// fusegen device helpers shared by every kernel: dtype conversion, 16-byte vector access,
// warp and block reductions. Plain CUDA C++; the jinja templates only instantiate what is here.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fg {

// Precision of exp and division: a functor whose math uses them takes the kernel's `Math` as a
// template argument (fg::Gelu<Math>, activations.cuh). A kernel source declares `Math` in each
// dtype's namespace (templates/kernel_source.cu.j2), from the dtype: 16-bit tensors get FastMath,
// the hardware's approximations (__expf, __fdividef: ex2.approx, rcp.approx), a few fp32 ulp, far
// below a 16-bit output's rounding, and cheap enough that the activation stops limiting a
// forward: Bias + GELU at [16384 x 8192] bf16 on an H100 198 -> 180 µs (91 -> 100% of copy),
// SwiGLU at [4096 x 2048] 7.2 -> 5.1 µs (bench/NOTES.md). fp32 tensors get ExactMath, expf and
// IEEE division: their results are held to fp32's own roundoff (a row-scaled GLU's scale grad, a
// sum over 8192 columns, exceeded 4 units of it with the approximations), and at 4 bytes an
// element the math is off the critical path anyway (fp32 Bias + GELU ran at 101% of copy with
// expf).
struct ExactMath {
  static __device__ __forceinline__ float exp(float x) { return expf(x); }
  static __device__ __forceinline__ float div(float a, float b) { return a / b; }
};
struct FastMath {
  static __device__ __forceinline__ float exp(float x) { return __expf(x); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdividef(a, b); }
};

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
// bf16 -> fp32 is exact: the 16 bits become the float's high half. cuda_bf16.h writes it as this mov
// below sm_90 and as cvt.f32.bf16 from sm_90 on; the mov everywhere makes a kernel's PTX the same
// for sm_80 and sm_90 (one NVVM run serves both: nvrtc.ASSEMBLED_FROM), and ptxas turns it into
// fewer instructions on sm_90 (a PRMT for the high element of a pair where cvt took a shift).
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  float f;
  asm("{ mov.b32 %0, {0,%1};}\n" : "=f"(f) : "h"(__bfloat16_as_ushort(v)));
  return f;
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// N elements of T moved as one aligned access (16 bytes when N * sizeof(T) == 16).
template <typename T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

// One aligned access as loaded (no conversion yet: a 16-bit vector takes half the registers).
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_raw(const T* __restrict__ p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void to_floats(const Vec<T, N>& vec, float (&out)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float<T>(vec.v[k]);
}

template <typename T, int N>
__device__ __forceinline__ void load(const T* __restrict__ p, float (&out)[N]) {
  to_floats<T, N>(load_raw<T, N>(p), out);
}

template <typename T, int N>
__device__ __forceinline__ void store(T* __restrict__ p, const float (&in)[N]) {
  Vec<T, N> vec;
#pragma unroll
  for (int k = 0; k < N; ++k) vec.v[k] = from_float<T>(in[k]);
  *reinterpret_cast<Vec<T, N>*>(p) = vec;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over a block of THREADS threads (a multiple of 32); every thread gets the total.
// smem holds THREADS / 32 floats. Fixed reduction order, so the result is deterministic.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* smem) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (WARPS == 1) return v;
  __syncthreads();  // smem may still be read from a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) total += smem[w];
  return total;
}

// Two block sums with one pair of barriers (norm backward needs sum(g) and sum(g * xhat) per row).
// smem holds 2 * THREADS / 32 floats. Same fixed order as block_sum.
template <int THREADS>
__device__ __forceinline__ void block_sum2(float& a, float& b, float* smem) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  a = warp_sum(a);
  b = warp_sum(b);
  if (WARPS == 1) return;
  __syncthreads();  // smem may still be read from a previous call
  if (lane == 0) {
    smem[warp] = a;
    smem[WARPS + warp] = b;
  }
  __syncthreads();
  a = 0.f;
  b = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    a += smem[w];
    b += smem[WARPS + w];
  }
}

// N copies of one value (a per-row operand broadcast over a thread's columns).
template <int N>
__device__ __forceinline__ void fill(float value, float (&t)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) t[k] = value;
}

// Counter-based random draws (Dropout): element `index` of a value under a 64-bit key is a fixed
// hash of the two, so the forward, the backward (which regenerates the mask instead of storing
// it) and the CPU reference (generator/ops/dropout.py: uniform) draw the same numbers.
__device__ __forceinline__ unsigned int mix32(unsigned int h) {  // MurmurHash3's finaliser
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  return h ^ (h >> 16);
}

// Uniform in [0, 1), 24 bits.
__device__ __forceinline__ float uniform(unsigned long long key, long long index) {
  const unsigned long long i = (unsigned long long)index;
  unsigned int h = mix32((unsigned int)i ^ (unsigned int)key);
  h = mix32(h ^ (unsigned int)(i >> 32) ^ (unsigned int)(key >> 32));
  return (float)(h >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

// The draws of N consecutive elements from `first` under the key *seed; all 1 (keep, unscaled)
// when seed is null (the module is in eval mode).
template <int N>
__device__ __forceinline__ void draws(const long long* __restrict__ seed, long long first, float (&t)[N]) {
  if (seed == nullptr) {
#pragma unroll
    for (int k = 0; k < N; ++k) t[k] = 1.f;
    return;
  }
  const unsigned long long key = (unsigned long long)*seed;
#pragma unroll
  for (int k = 0; k < N; ++k) t[k] = uniform(key, first + k);
}

}  // namespace fg
