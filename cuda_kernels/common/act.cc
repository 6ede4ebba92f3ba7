#include "act.h"

#include <cctype>
#include <cstdlib>

#include "vmath_avx512.h"

namespace mxf {

Act parse_act(const Attrs& a) {
  const std::string s = attr_choice(a, "act", "none", {"none", "relu", "act_relu", "sigmoid",
                                                       "tanh", "softrelu", "leaky", "gelu_erf",
                                                       "gelu_tanh"});
  if (s == "relu") return Act::relu;
  if (s == "act_relu") return Act::act_relu;
  if (s == "sigmoid") return Act::sigmoid;
  if (s == "tanh") return Act::tanh;
  if (s == "softrelu") return Act::softrelu;
  if (s == "leaky") return Act::leaky;
  if (s == "gelu_erf") return Act::gelu_erf;
  if (s == "gelu_tanh") return Act::gelu_tanh;
  return Act::none;
}

bool dnnl_enabled() {
  // MXNet reads dmlc::GetEnv("MXNET_MKLDNN_ENABLED", true) (a bool: "0" / "false" turn it off)
  static const bool on = [] {
    const char* e = std::getenv("MXNET_MKLDNN_ENABLED");
    if (!e || !*e) return true;
    std::string v(e);
    for (auto& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return !(v == "0" || v == "false");
  }();
  return on;
}

Act resolve_act(Act a, int rank, bool dnnl) {
  // MXNet's SupportMKLDNNAct / SupportMKLDNNLeakyRelu: float32 input of rank 1 to 5
  const bool via_dnnl = dnnl && rank >= 1 && rank <= 5;
  switch (a) {
    case Act::act_relu: return via_dnnl ? Act::relu_dnnl : Act::relu;
    case Act::leaky: return via_dnnl ? Act::leaky_dnnl : Act::leaky;
    case Act::gelu_erf: return via_dnnl ? Act::gelu_erf_dnnl : Act::gelu_erf;
    default: return a;
  }
}

bool act_needs_preactivation(Act a, float slope) {
  // oneDNN's leaky backward tests the input (z <= 0); the output tells the same only
  // for a positive slope
  return a == Act::gelu_erf || a == Act::gelu_erf_dnnl || a == Act::gelu_tanh ||
         (a == Act::leaky_dnnl && !(slope > 0.f));
}

namespace {
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluC = 0.044715f;
}  // namespace

void act_forward(Act a, float slope, float* x, int64_t n) {
  if (cpu_has_avx512() && act_forward_avx512(a, x, n)) return;
  switch (a) {
    case Act::none: return;
    case Act::relu:  // MXNet's relu: NaN stays NaN, -0 gives +0
    case Act::act_relu:
      for (int64_t i = 0; i < n; ++i) x[i] = !(x[i] <= 0.f) ? x[i] : 0.f;
      return;
    case Act::relu_dnnl:  // oneDNN's relu: max(x, 0), NaN gives 0
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
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.f ? x[i] : x[i] * slope;
      return;
    case Act::leaky_dnnl:  // oneDNN computes slope 0 as max(x, 0): NaN, -inf, -0 give +0
      for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.f ? x[i] : (slope == 0.f ? 0.f : x[i] * slope);
      return;
    case Act::gelu_erf:
      for (int64_t i = 0; i < n; ++i) x[i] = gelu_erf(x[i]);
      return;
    case Act::gelu_erf_dnnl:  // oneDNN gives +0 where the result is zero
      for (int64_t i = 0; i < n; ++i) x[i] = gelu_erf(x[i]) + 0.f;
      return;
    case Act::gelu_tanh:  // the written-out ops: 0.5 x (1 + tanh(k (x + c x^3)))
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.f + fast_tanh((v + v * v * v * kGeluC) * kSqrt2OverPi));
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
    case Act::relu:  // MXNet: dy * relu_grad(y), relu_grad keeps NaN
    case Act::act_relu:
      for (int64_t i = 0; i < n; ++i)
        dz[i] = dy[i] * (y[i] != y[i] ? y[i] : (y[i] > 0.f ? 1.f : 0.f));
      return;
    case Act::relu_dnnl:  // oneDNN: dy * (x > 0); y > 0 exactly where x > 0
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * (y[i] > 0.f ? 1.f : 0.f);
      return;
    case Act::sigmoid:  // dy * (y (1 - y))
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * (y[i] * (1.f - y[i]));
      return;
    case Act::tanh:  // dy * (1 - y^2)
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * (1.f - y[i] * y[i]);
      return;
    case Act::softrelu:  // dy * -expm1(-y)
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * -std::expm1(-y[i]);
      return;
    case Act::leaky:  // MXNet: dy * (y > 0 ? 1 : slope), from the output
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * (y[i] > 0.f ? 1.f : slope);
      return;
    case Act::leaky_dnnl:  // oneDNN: x <= 0 ? dy * slope : dy (NaN takes dy)
      if (z) for (int64_t i = 0; i < n; ++i) dz[i] = z[i] <= 0.f ? dy[i] * slope : dy[i];
      else for (int64_t i = 0; i < n; ++i) dz[i] = y[i] <= 0.f ? dy[i] * slope : dy[i];
      return;
    case Act::gelu_erf:
    case Act::gelu_erf_dnnl:
      for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * gelu_erf_grad(z[i]);
      return;
    case Act::gelu_tanh:  // reverse mode over the written-out ops
      for (int64_t i = 0; i < n; ++i) {
        const float v = z[i];
        const float u = (v + v * v * v * kGeluC) * kSqrt2OverPi;
        const float t = fast_tanh(u);
        const float du = kSqrt2OverPi * (1.f + 3.f * kGeluC * v * v);
        dz[i] = dy[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
      }
      return;
  }
}

}  // namespace mxf
