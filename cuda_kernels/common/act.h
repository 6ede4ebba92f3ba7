// Activation functions shared by fused_dense (and usable elsewhere), with their
// derivatives expressed through the input z and/or the output y.
#pragma once
#include <cmath>
#include <string>

#include "mxf_common.h"

namespace mxf {

enum class Act { none, relu, sigmoid, tanh, softrelu, leaky, gelu_erf, gelu_tanh };

Act parse_act(const Attrs& a);

// erf: for |x| >= 0.5 Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7; evaluated in
// float, < 7e-7 relative there); below, the Maclaurin series to x^13 (relative error
// < 1e-8), which keeps erf(x) ~ 2x/sqrt(pi) accurate for tiny x where 1 - (...) would
// cancel.  Both are computed and one selected, so loops over it vectorize.
constexpr float kErfSmall = 0.5f;
constexpr float kErfTaylor[7] = {1.1283791670955126f, -0.37612638903183754f, 0.11283791670955126f, -0.026866170645131252f, 0.0052239776254421879f, -0.00085483270234508522f, 0.00012055332981789664f};

static inline float fast_erf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float y = 1.061405429f;
  y = y * t - 1.453152027f;
  y = y * t + 1.421413741f;
  y = y * t - 0.284496736f;
  y = y * t + 0.254829592f;
  y = 1.0f - y * t * fast_exp(-ax * ax);
  const float s = x * x;
  float p = kErfTaylor[6];
  for (int k = 5; k >= 0; --k) p = p * s + kErfTaylor[k];
  return ax < kErfSmall ? x * p : std::copysign(y, x);
}

// tanh(x) = x * P(x^2) / Q(x^2) on [-9, 9] (|tanh| rounds to 1 beyond): a rational
// fit of tanh(x)/x in s = x^2 (degrees 5/3, weighted for relative error, fitted for
// this project).  Max error 3.8e-7 relative over all floats, including near 0 where
// the form 1 - 2/(exp(2x)+1) loses all relative precision.  Vectorizable: one division.
constexpr float kTanhP[6] = {0.99999994039535522f, 0.12919211387634277f, 0.0029207428451627493f,
                             9.2672571554430760e-06f, -1.2779986846567226e-08f,
                             1.8254203704159977e-11f};
constexpr float kTanhQ[4] = {1.0f, 0.462524950504303f, 0.02376309037208557f,
                             0.0002280976332258433f};
constexpr float kTanhClip = 9.0f;

static inline float fast_tanh(float x) {
  const float xc = x > kTanhClip ? kTanhClip : (x < -kTanhClip ? -kTanhClip : x);  // NaN stays
  const float s = xc * xc;
  float p = kTanhP[5];
  p = p * s + kTanhP[4];
  p = p * s + kTanhP[3];
  p = p * s + kTanhP[2];
  p = p * s + kTanhP[1];
  p = p * s + kTanhP[0];
  float q = kTanhQ[3];
  q = q * s + kTanhQ[2];
  q = q * s + kTanhQ[1];
  q = q * s + kTanhQ[0];
  const float t = xc * p / q;
  return t > 1.f ? 1.f : (t < -1.f ? -1.f : t);  // the fit crosses 1 by an ulp near the clip
}

static inline float fast_sigmoid(float x) { return 1.f / (1.f + fast_exp(-x)); }

// Apply activation in place over n values.
void act_forward(Act a, float slope, float* x, int64_t n);
// dz = dy * act'(z) where z is the pre-activation and y = act(z).  z may be null
// for activations whose derivative is a function of y alone.
void act_backward(Act a, float slope, const float* z, const float* y, const float* dy, float* dz,
                  int64_t n);
bool act_needs_preactivation(Act a);

}  // namespace mxf
