// Activation functions shared by fused_dense (and usable elsewhere), with their
// derivatives expressed through the input z and/or the output y.
#pragma once
#include <cmath>
#include <string>

#include "mxf_common.h"

namespace mxf {

enum class Act { none, relu, sigmoid, tanh, softrelu, leaky, gelu_erf, gelu_tanh };

Act parse_act(const Attrs& a);

// erf with |error| < 2e-7 (Abramowitz & Stegun 7.1.26), vectorizable.
static inline float fast_erf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float y = 1.061405429f;
  y = y * t - 1.453152027f;
  y = y * t + 1.421413741f;
  y = y * t - 0.284496736f;
  y = y * t + 0.254829592f;
  y = 1.0f - y * t * fast_exp(-ax * ax);
  return std::copysign(y, x);
}

static inline float fast_tanh(float x) {
  // tanh(x) = sign(x) * (1 - 2 / (exp(2|x|) + 1)); exact enough for fp32 tolerances
  const float e = fast_exp(2.f * std::fabs(x));
  return std::copysign(1.f - 2.f / (e + 1.f), x);
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
