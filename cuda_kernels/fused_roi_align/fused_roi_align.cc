// fused_roi_align: MXNet's _contrib_ROIAlign (not position-sensitive) on the CPU, the same values,
// vectorized over channels.
//
// MXNet 1.9.1 takes, per RoI, channel and output bin, its bilinear samples one channel plane at a
// time (four scalar loads per sample).  This op precomputes the same sampling table (positions
// and weights, MXNet's float arithmetic), reads the features channel-last (transposed once per
// call) and sums each bin for a block of channels at once -- per element the same sum, in the
// same order: acc += ((w1 v1 + w2 v2) + w3 v3) + w4 v4 per sample, then acc / count -- then
// writes the block back channel-first (each RoI's output streamed out with non-temporal stores).
// See README.md.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "mxf_common.h"
#include "no_contract.h"

using namespace mxf;

namespace {

struct RoiParams {
  int64_t ph, pw;
  float spatial_scale;
  int64_t sample_ratio;
  bool aligned;
};

RoiParams parse(const Attrs& a) {
  RoiParams p;
  if (!has_attr(a, "pooled_size")) throw OpError("pooled_size is required");
  std::tie(p.ph, p.pw) = attr_pair(a, "pooled_size", 0);
  if (p.ph < 1 || p.pw < 1) throw OpError("pooled_size must be two positive sizes, got '" + attr_str(a, "pooled_size", "") + "'");
  if (!has_attr(a, "spatial_scale")) throw OpError("spatial_scale is required");
  p.spatial_scale = attr_float(a, "spatial_scale", 1.f);
  p.sample_ratio = attr_int(a, "sample_ratio", -1);
  p.aligned = attr_bool(a, "aligned", false);
  if (attr_bool(a, "position_sensitive", false)) throw OpError("position_sensitive is not supported");
  return p;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_roi_align", [&] {
    parse(a);
    *nin = 2;
    *nout = 1;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_roi_align", [&] {
    require_known_shapes(*in);
    const Shape &d = (*in)[0], &r = (*in)[1];
    if (d.size() != 4) throw OpError("data must be (N, C, H, W), got " + shape_str(d));
    if (r.size() != 2 || (r[1] != 4 && r[1] != 5))
      throw OpError("rois must be (R, 4) or (R, 5), got " + shape_str(r));
    const RoiParams p = parse(a);
    (*out)[0] = Shape{r[0], d[1], static_cast<unsigned>(p.ph), static_cast<unsigned>(p.pw)};
  });
}

struct Sample {
  int32_t pos[4];
  float w[4];
};

// MXNet's pre_calc_for_bilinear_interpolate, for one RoI: (ph, pw, iy, ix) in that order.
MXF_NO_CONTRACT void sampling_table(int64_t H, int64_t W, const RoiParams& p, float start_h, float start_w,
                                    float bin_h, float bin_w, int gh, int gw, std::vector<Sample>* table) {
  table->resize(static_cast<size_t>(p.ph * p.pw * gh * gw));
  size_t k = 0;
  const int height = static_cast<int>(H), width = static_cast<int>(W);
  for (int64_t ph = 0; ph < p.ph; ++ph) {
    for (int64_t pw = 0; pw < p.pw; ++pw) {
      for (int iy = 0; iy < gh; ++iy) {
        const float yy = start_h + static_cast<float>(ph) * bin_h +
                         static_cast<float>(iy + .5f) * bin_h / static_cast<float>(gh);
        for (int ix = 0; ix < gw; ++ix) {
          const float xx = start_w + static_cast<float>(pw) * bin_w +
                           static_cast<float>(ix + .5f) * bin_w / static_cast<float>(gw);
          float x = xx, y = yy;
          Sample& s = (*table)[k++];
          if (y < -1.0 || y > height || x < -1.0 || x > width) {
            s = Sample{{0, 0, 0, 0}, {0.f, 0.f, 0.f, 0.f}};
            continue;
          }
          if (y <= 0) y = 0;
          if (x <= 0) x = 0;
          int y_low = static_cast<int>(y), x_low = static_cast<int>(x), y_high, x_high;
          if (y_low >= height - 1) {
            y_high = y_low = height - 1;
            y = static_cast<float>(y_low);
          } else {
            y_high = y_low + 1;
          }
          if (x_low >= width - 1) {
            x_high = x_low = width - 1;
            x = static_cast<float>(x_low);
          } else {
            x_high = x_low + 1;
          }
          const float ly = y - y_low, lx = x - x_low;
          const float hy = 1.f - ly, hx = 1.f - lx;
          s.w[0] = hy * hx, s.w[1] = hy * lx, s.w[2] = ly * hx, s.w[3] = ly * lx;
          s.pos[0] = y_low * width + x_low, s.pos[1] = y_low * width + x_high;
          s.pos[2] = y_high * width + x_low, s.pos[3] = y_high * width + x_high;
        }
      }
    }
  }
}

// n floats from src to dst with non-temporal stores where dst is 32-byte aligned: a RoI's output
// (Faster R-CNN: 300 RoIs x 800 KB) is written once and not read back by this op, and a store that
// first reads its line costs as much again on these machines.
void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX__)
  for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31); ++i) dst[i] = src[i];
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
  for (; i < n; ++i) dst[i] = src[i];
}

constexpr int64_t kBlock = 64;     // channels summed together (a bin's accumulators stay in registers / L1)

// One RoI's bins for channels [c0, c0 + nc): tmp[bin * kBlock + c] = the bin's average.
MXF_NO_CONTRACT void roi_block(const float* xt, int64_t C, int64_t c0, int64_t nc, const std::vector<Sample>& table,
                               int64_t bins, int samples, float count, float* tmp) {
  for (int64_t bin = 0; bin < bins; ++bin) {
    float acc[kBlock];
    for (int64_t c = 0; c < nc; ++c) acc[c] = 0.f;
    const Sample* s = table.data() + bin * samples;
    for (int k = 0; k < samples; ++k) {
      const float *v1 = xt + s[k].pos[0] * C + c0, *v2 = xt + s[k].pos[1] * C + c0;
      const float *v3 = xt + s[k].pos[2] * C + c0, *v4 = xt + s[k].pos[3] * C + c0;
      const float w1 = s[k].w[0], w2 = s[k].w[1], w3 = s[k].w[2], w4 = s[k].w[3];
#pragma omp simd
      for (int64_t c = 0; c < nc; ++c) acc[c] += w1 * v1[c] + w2 * v2[c] + w3 * v3[c] + w4 * v4[c];
    }
    float* t = tmp + bin * kBlock;
#pragma omp simd
    for (int64_t c = 0; c < nc; ++c) t[c] = acc[c] / count;
  }
}

MXF_NO_CONTRACT MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                                      const OpResource&) {
  return guarded("fused_roi_align", [&] {
    const RoiParams p = parse(a);
    MXTensor &xt_in = (*in)[0], &rt = (*in)[1];
    require_f32(xt_in, "data");
    require_f32(rt, "rois");
    const int64_t N = xt_in.shape[0], C = xt_in.shape[1], H = xt_in.shape[2], W = xt_in.shape[3];
    const int64_t R = rt.shape[0], cols = rt.shape[1], bins = p.ph * p.pw;
    const float* X = xt_in.data<float>();
    const float* rois = rt.data<float>();
    float* Y = (*out)[0].data<float>();
    // the batch index of every RoI first: one outside the batch is an error (MXNet reads past its data)
    std::vector<int64_t> batch(R, 0);
    for (int64_t n = 0; n < R; ++n) {
      if (cols == 5) {
        batch[n] = static_cast<int>(rois[n * cols]);
        if (batch[n] >= N)
          throw OpError("RoI " + std::to_string(n) + " has batch index " + std::to_string(batch[n]) +
                        ", the data holds " + std::to_string(N));
      }
    }
    // the features channel-last: xt[b][h * W + w][c]
    std::vector<float> xt(static_cast<size_t>(N * H * W * C));
#pragma omp parallel for schedule(static) collapse(2)
    for (int64_t b = 0; b < N; ++b)
      for (int64_t hw = 0; hw < H * W; ++hw) {
        const float* src = X + b * C * H * W + hw;
        float* dst = xt.data() + (b * H * W + hw) * C;
        for (int64_t c = 0; c < C; ++c) dst[c] = src[c * H * W];
      }
    std::string error;
#pragma omp parallel
    {
      std::vector<Sample> table;
      std::vector<float> tmp(static_cast<size_t>(bins * kBlock)), roi_out(static_cast<size_t>(C * bins));
#pragma omp for schedule(dynamic, 1)
      for (int64_t n = 0; n < R; ++n) {
        float* yn = Y + n * C * bins;
        if (batch[n] < 0) {          // ignored (MXNet leaves such a RoI's output unwritten): zeros
          std::fill(yn, yn + C * bins, 0.f);
          continue;
        }
        const float* box = rois + n * cols + (cols == 5 ? 1 : 0);
        const float off = p.aligned ? 0.5f : 0.f;
        const float start_w = box[0] * p.spatial_scale - off, start_h = box[1] * p.spatial_scale - off;
        const float end_w = box[2] * p.spatial_scale - off, end_h = box[3] * p.spatial_scale - off;
        float roi_w = end_w - start_w, roi_h = end_h - start_h;
        if (p.aligned) {
          if (!(roi_w > 0) || !(roi_h > 0)) {
#pragma omp critical
            error = "RoI " + std::to_string(n) + " is empty (aligned RoIs need a positive width and height)";
            std::fill(yn, yn + C * bins, 0.f);
            continue;
          }
        } else {
          roi_w = std::max(roi_w, 1.f);
          roi_h = std::max(roi_h, 1.f);
        }
        const float bin_h = roi_h / static_cast<float>(p.ph), bin_w = roi_w / static_cast<float>(p.pw);
        const int gh = p.sample_ratio > 0 ? static_cast<int>(p.sample_ratio)
                                          : static_cast<int>(std::ceil(roi_h / static_cast<float>(p.ph)));
        const int gw = p.sample_ratio > 0 ? static_cast<int>(p.sample_ratio)
                                          : static_cast<int>(std::ceil(roi_w / static_cast<float>(p.pw)));
        const float count = static_cast<float>(gh * gw);
        sampling_table(H, W, p, start_h, start_w, bin_h, bin_w, gh, gw, &table);
        const float* xb = xt.data() + batch[n] * H * W * C;
        for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
          const int64_t nc = std::min(kBlock, C - c0);
          roi_block(xb, C, c0, nc, table, bins, gh * gw, count, tmp.data());
          for (int64_t c = 0; c < nc; ++c) {
            float* dst = roi_out.data() + (c0 + c) * bins;
            for (int64_t bin = 0; bin < bins; ++bin) dst[bin] = tmp[bin * kBlock + c];
          }
        }
        stream_copy(yn, roi_out.data(), C * bins);
      }
#if defined(__AVX__)
      _mm_sfence();   // the streamed stores are seen before the op returns
#endif
    }
    if (!error.empty()) throw OpError(error);
  });
}

}  // namespace

REGISTER_OP(fused_roi_align)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
