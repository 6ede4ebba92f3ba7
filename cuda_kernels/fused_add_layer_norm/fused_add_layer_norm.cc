// fused_add_layer_norm: s = a + b;  y = (s - mean(s)) / sqrt(var(s) + eps) * gamma + beta
// over the last axis, in one pass per row (the row stays in L1 between the moments
// and the normalisation).  Optional second output s (attr output_sum) for the residual.
// b may broadcast over leading dimensions of a (its shape is a suffix of a's, leading 1s ok).
// a and b may each be float32 or bfloat16 (inference): the row is widened to float32, the
// statistics and the normalisation run in float32, and y (and s) are written in a's dtype,
// rounded to nearest even (gamma and beta stay float32).
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "dnnl_matmul.h"  // to_bf16 / from_bf16
#include "mxf_common.h"
#include "gpu_glue.h"  // the "gpu" implementations (a build with nvcc)

using namespace mxf;

namespace {

struct LNParams {
  float eps;
  bool output_sum;
};

LNParams parse(const Attrs& a) {
  LNParams p;
  p.eps = attr_float(a, "eps", 1e-5f);
  p.output_sum = attr_bool(a, "output_sum", false);
  const int64_t axis = attr_int(a, "axis", -1);
  if (axis != -1) throw OpError("only axis=-1 (the last axis) is supported, got axis=" +
                                std::to_string(axis));
  if (!(p.eps >= 0.f)) throw OpError("eps must be >= 0");
  return p;
}

// rows of b that a row of a pairs with: b_row = a_row % b_rows
int64_t b_rows_of(const std::vector<int64_t>& as, const std::vector<int64_t>& bs) {
  bool ok = !as.empty() && bs.size() <= as.size() && !bs.empty() && bs.back() == as.back();
  size_t lead = 0;  // b's leading dims that are 1 are free
  while (ok && lead < bs.size() && bs[lead] == 1 && lead + 1 < bs.size()) ++lead;
  for (size_t i = lead; ok && i < bs.size(); ++i)
    ok = bs[i] == as[as.size() - bs.size() + i];
  if (!ok)
    throw OpError("b " + shape_str(bs) + " must equal a " + shape_str(as) +
                  " or match its trailing dimensions (broadcast over leading dimensions)");
  return numel(bs) / std::max<int64_t>(bs.back(), 1);
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_add_layer_norm", [&] {
    LNParams p = parse(a);
    *nin = 4;
    *nout = p.output_sum ? 2 : 1;
  });
}

// mshadow's code for bfloat16 (lib_api's MXDType does not name it)
constexpr int kBfloat16 = 12;

MXReturnValue infer_type(const Attrs& a, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_add_layer_norm", [&] {
    for (size_t i = 0; i < in->size(); ++i) {
      const int t = (*in)[i];
      if (t == mxnet::ext::kFloat32 || (i < 2 && t == kBfloat16)) continue;
      throw OpError(i < 2 ? "input " + std::to_string(i) + " must be float32 or bfloat16, got dtype code " +
                                std::to_string(t)
                          : "input " + std::to_string(i) + " (gamma/beta) must be float32");
    }
    for (auto& t : *out) t = (*in)[0];
  });
}

// Row r of a float32 or bfloat16 tensor as float32: the row itself, or widened into buf.
const float* row_f32(const MXTensor& t, int64_t r, int64_t C, float* buf) {
  if (t.dtype != kBfloat16) return static_cast<const float*>(t.data_ptr) + r * C;
  from_bf16(static_cast<const uint16_t*>(t.data_ptr) + r * C, buf, C);
  return buf;
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_add_layer_norm", [&] {
    require_known_shapes(*in);
    std::vector<int64_t> as((*in)[0].begin(), (*in)[0].end()), bs((*in)[1].begin(), (*in)[1].end());
    b_rows_of(as, bs);
    const unsigned C = (*in)[0].back();
    for (int i = 2; i < 4; ++i)
      if (!((*in)[i].size() == 1 && (*in)[i][0] == C))
        throw OpError(std::string(i == 2 ? "gamma" : "beta") + " must have shape (" +
                      std::to_string(C) + ",), got " + shape_str((*in)[i]));
    for (auto& o : *out) o = (*in)[0];
  });
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_add_layer_norm", [&] {
    LNParams p = parse(a);
    const auto& as = (*in)[0].shape;
    const int64_t C = as.back(), R = numel(as) / std::max<int64_t>(C, 1);
    const int64_t BR = b_rows_of(as, (*in)[1].shape);
    const float *G = (*in)[2].data<float>(), *Be = (*in)[3].data<float>();
    const bool half = (*in)[0].dtype == kBfloat16;  // y and s in bfloat16
    for (int i = 2; i < 4; ++i) require_f32((*in)[i], "fused_add_layer_norm gamma/beta");
    float* Y = half ? nullptr : (*out)[0].data<float>();
    float* S = p.output_sum && !half ? (*out)[1].data<float>() : nullptr;
    uint16_t* Yh = half ? static_cast<uint16_t*>((*out)[0].data_ptr) : nullptr;
    uint16_t* Sh = half && p.output_sum ? static_cast<uint16_t*>((*out)[1].data_ptr) : nullptr;
    // A row costs a few microseconds: a small tensor (BERT's 128 x 768) runs on fewer threads
    // than the team (an OpenMP barrier costs more than the rows it would share out), and the
    // moments are summed in SIMD lanes (omp simd reductions: 16 partial sums, not one chain
    // of dependent adds).
    const int64_t kRowsPerThread = 32;
    const int threads = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(omp_get_max_threads(), R * C / (kRowsPerThread * 768))));
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      thread_local std::vector<float> tmp, abuf, bbuf, ybuf;  // kept between calls
      for (auto* v : {&tmp, &abuf, &bbuf, &ybuf})
        if (v->size() < static_cast<size_t>(C)) v->resize(C);
#pragma omp for schedule(dynamic, 8)
      for (int64_t r = 0; r < R; ++r) {
        const float* ar = row_f32((*in)[0], r, C, abuf.data());
        const float* br = row_f32((*in)[1], r % BR, C, bbuf.data());
        float* s = S ? S + r * C : tmp.data();
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < C; ++c) {
          s[c] = ar[c] + br[c];
          sum += s[c];
        }
        const float mean = sum / C;
        float var = 0.f;
#pragma omp simd reduction(+ : var)
        for (int64_t c = 0; c < C; ++c) {
          const float d = s[c] - mean;
          var += d * d;
        }
        const float rstd = 1.f / std::sqrt(var / C + p.eps);
        float* y = half ? ybuf.data() : Y + r * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) y[c] = (s[c] - mean) * rstd * G[c] + Be[c];
        if (half) {
          to_bf16(y, Yh + r * C, C);
          if (Sh) to_bf16(s, Sh + r * C, C);
        }
      }
    }
  });
}

// inputs: [dy, (dsum), a, b, gamma, beta, y, (sum)]; outputs: [da, db, dgamma, dbeta]
MXReturnValue backward(const Attrs& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                       const OpResource&) {
  return guarded("fused_add_layer_norm backward", [&] {
    LNParams p = parse(attrs);
    const int k = p.output_sum ? 2 : 1;
    for (int i = 0; i < 2; ++i)
      if ((*in)[k + i].dtype == kBfloat16)
        throw OpError("bfloat16 inputs have no backward (reduced precision is for inference)");
    const float* dY = (*in)[0].data<float>();
    const float* dS = p.output_sum ? (*in)[1].data<float>() : nullptr;
    MXTensor& aT = (*in)[k];
    const auto& as = aT.shape;
    const int64_t C = as.back(), R = numel(as) / std::max<int64_t>(C, 1);
    const int64_t BR = b_rows_of(as, (*in)[k + 1].shape);
    const float *A = aT.data<float>(), *Bv = (*in)[k + 1].data<float>();
    const float* G = (*in)[k + 2].data<float>();
    float *dA = (*out)[0].data<float>(), *dB = (*out)[1].data<float>();
    float *dG = (*out)[2].data<float>(), *dBe = (*out)[3].data<float>();
    const int nt = omp_get_max_threads();
    const bool b_full = BR == R;
    // per-thread partial sums for the reductions (gamma, beta, broadcast b)
    std::vector<float> part(static_cast<size_t>(nt) * (2 * C + (b_full ? 0 : BR * C)), 0.f);
#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num();
      float* pg = part.data() + static_cast<size_t>(t) * (2 * C + (b_full ? 0 : BR * C));
      float* pb = pg + C;
      float* pbb = pb + C;
      std::vector<float> xh(C), gg(C);
#pragma omp for schedule(dynamic, 8)
      for (int64_t r = 0; r < R; ++r) {
        const float* ar = A + r * C;
        const float* br = Bv + (r % BR) * C;
        const float* dy = dY + r * C;
        float sum = 0.f;
        for (int64_t c = 0; c < C; ++c) { xh[c] = ar[c] + br[c]; sum += xh[c]; }
        const float mean = sum / C;
        float var = 0.f;
        for (int64_t c = 0; c < C; ++c) { const float d = xh[c] - mean; var += d * d; }
        const float rstd = 1.f / std::sqrt(var / C + p.eps);
        float m1 = 0.f, m2 = 0.f;
        for (int64_t c = 0; c < C; ++c) {
          xh[c] = (xh[c] - mean) * rstd;
          const float g = gg[c] = dy[c] * G[c];
          m1 += g;
          m2 += g * xh[c];
          pg[c] += dy[c] * xh[c];
          pb[c] += dy[c];
        }
        m1 /= C;
        m2 /= C;
        float* da = dA + r * C;
        // g·γ rounded once, as summed into m1: written again here, the compiler may contract it
        // into fma(dy, γ, -m1), whose exact product leaves a rounding residue where the terms
        // cancel (one feature: 0 in the unfused graph, the residue times rstd = 1/sqrt(eps) here)
        for (int64_t c = 0; c < C; ++c) {
          float v = rstd * (gg[c] - m1 - xh[c] * m2);
          if (dS) v += dS[r * C + c];
          da[c] = v;
        }
        if (!b_full) {
          float* acc = pbb + (r % BR) * C;
          for (int64_t c = 0; c < C; ++c) acc[c] += da[c];
        }
      }
    }
    std::fill(dG, dG + C, 0.f);
    std::fill(dBe, dBe + C, 0.f);
    if (b_full) std::memcpy(dB, dA, sizeof(float) * R * C);
    else std::fill(dB, dB + BR * C, 0.f);
    for (int t = 0; t < nt; ++t) {
      const float* pg = part.data() + static_cast<size_t>(t) * (2 * C + (b_full ? 0 : BR * C));
      for (int64_t c = 0; c < C; ++c) { dG[c] += pg[c]; dBe[c] += pg[C + c]; }
      if (!b_full)
        for (int64_t i = 0; i < BR * C; ++i) dB[i] += pg[2 * C + i];
    }
  });
}

}  // namespace

REGISTER_OP(fused_add_layer_norm)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(backward, "cpu")
#if MXF_WITH_CUDA
    .setForward(mxf::gpu::add_layer_norm_forward, "gpu")
    .setBackward(mxf::gpu::add_layer_norm_backward, "gpu")
#endif
    ;
