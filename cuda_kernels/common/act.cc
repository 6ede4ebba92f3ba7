#include "act.h"
#include "vmath_avx512.h"

namespace mxf {

Act parse_act(const Attrs& a) {
  const std::string s = attr_choice(a, "act", "none", {"none", "relu", "sigmoid", "tanh",
                                                       "softrelu", "leaky", "gelu_erf",
                                                       "gelu_tanh"});
  if (s == "relu") return Act::relu;
  if (s == "sigmoid") return Act::sigmoid;
  if (s == "tanh") return Act::tanh;
  if (s == "softrelu") return Act::softrelu;
  if (s == "leaky") return Act::leaky;
  if (s == "gelu_erf") return Act::gelu_erf;
  if (s == "gelu_tanh") return Act::gelu_tanh;
  return Act::none;
}

bool act_needs_preactivation(Act a) {
  return a == Act::gelu_erf || a == Act::gelu_tanh || a == Act::softrelu;
}

namespace {
constexpr float kSqrt1_2 = 0.70710678118654752f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluC = 0.044715f;
}  // namespace

void act_forward(Act a, float slope, float* x, int64_t n) {
  if (cpu_has_avx512() && act_forward_avx512(a, x, n)) return;
  switch (a) {
    case Act::none: return;
    case Act::relu:
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.f ? x[i] : 0.f;
      return;
    case Act::sigmoid:
      for (int64_t i = 0; i < n; ++i) x[i] = fast_sigmoid(x[i]);
      return;
    case Act::tanh:
      for (int64_t i = 0; i < n; ++i) x[i] = fast_tanh(x[i]);
      return;
    case Act::softrelu:  // MXNet: x > 20 ? x : log1p(exp(x))
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 20.f ? x[i] : std::log1p(std::exp(x[i]));
      return;
    case Act::leaky:
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.f ? x[i] : slope * x[i];
      return;
    case Act::gelu_erf:
      for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.f + fast_erf(x[i] * kSqrt1_2));
      return;
    case Act::gelu_tanh:
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.f + fast_tanh(kSqrt2OverPi * (v + kGeluC * v * v * v)));
      }
      return;
  }
}

void act_backward(Act a, float slope, const float* z, const float* y, const float* dy, float* dz,
                  int64_t n) {
  switch (a) {
    case Act::none:
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i];
      return;
    case Act::relu:
      for (int64_t i = 0; i < n; ++i) dz[i] = y[i] > 0.f ? dy[i] : 0.f;
      return;
    case Act::sigmoid:
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * y[i] * (1.f - y[i]);
      return;
    case Act::tanh:
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * (1.f - y[i] * y[i]);
      return;
    case Act::softrelu:
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * fast_sigmoid(z[i]);
      return;
    case Act::leaky:
      for (int64_t i = 0; i < n; ++i) dz[i] = y[i] > 0.f ? dy[i] : slope * dy[i];
      return;
    case Act::gelu_erf:
      for (int64_t i = 0; i < n; ++i) {
        const float v = z[i];
        const float cdf = 0.5f * (1.f + fast_erf(v * kSqrt1_2));
        const float pdf = 0.3989422804014327f * fast_exp(-0.5f * v * v);
        dz[i] = dy[i] * (cdf + v * pdf);
      }
      return;
    case Act::gelu_tanh:
      for (int64_t i = 0; i < n; ++i) {
        const float v = z[i];
        const float u = kSqrt2OverPi * (v + kGeluC * v * v * v);
        const float t = fast_tanh(u);
        const float du = kSqrt2OverPi * (1.f + 3.f * kGeluC * v * v);
        dz[i] = dy[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
      }
      return;
  }
}

}  // namespace mxf
