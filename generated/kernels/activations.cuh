// Elementwise math for fused kernels: one functor per catalog op (its device_struct), fp32 in
// registers. A kernel constructs each op's functor once from the op's constants (device_args, in
// field order; ops without constants have no fields). Unary ops: fwd(x), bwd(x, dy) = dy * f'(x)
// (x is 0 for ops that do not read their input in backward). Ops with an operand t (a bias, an
// extra input): fwd(x, t), bwd(x, t, dy, dx, dt). GLU ops gate the FIRST half:
// fwd(a, b) = act(a) * b, bwd(a, b, dy, da, db). Formulas follow TE's common/util/math.h.
#pragma once

namespace fg {

// Precision of exp and division. A kernel whose tensors are 16-bit defines FG_FAST_MATH 1 before
// its includes (the .cu templates do, from the dtype): exp and division then use the hardware's
// approximations (__expf, __fdividef: ex2.approx, rcp.approx), a few fp32 ulp, far below a 16-bit
// output's rounding, and cheap enough that the activation stops limiting a forward: Bias + GELU
// at [16384 x 8192] bf16 on an H100 198 -> 180 µs (91 -> 100% of copy), SwiGLU at [4096 x 2048]
// 7.2 -> 5.1 µs (bench/NOTES.md). fp32 kernels keep expf and IEEE division: their results are
// held to fp32's own roundoff (a row-scaled GLU's scale grad, a sum over 8192 columns, exceeded 4
// units of it with the approximations), and at 4 bytes an element the math is off the critical
// path anyway (fp32 Bias + GELU ran at 101% of copy with expf).
#ifndef FG_FAST_MATH
#define FG_FAST_MATH 0
#endif
__device__ __forceinline__ float exp_(float x) { return FG_FAST_MATH ? __expf(x) : expf(x); }
__device__ __forceinline__ float div_(float a, float b) { return FG_FAST_MATH ? __fdividef(a, b) : a / b; }

// With FG_FAST_MATH, for x below about -88 the fast division returns 0 (1 + e beyond 2^126)
// where the exact result is under 1e-38.
__device__ __forceinline__ float sigmoid(float x) { return div_(1.f, 1.f + exp_(-x)); }

// GELU, tanh approximation: f(x) = x (1 + tanh u) / 2 with u = sqrt(2/pi) (x + 0.044715 x^3).
// (1 + tanh u) / 2 and 1 - tanh^2 u are formed from e = exp(-2|u|) (tanh|u| = (1 - e) / (1 + e)),
// not from a rounded tanh: near tanh u = -1 (x below about -2) and |tanh u| = 1, 1 + t and 1 - t^2
// cancel and would leave tanhf's rounding error as the whole result.
struct Gelu {
  struct Parts {
    float half_one_plus_tanh;  // (1 + tanh u) / 2
    float sech2;               // 1 - tanh^2 u
  };
  static __device__ __forceinline__ float u(float x) { return x * (0.79788456f + 0.03567741f * x * x); }
  static __device__ __forceinline__ Parts parts(float u) {
    const float e = exp_(-2.f * fabsf(u));
    const float r = div_(1.f, 1.f + e);
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

struct Silu {
  static __device__ __forceinline__ float fwd(float x) { return x * sigmoid(x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid(x);
    return dy * (s + x * s * (1.f - s));
  }
};

struct Srelu {  // squared ReLU
  static __device__ __forceinline__ float fwd(float x) { return x > 0.f ? x * x : 0.f; }
  static __device__ __forceinline__ float bwd(float x, float dy) { return dy * fmaxf(2.f * x, 0.f); }
};

struct Qgelu {  // quick GELU: x * sigmoid(1.702 x)
  static __device__ __forceinline__ float fwd(float x) { return x * sigmoid(1.702f * x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid(1.702f * x);
    return dy * (s + 1.702f * x * s * (1.f - s));
  }
};

struct Sigmoid {  // the gate of GLU
  static __device__ __forceinline__ float fwd(float x) { return sigmoid(x); }
  static __device__ __forceinline__ float bwd(float x, float dy) {
    const float s = sigmoid(x);
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

// Named structs (not aliases) so kernels and forward declarations can spell fg::SwiGLU as a type.
struct SwiGLU : Glu<Silu> {};
struct GeGLU : Glu<Gelu> {};
struct GLU : Glu<Sigmoid> {};
struct QGeGLU : Glu<Qgelu> {};
struct ReGLU : Glu<Relu> {};
struct SReGLU : Glu<Srelu> {};

// SiTU GLU: act(a) = beta1 tanh(a / beta1) sigmoid(a), g(b) = beta2 tanh(b / beta2).
struct SiTUGLU {
  float beta1, beta2;
  __device__ __forceinline__ float fwd(float a, float b) const {
    return beta1 * tanhf(a / beta1) * sigmoid(a) * (beta2 * tanhf(b / beta2));
  }
  __device__ __forceinline__ void bwd(float a, float b, float dy, float& da, float& db) const {
    const float t = tanhf(a / beta1), s = sigmoid(a), u = tanhf(b / beta2);
    da = dy * beta2 * u * ((1.f - t * t) * s + beta1 * t * s * (1.f - s));
    db = dy * beta1 * t * s * (1.f - u * u);
  }
};

// GPT-OSS SwiGLU: the gate is clamped from above, the linear half on both sides and offset;
// each clamp passes no gradient where it is active (TE: zero where a > limit, |b| > limit).
struct ClampedSwiGLU {
  float limit, alpha, offset;
  __device__ __forceinline__ float fwd(float a, float b) const {
    const float g = fminf(a, limit);
    return g * sigmoid(alpha * g) * (fminf(fmaxf(b, -limit), limit) + offset);
  }
  __device__ __forceinline__ void bwd(float a, float b, float dy, float& da, float& db) const {
    const float g = fminf(a, limit), s = sigmoid(alpha * g);
    const float linear = fminf(fmaxf(b, -limit), limit) + offset;
    da = a > limit ? 0.f : dy * linear * (s + alpha * g * s * (1.f - s));
    db = fabsf(b) > limit ? 0.f : dy * g * s;
  }
};

}  // namespace fg
