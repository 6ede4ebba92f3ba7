// fused_se: squeeze-excitation in two passes over the feature map.
//
//   a    = in_act(x)                                   (none | hard_swish)
//   p    = mean over H, W of a                         (N, C)
//   h    = act(W1 · p + b1)                            (N, Cm)
//   g    = gate(W2 · h + b2)                           (N, C)
//   y    = out_act(a · g [+ residual])                 (N, C, H, W)
//
// Pass 1 pools each (n, c) plane; the two small matrix-vector products run on the
// pooled vector; pass 2 scales each plane (adding the residual and activating on the way).
// The hidden and gate activations are computed as MXNet computes them (act.h); the
// pooling sums a plane in float with partial sums, which may differ from MXNet's
// sequential sum in the last bits.  See README.md for the attribute contract.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "act.h"
#include "mxf_common.h"

using namespace mxf;

namespace {

enum class Gate { sigmoid, hard_sigmoid, clip };
enum class InAct { none, hard_swish };

struct SEParams {
  Act act;
  float slope;
  Gate gate;
  float alpha, beta;                         // hard_sigmoid: max(0, min(1, alpha x + beta))
  ClipGate clip;                             // clip: clip(x + add, min, max) / div
  InAct in_act;
  Act out_act;
  bool bias1, bias2, residual;
};

SEParams parse(const Attrs& a) {
  SEParams p;
  p.act = parse_act(a);
  p.slope = attr_float(a, "slope", 0.25f);
  const std::string g = attr_choice(a, "gate", "sigmoid", {"sigmoid", "hard_sigmoid", "clip"});
  p.gate = g == "sigmoid" ? Gate::sigmoid : (g == "hard_sigmoid" ? Gate::hard_sigmoid : Gate::clip);
  p.alpha = attr_float(a, "alpha", 0.2f);
  p.beta = attr_float(a, "beta", 0.5f);
  p.clip = parse_clip_gate(a);
  const std::string in = attr_choice(a, "in_act", "none", {"none", "hard_swish"});
  p.in_act = in == "hard_swish" ? InAct::hard_swish : InAct::none;
  const std::string out = attr_choice(a, "out_act", "none", {"none", "relu", "act_relu"});
  p.out_act = out == "relu" ? Act::relu : (out == "act_relu" ? Act::act_relu : Act::none);
  p.bias1 = !attr_bool(a, "no_bias1", false);
  p.bias2 = !attr_bool(a, "no_bias2", false);
  p.residual = attr_bool(a, "residual", false);
  return p;
}

int num_inputs(const SEParams& p) { return 3 + p.bias1 + p.bias2 + p.residual; }

// input slots: x, w1, [b1], w2, [b2], [residual]
struct Slots {
  int w1, b1, w2, b2, res;
};
Slots slots(const SEParams& p) {
  Slots s;
  int k = 1;
  s.w1 = k++;
  s.b1 = p.bias1 ? k++ : -1;
  s.w2 = k++;
  s.b2 = p.bias2 ? k++ : -1;
  s.res = p.residual ? k++ : -1;
  return s;
}

// GluonCV's hard-swish as its ops compute it: x * (clip(x + 3, 0, 6) / 6)
static inline float hard_swish(float v) {
  float t = v + 3.f;
  t = t < 0.f ? 0.f : (t > 6.f ? 6.f : t);
  return v * (t / 6.f);
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_se", [&] {
    SEParams p = parse(a);
    *nin = num_inputs(p);
    *nout = 1;
  });
}

int64_t prod_from(const Shape& s, size_t k) {
  int64_t n = 1;
  for (size_t i = k; i < s.size(); ++i) n *= s[i];
  return n;
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_se", [&] {
    SEParams p = parse(a);
    Slots s = slots(p);
    // the layers' weights and biases from x, num_hidden and fc1/fc2 (each a 1x1 Convolution's
    // (O, I, 1, 1) or a FullyConnected's (O, I)), the residual as x
    require_known_input(*in, 0, "x");
    if ((*in)[0].size() == 4 && has_attr(a, "num_hidden")) {
      const unsigned int C = (*in)[0][1], Cm = static_cast<unsigned int>(attr_int(a, "num_hidden", 0));
      auto layer = [&](const char* fc, unsigned int o, unsigned int i) {
        return attr_str(a, fc, "conv") == "dense" ? Shape{o, i} : Shape{o, i, 1, 1};
      };
      fill_input(in, s.w1, layer("fc1", Cm, C), "w1");
      fill_input(in, s.w2, layer("fc2", C, Cm), "w2");
      if (p.bias1) fill_input(in, s.b1, Shape{Cm}, "b1");
      if (p.bias2) fill_input(in, s.b2, Shape{C}, "b2");
      if (p.residual) fill_input(in, s.res, (*in)[0], "residual");
    }
    require_known_shapes(*in);
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, C, H, W), got " + shape_str(x));
    const int64_t C = x[1];
    const Shape &w1 = (*in)[s.w1], &w2 = (*in)[s.w2];
    if (w1.size() < 2 || prod_from(w1, 1) != C)
      throw OpError("w1 must be (Cm, " + std::to_string(C) + "[, 1, 1]), got " + shape_str(w1));
    const int64_t Cm = w1[0];
    if (w2.size() < 2 || static_cast<int64_t>(w2[0]) != C || prod_from(w2, 1) != Cm)
      throw OpError("w2 must be (" + std::to_string(C) + ", " + std::to_string(Cm) +
                    "[, 1, 1]), got " + shape_str(w2));
    if (p.bias1 && !((*in)[s.b1].size() == 1 && static_cast<int64_t>((*in)[s.b1][0]) == Cm))
      throw OpError("b1 must be (" + std::to_string(Cm) + ",), got " + shape_str((*in)[s.b1]));
    if (p.bias2 && !((*in)[s.b2].size() == 1 && static_cast<int64_t>((*in)[s.b2][0]) == C))
      throw OpError("b2 must be (" + std::to_string(C) + ",), got " + shape_str((*in)[s.b2]));
    if (attr_int(a, "num_hidden", Cm) != Cm || attr_int(a, "num_channels", C) != C)
      throw OpError("num_hidden/num_channels (" + std::to_string(attr_int(a, "num_hidden", Cm)) + ", " +
                    std::to_string(attr_int(a, "num_channels", C)) + ") do not match the weights (" +
                    std::to_string(Cm) + ", " + std::to_string(C) + ")");
    if (p.residual && (*in)[s.res] != x)
      throw OpError("residual must have x's shape " + shape_str(x) + ", got " +
                    shape_str((*in)[s.res]));
    (*out)[0] = x;
  });
}

float gate_fn(const SEParams& p, float v) {
  switch (p.gate) {
    case Gate::sigmoid: return fast_sigmoid(v);
    case Gate::hard_sigmoid: {
      const float r = p.alpha * v + p.beta;
      return r > 1.f ? 1.f : (r < 0.f ? 0.f : r);
    }
    case Gate::clip: {
      return p.clip(v);
    }
  }
  return v;
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_se", [&] {
    SEParams p = parse(a);
    Slots s = slots(p);
    const auto& xs = (*in)[0].shape;
    const int64_t N = xs[0], C = xs[1], HW = xs[2] * xs[3];
    const int64_t Cm = (*in)[s.w1].shape[0];
    const float* X = (*in)[0].data<float>();
    const float* W1 = (*in)[s.w1].data<float>();
    const float* W2 = (*in)[s.w2].data<float>();
    const float* B1 = p.bias1 ? (*in)[s.b1].data<float>() : nullptr;
    const float* B2 = p.bias2 ? (*in)[s.b2].data<float>() : nullptr;
    const float* R = p.residual ? (*in)[s.res].data<float>() : nullptr;
    float* Y = (*out)[0].data<float>();
    const bool hs = p.in_act == InAct::hard_swish;
    const Act hidden = resolve_act(p.act, 4, dnnl_enabled());
    const Act tail = resolve_act(p.out_act, 4, dnnl_enabled());

    const int64_t P = N * C;  // planes
    std::vector<float> pooled(P);
    const bool relu_nan_zero = tail == Act::relu_dnnl;
    const bool relu_keep_nan = tail == Act::relu || tail == Act::act_relu;
    // One parallel region with one barrier: each thread pools a range of planes; after the
    // barrier it computes the (small) hidden layer itself, then the gates of its own planes
    // and scales them -- the planes it pooled, still in its cache when they are small.  A
    // team that joined and forked between the passes would have to wake its threads again.
    // Maps under 256 KiB run on one thread (waking a team costs more than they take).  Larger
    // ones are split: on SE-ResNeXt50's maps (0.4-3.2 MB at batch 1) two threads took the
    // whole network from 1.17-1.18x to 1.22-1.26x of MXNet's default bind on the quiet 2-core
    // machine (one thread up to 4 MiB before); on a loaded machine a team's barrier can cost a
    // scheduler time slice.
    const int nt = P * HW < (1 << 16) ? 1 : omp_get_max_threads();
#pragma omp parallel num_threads(nt)
    {
      const int T = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t lo = P * t / T, hi = P * (t + 1) / T;
      for (int64_t i = lo; i < hi; ++i) {  // pass 1: the mean of each plane (of the activated input)
        const float* xp = X + i * HW;
        float acc = 0.f;
        if (hs) {
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < HW; ++k) acc += hard_swish(xp[k]);
        } else {
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < HW; ++k) acc += xp[k];
        }
        pooled[i] = acc / static_cast<float>(HW);
      }
#pragma omp barrier
      std::vector<float> hid(N * Cm);
      for (int64_t n = 0; n < N; ++n) {  // the hidden layer of every sample (Cm x C, small)
        const float* pn = pooled.data() + n * C;
        float* hn = hid.data() + n * Cm;
        for (int64_t j = 0; j < Cm; ++j) {
          const float* w = W1 + j * C;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < C; ++c) acc += w[c] * pn[c];
          hn[j] = acc + (B1 ? B1[j] : 0.f);
        }
        act_forward(hidden, p.slope, hn, Cm);
      }
      for (int64_t i = lo; i < hi; ++i) {  // pass 2: gate, scale [+ residual] [-> relu]
        const int64_t n = i / C, c = i % C;
        const float* w = W2 + c * Cm;
        const float* hn = hid.data() + n * Cm;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < Cm; ++j) acc += w[j] * hn[j];
        const float g = gate_fn(p, acc + (B2 ? B2[c] : 0.f));
        const float* xp = X + i * HW;
        float* yp = Y + i * HW;
        const float* rp = R ? R + i * HW : nullptr;
        if (hs) {
#pragma omp simd
          for (int64_t k = 0; k < HW; ++k) yp[k] = hard_swish(xp[k]) * g;
        } else {
#pragma omp simd
          for (int64_t k = 0; k < HW; ++k) yp[k] = xp[k] * g;
        }
        if (rp) {
#pragma omp simd
          for (int64_t k = 0; k < HW; ++k) yp[k] += rp[k];
        }
        if (relu_nan_zero) {
#pragma omp simd
          for (int64_t k = 0; k < HW; ++k) yp[k] = yp[k] > 0.f ? yp[k] : 0.f;
        } else if (relu_keep_nan) {
#pragma omp simd
          for (int64_t k = 0; k < HW; ++k) yp[k] = !(yp[k] <= 0.f) ? yp[k] : 0.f;
        }
      }
    }
  });
}

}  // namespace

REGISTER_OP(fused_se)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
