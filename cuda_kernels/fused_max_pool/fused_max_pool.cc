// fused_max_pool: MXNet's 2-D max Pooling (NCHW, float32) on a plain NCHW input, vectorized.
//
// Where a max Pooling reads a value MXNet's oneDNN ops did not produce (a sigmoid, an
// elementwise op: CenterNet's 3x3 stride-1 peak extraction on its heatmap), MXNet 1.9.1 runs
// oneDNN's reference pooling on the plain layout, one window at a time (11 ms for a 20x128x128
// heatmap on two cores).  This op computes the same values: per output element the window's
// in-bounds inputs with MXNet's comparison (acc = v > acc ? v : acc, from the lowest finite
// float: a NaN never wins, a window of NaN or -inf gives -FLT_MAX, as there), accumulated for a
// whole output row at a time, kernel offset by kernel offset, so that the inner loop runs over
// contiguous outputs.  See README.md.
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <tuple>
#include <vector>

#include "mxf_common.h"

using namespace mxf;

namespace {

struct PoolParams {
  int64_t kh, kw, sh, sw, ph, pw;
  bool full;
};

PoolParams parse(const Attrs& a) {
  PoolParams p;
  std::tie(p.kh, p.kw) = attr_pair(a, "kernel", 0);
  std::tie(p.sh, p.sw) = attr_pair(a, "stride", 1);
  std::tie(p.ph, p.pw) = attr_pair(a, "pad", 0);
  if (p.kh < 1 || p.kw < 1) throw OpError("kernel must be positive, got " + attr_str(a, "kernel", ""));
  if (p.sh < 1 || p.sw < 1) throw OpError("stride must be positive");
  if (p.ph < 0 || p.pw < 0 || p.ph >= p.kh || p.pw >= p.kw) throw OpError("pad must be in [0, kernel)");
  p.full = attr_choice(a, "pooling_convention", "valid", {"valid", "full"}) == "full";
  return p;
}

// MXNet's output size: valid floor((x + 2p - k) / s) + 1, full ceil(...) + 1.
int64_t out_size(int64_t x, int64_t k, int64_t s, int64_t p, bool full) {
  const int64_t span = x + 2 * p - k;
  if (span < 0) throw OpError("the kernel is larger than the padded input");
  return (full ? (span + s - 1) / s : span / s) + 1;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_max_pool", [&] {
    parse(a);
    *nin = 1;
    *nout = 1;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_max_pool", [&] {
    require_known_shapes(*in);
    const Shape& s = (*in)[0];
    if (s.size() != 4) throw OpError("the input must be (N, C, H, W), got " + shape_str(s));
    const PoolParams p = parse(a);
    Shape o = s;
    o[2] = static_cast<unsigned>(out_size(s[2], p.kh, p.sh, p.ph, p.full));
    o[3] = static_cast<unsigned>(out_size(s[3], p.kw, p.sw, p.pw, p.full));
    (*out)[0] = o;
  });
}

// a / b rounded toward -inf (b > 0).
inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// One plane: y (OH, OW) from x (H, W).
void pool_plane(const float* x, float* y, int64_t H, int64_t W, int64_t OH, int64_t OW, const PoolParams& p) {
  for (int64_t oh = 0; oh < OH; ++oh) {
    float* acc = y + oh * OW;
    std::fill(acc, acc + OW, -FLT_MAX);
    const int64_t h0 = oh * p.sh - p.ph;
    for (int64_t i = 0; i < p.kh; ++i) {
      const int64_t ih = h0 + i;
      if (ih < 0 || ih >= H) continue;
      const float* row = x + ih * W;
      for (int64_t j = 0; j < p.kw; ++j) {
        // outputs whose column ow * sw - pw + j lies in [0, W)
        const int64_t lo = std::max<int64_t>(0, -floor_div(j - p.pw, p.sw));
        const int64_t hi = std::min<int64_t>(OW, floor_div(W - 1 + p.pw - j, p.sw) + 1);
        if (p.sw == 1) {
          const float* src = row - p.pw + j;
#pragma omp simd
          for (int64_t ow = lo; ow < hi; ++ow) {
            const float v = src[ow];
            acc[ow] = v > acc[ow] ? v : acc[ow];
          }
        } else {
          for (int64_t ow = lo; ow < hi; ++ow) {
            const float v = row[ow * p.sw - p.pw + j];
            acc[ow] = v > acc[ow] ? v : acc[ow];
          }
        }
      }
    }
  }
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) {
  return guarded("fused_max_pool", [&] {
    const PoolParams p = parse(a);
    MXTensor& xt = (*in)[0];
    require_f32(xt, "data");
    const auto& s = xt.shape;
    const auto& os = (*out)[0].shape;
    const int64_t planes = s[0] * s[1], H = s[2], W = s[3], OH = os[2], OW = os[3];
    const float* X = xt.data<float>();
    float* Y = (*out)[0].data<float>();
    const int nt = planes * OH * OW < (1 << 14) ? 1 : omp_get_max_threads();
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < planes; ++i) pool_plane(X + i * H * W, Y + i * OH * OW, H, W, OH, OW, p);
  });
}

}  // namespace

REGISTER_OP(fused_max_pool)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
