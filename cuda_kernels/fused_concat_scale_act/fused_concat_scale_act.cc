// fused_concat_scale_act: y = act(concat(p0, ..., pk-1; axis 1) * scale + shift), one pass.
//
// A BatchNorm at inference is an exact per-channel scale and shift; DenseNet applies one
// (and a relu) to the concatenation of all earlier feature maps.  This op reads the pieces
// where they are and writes only the activated result: the concatenation itself is never
// written.  Pieces share every axis but 1; scale and shift hold one value per output
// channel (any shape of that size, e.g. (C, 1, 1)).  See README.md.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "act.h"
#include "mxf_common.h"

using namespace mxf;

namespace {

struct CatParams {
  int num_args;
  Act act;
};

CatParams parse(const Attrs& a) {
  CatParams p;
  p.num_args = static_cast<int>(attr_int(a, "num_args", 0));
  if (p.num_args < 1) throw OpError("num_args must be >= 1");
  const std::string s = attr_choice(a, "act", "none", {"none", "relu", "act_relu"});
  p.act = s == "relu" ? Act::relu : (s == "act_relu" ? Act::act_relu : Act::none);
  if (attr_int(a, "dim", 1) != 1) throw OpError("only dim=1 is supported");
  return p;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_concat_scale_act", [&] {
    *nin = parse(a).num_args + 2;
    *nout = 1;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_concat_scale_act", [&] {
    const int k = parse(a).num_args;
    // scale and shift as the rule writes them, (C, 1, ..., 1) of the pieces' rank less one, C
    // the pieces' channels together (a BatchNorm's per-channel values)
    unsigned int channels = 0;
    for (int i = 0; i < k; ++i) {
      require_known_input(*in, i, "a piece");
      if ((*in)[i].size() >= 2) channels += (*in)[i][1];
    }
    if ((*in)[0].size() >= 2) {
      Shape per_channel((*in)[0].size() - 1, 1);
      per_channel[0] = channels;
      fill_input(in, k, per_channel, "scale");
      fill_input(in, k + 1, per_channel, "shift");
    }
    require_known_shapes(*in);
    Shape o = (*in)[0];
    if (o.size() < 2) throw OpError("pieces must have rank >= 2, got " + shape_str(o));
    unsigned C = 0;
    for (int i = 0; i < k; ++i) {
      const Shape& s = (*in)[i];
      bool ok = s.size() == o.size();
      for (size_t d = 0; ok && d < s.size(); ++d) ok = d == 1 || s[d] == o[d];
      if (!ok)
        throw OpError("piece " + std::to_string(i) + " " + shape_str(s) + " does not match piece 0 " +
                      shape_str(o) + " outside axis 1");
      C += s[1];
    }
    o[1] = C;
    for (int j = 0; j < 2; ++j) {
      const Shape& s = (*in)[k + j];
      int64_t n = 1;
      for (unsigned d : s) n *= d;
      if (n != C)
        throw OpError(std::string(j ? "shift" : "scale") + " must hold " + std::to_string(C) +
                      " values (one per channel), got " + shape_str(s));
    }
    (*out)[0] = o;
  });
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_concat_scale_act", [&] {
    const CatParams p = parse(a);
    const int k = p.num_args;
    const auto& os = (*out)[0].shape;
    const int64_t N = os[0], C = os[1];
    int64_t inner = 1;
    for (size_t d = 2; d < os.size(); ++d) inner *= os[d];
    const float* S = (*in)[k].data<float>();
    const float* T = (*in)[k + 1].data<float>();
    float* Y = (*out)[0].data<float>();
    // (piece, first output channel) of every output channel
    std::vector<int> piece(C);
    std::vector<int64_t> first(k + 1, 0);
    for (int i = 0; i < k; ++i) {
      first[i + 1] = first[i] + (*in)[i].shape[1];
      std::fill(piece.begin() + first[i], piece.begin() + first[i + 1], i);
    }
    std::vector<const float*> src(k);
    for (int i = 0; i < k; ++i) src[i] = (*in)[i].data<float>();
    const Act act = resolve_act(p.act, static_cast<int>(os.size()), dnnl_enabled());
    const bool nan_zero = act == Act::relu_dnnl;
    const bool keep_nan = act == Act::relu || act == Act::act_relu;
    const int64_t P = N * C;
    const int nt = P * inner < (1 << 20) ? 1 : omp_get_max_threads();  // as fused_se: small maps on one thread
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < P; ++i) {
      const int64_t n = i / C, c = i % C;
      const int pc = piece[c];
      const int64_t cp = first[pc + 1] - first[pc];
      const float* x = src[pc] + (n * cp + (c - first[pc])) * inner;
      float* y = Y + i * inner;
      const float s = S[c], t = T[c];
      if (nan_zero) {
#pragma omp simd
        for (int64_t e = 0; e < inner; ++e) {
          const float v = x[e] * s + t;
          y[e] = v > 0.f ? v : 0.f;
        }
      } else if (keep_nan) {
#pragma omp simd
        for (int64_t e = 0; e < inner; ++e) {
          const float v = x[e] * s + t;
          y[e] = !(v <= 0.f) ? v : 0.f;
        }
      } else {
#pragma omp simd
        for (int64_t e = 0; e < inner; ++e) y[e] = x[e] * s + t;
      }
    }
  });
}

}  // namespace

REGISTER_OP(fused_concat_scale_act)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
