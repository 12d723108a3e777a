// Elementwise math for fused kernels: one functor per catalog op (its device_struct), fp32 in
// registers. A kernel constructs each op's functor once from the op's constants (device_args, in
// field order; ops without constants have no fields). Unary ops: fwd(x), bwd(x, dy) = dy * f'(x)
// (x is 0 for ops that do not read their input in backward). Ops with an operand t (a bias, an
// extra input): fwd(x, t), bwd(x, t, dy, dx, dt). GLU ops gate the FIRST half:
// fwd(a, b) = act(a) * b, bwd(a, b, dy, da, db). Formulas follow TE's common/util/math.h.
#pragma once

namespace fg {

// With FastMath, for x below about -88 the fast division returns 0 (1 + e beyond 2^126) where
// the exact result is under 1e-38.
template <typename Math>
__device__ __forceinline__ float sigmoid(float x) { return Math::div(1.f, 1.f + Math::exp(-x)); }

// GELU, tanh approximation: f(x) = x (1 + tanh u) / 2 with u = sqrt(2/pi) (x + 0.044715 x^3).
// (1 + tanh u) / 2 and 1 - tanh^2 u are formed from e = exp(-2|u|) (tanh|u| = (1 - e) / (1 + e)),
// not from a rounded tanh: near tanh u = -1 (x below about -2) and |tanh u| = 1, 1 + t and 1 - t^2
// cancel and would leave tanhf's rounding error as the whole result.
template <typename Math>
struct Gelu {
  struct Parts {
    float half_one_plus_tanh;  // (1 + tanh u) / 2
    float sech2;               // 1 - tanh^2 u
  };
  static __device__ __forceinline__ float u(float x) { return x * (0.79788456f + 0.03567741f * x * x); }
  static __device__ __forceinline__ Parts parts(float u) {
    const float e = Math::exp(-2.f * fabsf(u));
    const float r = Math::div(1.f, 1.f + e);
    return {u >= 0.f ? r : e * r, 4.f * e * r * r};
  }
  static __device__ __forceinline__ float fwd(float x) { return x * parts(u(x)).half_one_plus_tanh; }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const Parts p = parts(u(x));
    return dy * (0.5f * x * p.sech2 * (0.79788456f + 0.1070322243f * x * x) + p.half_one_plus_tanh);
  }
};

struct Add {  // Bias, AddExtraInput: y = x + t
  static __device__ __forceinline__ float fwd(float x, float t) { return x + t; }
  static __device__ __forceinline__ void bwd(float, float, float dy, float& dx, float& dt) {
    dx = dy;
    dt = dy;
  }
};

struct RowScale {  // the row-scaled activations' scale: y = x * t, t = s[row]; dt summed over the row
  static __device__ __forceinline__ float fwd(float x, float t) { return x * t; }
  static __device__ __forceinline__ void bwd(float x, float t, float dy, float& dx, float& dt) {
    dx = dy * t;
    dt = dy * x;
  }
};

struct Dropout {  // y = x * keep / (1 - p); t: the element's draw in [0, 1), or 1 in eval mode (y = x)
  float p, scale;
  __device__ __forceinline__ float fwd(float x, float t) const {
    return t >= 1.f ? x : (t >= p ? x * scale : 0.f);
  }
  __device__ __forceinline__ void bwd(float, float t, float dy, float& dx, float& dt) const {
    dx = fwd(dy, t);  // the same mask and scale
    dt = 0.f;
  }
};

struct Scale {  // ConstantScale: y = scale * x
  float scale;
  __device__ __forceinline__ float fwd(float x) const { return x * scale; }
  __device__ __forceinline__ float bwd(float, float dy) const { return dy * scale; }
};

struct Relu {
  static __device__ __forceinline__ float fwd(float x) { return fmaxf(x, 0.f); }
  static __device__ __forceinline__ float bwd(float x, float dy) { return x > 0.f ? dy : 0.f; }
};

template <typename Math>
struct Silu {
  static __device__ __forceinline__ float fwd(float x) { return x * sigmoid<Math>(x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid<Math>(x);
    return dy * (s + x * s * (1.f - s));
  }
};

struct Srelu {  // squared ReLU
  static __device__ __forceinline__ float fwd(float x) { return x > 0.f ? x * x : 0.f; }
  static __device__ __forceinline__ float bwd(float x, float dy) { return dy * fmaxf(2.f * x, 0.f); }
};

template <typename Math>
struct Qgelu {  // quick GELU: x * sigmoid(1.702 x)
  static __device__ __forceinline__ float fwd(float x) { return x * sigmoid<Math>(1.702f * x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid<Math>(1.702f * x);
    return dy * (s + 1.702f * x * s * (1.f - s));
  }
};

template <typename Math>
struct Sigmoid {  // the gate of GLU
  static __device__ __forceinline__ float fwd(float x) { return sigmoid<Math>(x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid<Math>(x);
    return dy * s * (1.f - s);
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

// Named structs (not aliases), so kernels and forward declarations spell fg::SwiGLU<Math> as a type.
template <typename Math> struct SwiGLU : Glu<Silu<Math>> {};
template <typename Math> struct GeGLU : Glu<Gelu<Math>> {};
template <typename Math> struct GLU : Glu<Sigmoid<Math>> {};
template <typename Math> struct QGeGLU : Glu<Qgelu<Math>> {};
struct ReGLU : Glu<Relu> {};
struct SReGLU : Glu<Srelu> {};

// SiTU GLU: act(a) = beta1 tanh(a / beta1) sigmoid(a), g(b) = beta2 tanh(b / beta2).
template <typename Math>
struct SiTUGLU {
  float beta1, beta2;
  __device__ __forceinline__ float fwd(float a, float b) const {
    return beta1 * tanhf(a / beta1) * sigmoid<Math>(a) * (beta2 * tanhf(b / beta2));
  }
  __device__ __forceinline__ void bwd(float a, float b, float dy, float& da, float& db) const {
    const float t = tanhf(a / beta1), s = sigmoid<Math>(a), u = tanhf(b / beta2);
    da = dy * beta2 * u * ((1.f - t * t) * s + beta1 * t * s * (1.f - s));
    db = dy * beta1 * t * s * (1.f - u * u);
  }
};

// GPT-OSS SwiGLU: the gate is clamped from above, the linear half on both sides and offset;
// each clamp passes no gradient where it is active (TE: zero where a > limit, |b| > limit).
template <typename Math>
struct ClampedSwiGLU {
  float limit, alpha, offset;
  __device__ __forceinline__ float fwd(float a, float b) const {
    const float g = fminf(a, limit);
    return g * sigmoid<Math>(alpha * g) * (fminf(fmaxf(b, -limit), limit) + offset);
  }
  __device__ __forceinline__ void bwd(float a, float b, float dy, float& da, float& db) const {
    const float g = fminf(a, limit), s = sigmoid<Math>(alpha * g);
    const float linear = fminf(fmaxf(b, -limit), limit) + offset;
    da = a > limit ? 0.f : dy * linear * (s + alpha * g * s * (1.f - s));
    db = fabsf(b) > limit ? 0.f : dy * g * s;
  }
};

}  // namespace fg
