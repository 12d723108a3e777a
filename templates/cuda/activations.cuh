// Activation math for fused elementwise kernels: one struct per catalog op (its device_struct),
// fp32 in registers. Unary ops: fwd(x), bwd(x, dy) = dy * f'(x). GLU ops gate the FIRST half:
// fwd(a, b) = act(a) * b, bwd(a, b, dy, da, db). Formulas follow TE's common/util/math.h.
#pragma once

namespace fg {

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

struct Gelu {  // tanh approximation
  static __device__ __forceinline__ float fwd(float x) {
    return x * (0.5f + 0.5f * tanhf(x * (0.79788456f + 0.03567741f * x * x)));
  }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float t = tanhf(0.79788456f * x * (1.f + 0.044715f * x * x));
    return dy * (0.5f * x * (1.f - t * t) * (0.79788456f + 0.1070322243f * x * x) + 0.5f * (1.f + t));
  }
};

struct Relu {
  static __device__ __forceinline__ float fwd(float x) { return fmaxf(x, 0.f); }
  static __device__ __forceinline__ float bwd(float x, float dy) { return x > 0.f ? dy : 0.f; }
};

struct Silu {
  static __device__ __forceinline__ float fwd(float x) { return x * sigmoid(x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid(x);
    return dy * (s + x * s * (1.f - s));
  }
};

// act(a) * b with the activation's own derivative; a is the gate (first half of the row).
template <typename Act>
struct Glu {
  static __device__ __forceinline__ float fwd(float a, float b) { return Act::fwd(a) * b; }
  static __device__ __forceinline__ void bwd(float a, float b, float dy, float& da, float& db) {
    db = dy * Act::fwd(a);     // dy * act(a)
    da = Act::bwd(a, dy * b);  // dy * b * act'(a)
  }
};

// Named structs (not aliases) so kernels and forward declarations can spell fg::SwiGLU as a type.
struct SwiGLU : Glu<Silu> {};
struct GeGLU : Glu<Gelu> {};

}  // namespace fg
