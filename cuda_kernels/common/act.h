// Activation functions shared by fused_dense and fused_elemwise, with their derivatives
// expressed as MXNet's backward passes express them (through the input z and/or the
// output y), so NaN, inf and the sign of zero come out as MXNet gives them.
#pragma once
#include <cmath>
#include <cstring>
#include <string>

#include "mxf_common.h"

namespace mxf {

// `relu` is MXNet's relu operator (NaN stays NaN); `act_relu` is Activation(act_type=relu),
// which MXNet 1.9 runs through oneDNN at ranks 1-5 (NaN gives 0 there) and through its own
// relu elsewhere: resolve_act() picks the form for a rank.  LeakyReLU's leaky and gelu
// differ between the two paths too (the backward on NaN and for slopes <= 0; the sign of
// a zero result).  The *_dnnl kinds are resolve_act()'s oneDNN forms, never parsed.
enum class Act {
  none, relu, act_relu, relu_dnnl, sigmoid, tanh, softrelu, leaky, leaky_dnnl,
  gelu_erf, gelu_erf_dnnl, gelu_tanh
};

Act parse_act(const Attrs& a);
// The kind MXNet computes for `a` on a value of rank `rank` (see Act), given whether its
// oneDNN kernels are on (MXNET_MKLDNN_ENABLED, see dnnl_enabled()).
Act resolve_act(Act a, int rank, bool dnnl);
bool dnnl_enabled();

// exp to ~1 ulp over the whole float range: Cody-Waite reduction, Cephes polynomial, and
// 2^n applied as two factors so that results below 2^-126 come out subnormal, correctly
// scaled, as glibc's expf gives them (MXNet's exp); x > ln(FLT_MAX) gives inf, x < -104
// gives 0, NaN stays NaN.  Vectorizable.
static inline float exp_full(float x) {
  const float hi = 88.72283935546875f, lo = -104.0f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  const float fx = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // fx in [-150, 128]: 2^fx = 2^e1 * 2^e2 with both factors normal; p * 2^e1 is exact,
  // the second product rounds once (into the subnormal range where the result lies there)
  const int32_t e = static_cast<int32_t>(fx);
  const int32_t e1 = e >> 1, e2 = e - e1;
  union { int32_t i; float f; } u1, u2;
  u1.i = (e1 + 127) << 23;
  u2.i = (e2 + 127) << 23;
  const float res = (p * u1.f) * u2.f;
  // NaN flows through the arithmetic (r is NaN), so it needs no select of its own
  return x < lo ? 0.0f : (x > hi ? INFINITY : res);
}

// erf to ~2 ulp of glibc's erff (MXNet's erf), in two pieces fitted for this project
// (minimax, Lawson's algorithm):
//   |x| < 0.921875:        x * P(x^2), P of degree 5 (relative error 1.6e-8)
//   0.921875 <= |x|:       1 - exp(R(|x|)), R of degree 8 fitted to log(erfc) on
//                          [0.921875, 3.9375] (|x| capped there: erf rounds to 1 beyond)
// Both pieces are computed and one selected, so loops over it vectorize.  erf(±0) = ±0,
// erf(±inf) = ±1, NaN stays NaN.
constexpr float kErfSplit = 0.921875f, kErfCap = 3.9375f;
constexpr float kErfSmallP[6] = {1.128379149568253f, -0.3761249376801155f, 0.11281817014300421f,
                                 -0.02676664671342867f, 0.004993224554763864f,
                                 -0.0005991077494228864f};
constexpr float kErfLargeR[9] = {0.00016401497762364255f, -1.1294535855018848f, -0.6334984359768694f,
                                 -0.10807023406987754f, 0.024941344804103205f,
                                 -0.004076311325615201f, 0.0004036138415120516f,
                                 -1.5479149831243433e-05f, -4.374793368677743e-07f};

static inline float fast_erf(float x) {
  const float ax = std::fabs(x);
  const float s = x * x;
  float p = kErfSmallP[5];
  for (int k = 4; k >= 0; --k) p = p * s + kErfSmallP[k];
  const float a = ax > kErfCap ? kErfCap : ax;  // NaN stays NaN
  float r = kErfLargeR[8];
  for (int k = 7; k >= 0; --k) r = r * a + kErfLargeR[k];
  const float big = 1.0f - exp_full(r);
  return ax < kErfSplit ? x * p : std::copysign(big, x);
}

// tanh to ~2 ulp of glibc's tanhf (MXNet's tanh), as Cephes' tanhf:
//   |x| < 0.625:   x + x s P(s), s = x^2 (Cephes' minimax P of degree 4)
//   |x| >= 0.625:  1 - 2 / (exp(2|x|) + 1), sign of x  (|x| capped at 10: tanh rounds to 1
//                  from 9.01 on, while tanh(9) is 1 - 2^-24; so ±inf gives exactly ±1)
// Both are computed and one selected (vectorizable).  tanh(±0) = ±0, ±inf gives ±1.
constexpr float kTanhSplit = 0.625f, kTanhClip = 10.0f;
constexpr float kTanhP[5] = {-3.33332819422E-1f, 1.33314422036E-1f, -5.37397155531E-2f,
                             2.06390887954E-2f, -5.70498872745E-3f};

static inline float fast_tanh(float x) {
  const float s = x * x;
  float p = kTanhP[4];
  for (int k = 3; k >= 0; --k) p = p * s + kTanhP[k];
  const float small = std::copysign(p * s * x + x, x);  // the sum loses the sign of -0
  const float ax = std::fabs(x);
  const float a = ax > kTanhClip ? kTanhClip : ax;  // NaN stays NaN
  const float big = 1.0f - 2.0f / (exp_full(a + a) + 1.0f);
  return ax < kTanhSplit ? small : std::copysign(big, x);
}

// MXNet's sigmoid: 1 / (1 + exp(-x)); 0 once exp(-x) overflows (x < -88.72), subnormal
// results just above
static inline float fast_sigmoid(float x) { return 1.f / (1.f + exp_full(-x)); }

// MXNet's gelu (mshadow_op::gelu) and its gradient, in float as there:
//   gelu(a)      = 0.5 a (1 + erf(a / sqrt 2))
//   gelu_grad(a) = 0.5 (1 + erf(a / sqrt 2) + a erf'(a / sqrt 2) / sqrt 2),
//   erf'(u)      = float(2.0 / sqrtf(float(pi)) * expf(-u u)), the product in double as there
constexpr float kSqrt2 = 1.41421356237309504880f;
static inline float gelu_erf(float a) { return 0.5f * a * (1.f + fast_erf(a / kSqrt2)); }
static inline float erf_grad(float u) {
  return static_cast<float>(1.1283791331978021 * static_cast<double>(exp_full(-(u * u))));
}
static inline float gelu_erf_grad(float a) {
  const float u = a / kSqrt2;
  return 0.5f * (1.f + fast_erf(u) + a * erf_grad(u) / kSqrt2);
}

// Apply activation (a resolved kind, see resolve_act) in place over n values.
void act_forward(Act a, float slope, float* x, int64_t n);
// dz = dy * act'(z) as MXNet's backward computes it, where z is the pre-activation and
// y = act(z).  z may be null for activations whose derivative MXNet takes from y alone.
void act_backward(Act a, float slope, const float* z, const float* y, const float* dy, float* dz,
                  int64_t n);
// Whether act_backward needs z for (resolved) `a` with this slope.
bool act_needs_preactivation(Act a, float slope);

}  // namespace mxf
