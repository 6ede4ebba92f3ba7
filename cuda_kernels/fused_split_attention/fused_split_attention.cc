// fused_split_attention: ResNeSt's split attention in two passes over the feature map.
//
//   x     (N, R·C, H, W): the radix groups of the split convolution, x_r = x[:, r·C:(r+1)·C]
//   p     = mean over H, W of Σ_r x_r                          (N, C)
//   h     = act(W1 ⊛ p + b1)          grouped (groups1) 1×1    (N, Cm)
//   a     = W2 ⊛ h + b2               grouped (groups2) 1×1    (N, R·C)
//   att_r = softmax over r of a[(k·R + r)·D + i]   (R > 1)     one weight per (r, c = k·D + i), D = C / A
//         = sigmoid(a)                              (R = 1)
//   y     = Σ_r att_r · x_r                                     (N, C, H, W)
//
// Pass 1 sums the radix groups and pools each (n, c) plane; the two small grouped layers and
// the r-softmax run on the pooled vector; pass 2 writes the weighted sum.  The pool and the
// products sum in another order than MXNet's ops (float32 error ~1e-7 relative).  See README.md.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "act.h"
#include "mxf_common.h"

using namespace mxf;

namespace {

struct SAParams {
  int64_t radix, att_groups, groups1, groups2;
  Act act;
  float slope;
  bool softmax, bias1, bias2;
};

SAParams parse(const Attrs& a) {
  SAParams p;
  p.radix = attr_int(a, "radix", 2);
  p.att_groups = attr_int(a, "att_groups", 1);
  p.groups1 = attr_int(a, "num_group1", 1);
  p.groups2 = attr_int(a, "num_group2", 1);
  if (p.radix < 1 || p.att_groups < 1 || p.groups1 < 1 || p.groups2 < 1)
    throw OpError("radix, att_groups, num_group1 and num_group2 must be >= 1");
  p.act = parse_act(a);
  p.slope = attr_float(a, "slope", 0.25f);
  const std::string g = attr_choice(a, "gate", p.radix > 1 ? "softmax" : "sigmoid", {"softmax", "sigmoid"});
  p.softmax = g == "softmax";
  if (!p.softmax && p.radix != 1) throw OpError("gate=sigmoid needs radix=1");
  p.bias1 = !attr_bool(a, "no_bias1", false);
  p.bias2 = !attr_bool(a, "no_bias2", false);
  return p;
}

struct Slots {
  int w1, b1, w2, b2;
};
Slots slots(const SAParams& p) {
  Slots s;
  int k = 1;
  s.w1 = k++;
  s.b1 = p.bias1 ? k++ : -1;
  s.w2 = k++;
  s.b2 = p.bias2 ? k++ : -1;
  return s;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_split_attention", [&] {
    SAParams p = parse(a);
    *nin = 3 + p.bias1 + p.bias2;
    *nout = 1;
  });
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_split_attention", [&] {
    const SAParams p = parse(a);
    const Slots s = slots(p);
    // the two grouped 1x1 layers' weights and biases from x, radix, num_hidden and the groups,
    // as Convolution infers them
    require_known_input(*in, 0, "x");
    const Shape& xs = (*in)[0];
    if (xs.size() == 4 && has_attr(a, "num_hidden") && p.radix > 0 && xs[1] % p.radix == 0 &&
        p.groups1 > 0 && p.groups2 > 0) {
      const unsigned int RC = xs[1], C = RC / p.radix, Cm = static_cast<unsigned int>(attr_int(a, "num_hidden", 0));
      fill_input(in, s.w1, Shape{Cm, C / static_cast<unsigned int>(p.groups1), 1, 1}, "w1");
      fill_input(in, s.w2, Shape{RC, Cm / static_cast<unsigned int>(p.groups2), 1, 1}, "w2");
      if (p.bias1) fill_input(in, s.b1, Shape{Cm}, "b1");
      if (p.bias2) fill_input(in, s.b2, Shape{RC}, "b2");
    }
    require_known_shapes(*in);
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, R·C, H, W), got " + shape_str(x));
    if (x[1] % p.radix) throw OpError("x's channels " + std::to_string(x[1]) + " are not radix " +
                                      std::to_string(p.radix) + " groups");
    const int64_t C = x[1] / p.radix, RC = x[1];
    if (C % p.att_groups || C % p.groups1)
      throw OpError("C=" + std::to_string(C) + " is not divisible by att_groups/num_group1");
    const Shape &w1 = (*in)[s.w1], &w2 = (*in)[s.w2];
    if (w1.size() != 4 || w1[2] != 1 || w1[3] != 1 || static_cast<int64_t>(w1[1]) * p.groups1 != C ||
        w1[0] % p.groups1)
      throw OpError("w1 must be (Cm, " + std::to_string(C / p.groups1) + ", 1, 1), got " + shape_str(w1));
    const int64_t Cm = w1[0];
    if (Cm % p.groups2 || RC % p.groups2 || w2.size() != 4 || static_cast<int64_t>(w2[0]) != RC ||
        static_cast<int64_t>(w2[1]) * p.groups2 != Cm || w2[2] != 1 || w2[3] != 1)
      throw OpError("w2 must be (" + std::to_string(RC) + ", Cm/num_group2, 1, 1), got " + shape_str(w2));
    if (p.bias1 && numel((*in)[s.b1]) != Cm)
      throw OpError("b1 must hold " + std::to_string(Cm) + " values, got " + shape_str((*in)[s.b1]));
    if (p.bias2 && numel((*in)[s.b2]) != RC)
      throw OpError("b2 must hold " + std::to_string(RC) + " values, got " + shape_str((*in)[s.b2]));
    if (attr_int(a, "num_hidden", Cm) != Cm || attr_int(a, "num_channels", C) != C)
      throw OpError("num_hidden/num_channels (" + std::to_string(attr_int(a, "num_hidden", Cm)) + ", " +
                    std::to_string(attr_int(a, "num_channels", C)) + ") do not match the weights and x (" +
                    std::to_string(Cm) + ", " + std::to_string(C) + ")");
    (*out)[0] = Shape{x[0], static_cast<unsigned>(C), x[2], x[3]};
  });
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_split_attention", [&] {
    const SAParams p = parse(a);
    const Slots s = slots(p);
    const auto& xs = (*in)[0].shape;
    const int64_t R = p.radix, N = xs[0], C = xs[1] / R, HW = xs[2] * xs[3];
    const int64_t Cm = (*in)[s.w1].shape[0];
    const int64_t in1 = C / p.groups1, out1 = Cm / p.groups1;      // fc1: inputs / outputs per group
    const int64_t in2 = Cm / p.groups2, out2 = R * C / p.groups2;  // fc2
    const int64_t A = p.att_groups, D = C / A;
    const float* X = (*in)[0].data<float>();
    const float* W1 = (*in)[s.w1].data<float>();
    const float* W2 = (*in)[s.w2].data<float>();
    const float* B1 = p.bias1 ? (*in)[s.b1].data<float>() : nullptr;
    const float* B2 = p.bias2 ? (*in)[s.b2].data<float>() : nullptr;
    float* Y = (*out)[0].data<float>();
    const Act hidden = resolve_act(p.act, 4, dnnl_enabled());

    const int64_t P = N * C;  // output planes
    std::vector<float> pooled(P);
    // As fused_se: one parallel region with one barrier; maps under 4 MiB on one thread.
    const int nt = P * R * HW < (1 << 20) ? 1 : omp_get_max_threads();
#pragma omp parallel num_threads(nt)
    {
      const int T = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t lo = P * t / T, hi = P * (t + 1) / T;
      for (int64_t i = lo; i < hi; ++i) {  // pass 1: Σ_r x_r, then its plane mean
        const int64_t n = i / C, c = i % C;
        const float* x0 = X + (n * R * C + c) * HW;
        float acc = 0.f;
        if (R == 1) {
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < HW; ++k) acc += x0[k];
        } else if (R == 2) {
          const float* x1 = x0 + C * HW;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < HW; ++k) acc += x0[k] + x1[k];
        } else {
          for (int64_t k = 0; k < HW; ++k) {
            float v = x0[k];
            for (int64_t r = 1; r < R; ++r) v += x0[r * C * HW + k];
            acc += v;
          }
        }
        pooled[i] = acc / static_cast<float>(HW);
      }
#pragma omp barrier
      // the attention of every sample (small: Cm × C/groups1 and R·C × Cm/groups2); each
      // thread computes the weights of its own planes
      std::vector<float> hid(Cm), logits(R * C);
      int64_t n_done = -1;
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t n = i / C, c = i % C;
        if (n != n_done) {
          const float* pn = pooled.data() + n * C;
          for (int64_t j = 0; j < Cm; ++j) {
            const float* w = W1 + j * in1;
            const float* pg = pn + (j / out1) * in1;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t q = 0; q < in1; ++q) acc += w[q] * pg[q];
            hid[j] = acc + (B1 ? B1[j] : 0.f);
          }
          act_forward(hidden, p.slope, hid.data(), Cm);
          for (int64_t o = 0; o < R * C; ++o) {
            const float* w = W2 + o * in2;
            const float* hg = hid.data() + (o / out2) * in2;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t q = 0; q < in2; ++q) acc += w[q] * hg[q];
            logits[o] = acc + (B2 ? B2[o] : 0.f);
          }
          n_done = n;
        }
        // the weights of output channel c = k·D + d: logits[(k·R + r)·D + d], r = 0..R-1
        const int64_t k = c / D, d = c % D;
        float g[64];
        float* gw = R <= 64 ? g : nullptr;
        std::vector<float> big;
        if (!gw) {
          big.resize(R);
          gw = big.data();
        }
        if (p.softmax) {
          float mx = logits[(k * R) * D + d];
          for (int64_t r = 1; r < R; ++r) mx = std::max(mx, logits[(k * R + r) * D + d]);
          float sum = 0.f;
          for (int64_t r = 0; r < R; ++r) {
            gw[r] = exp_full(logits[(k * R + r) * D + d] - mx);
            sum += gw[r];
          }
          for (int64_t r = 0; r < R; ++r) gw[r] /= sum;
        } else {
          gw[0] = fast_sigmoid(logits[c]);
        }
        // pass 2: y = Σ_r att_r · x_r
        const float* x0 = X + (n * R * C + c) * HW;
        float* yp = Y + i * HW;
        const float g0 = gw[0];
        if (R == 1) {
#pragma omp simd
          for (int64_t q = 0; q < HW; ++q) yp[q] = g0 * x0[q];
        } else if (R == 2) {
          const float* x1 = x0 + C * HW;
          const float g1 = gw[1];
#pragma omp simd
          for (int64_t q = 0; q < HW; ++q) yp[q] = g0 * x0[q] + g1 * x1[q];
        } else {
#pragma omp simd
          for (int64_t q = 0; q < HW; ++q) yp[q] = g0 * x0[q];
          for (int64_t r = 1; r < R; ++r) {
            const float* xr = x0 + r * C * HW;
            const float gr = gw[r];
#pragma omp simd
            for (int64_t q = 0; q < HW; ++q) yp[q] += gr * xr[q];
          }
        }
      }
    }
  });
}

}  // namespace

REGISTER_OP(fused_split_attention)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
