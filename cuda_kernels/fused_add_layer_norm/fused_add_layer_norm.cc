// fused_add_layer_norm: s = a + b;  y = (s - mean(s)) / sqrt(var(s) + eps) * gamma + beta
// over the last axis, in one pass per row (the row stays in L1 between the moments
// and the normalisation).  Optional second output s (attr output_sum) for the residual.
// a and b broadcast as MXNet's broadcast_add does (NumPy rules, either operand, any axis, the
// last one included); y and s have the broadcast shape.
// a and b may each be float32 or bfloat16 (inference): the row is widened to float32, the
// statistics and the normalisation run in float32, and y (and s) are written in a's dtype,
// rounded to nearest even (gamma and beta stay float32).  float16 (AMP's GPU graphs): a, b,
// gamma, beta, the outputs and the gradients may each be float16; the call runs in float32 on
// widened copies and its results are rounded once (half.h; correct, not fast).  out_dtype
// (float32 / float16 / bfloat16) gives y and s another dtype than a's: AMP runs LayerNorm in
// float32 on float16 values, so its output is float32 there.
// bf16_copy=True (inference): one more output, last — y rounded to bfloat16 (nearest even), for
// readers that round y themselves (fuse(..., precision="bf16"): the next fused_dense's data),
// written from the row while it is in registers; y itself stays as it is for the other readers.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "dnnl_matmul.h"  // to_bf16 / from_bf16
#include "half.h"
#include "mxf_common.h"
#include "vmath_avx512.h"
#include "gpu_glue.h"  // the "gpu" implementations (a build with nvcc)

using namespace mxf;

namespace {

struct LNParams {
  float eps;
  bool output_sum;
  bool bf16_copy;
  int out_dtype;  // -1: a's dtype
  int num_outputs() const { return (output_sum ? 2 : 1) + (bf16_copy ? 1 : 0); }
};

LNParams parse(const Attrs& a) {
  LNParams p;
  p.eps = attr_float(a, "eps", 1e-5f);
  p.output_sum = attr_bool(a, "output_sum", false);
  p.bf16_copy = attr_bool(a, "bf16_copy", false);
  p.out_dtype = attr_dtype(a, "out_dtype", {kF32, kF16, kBF16});
  const int64_t axis = attr_int(a, "axis", -1);
  if (axis != -1) throw OpError("only axis=-1 (the last axis) is supported, got axis=" +
                                std::to_string(axis));
  if (!(p.eps >= 0.f)) throw OpError("eps must be >= 0");
  return p;
}

// How the rows of the output (a and b broadcast together; the last axis is the row) read a
// and b: the element offset of each operand's row and whether its last axis is broadcast.
struct Bcast {
  std::vector<int64_t> out;                  // the output shape
  int64_t C = 0, R = 0;                      // row length, rows
  std::vector<int64_t> lead;                 // the output's leading axes
  std::vector<int64_t> stride[2];            // per operand: element strides of the leading axes (0: broadcast)
  bool last1[2] = {false, false};            // per operand: its last axis is 1, broadcast along the row
  bool full[2] = {false, false};             // per operand: its shape is the output's (row r at r * C)

  int64_t offset(int x, int64_t r) const {   // element offset of row r of operand x
    if (full[x]) return r * C;
    int64_t off = 0;
    for (int64_t i = static_cast<int64_t>(lead.size()) - 1; i >= 0; --i) {
      off += (r % lead[i]) * stride[x][i];
      r /= lead[i];
    }
    return off;
  }
};

Bcast bcast_of(const std::vector<int64_t>& as, const std::vector<int64_t>& bs) {
  if (as.empty() || bs.empty())
    throw OpError("a and b must have at least one axis, got a " + shape_str(as) + ", b " + shape_str(bs));
  const size_t n = std::max(as.size(), bs.size());
  std::vector<int64_t> x[2] = {std::vector<int64_t>(n - as.size(), 1), std::vector<int64_t>(n - bs.size(), 1)};
  x[0].insert(x[0].end(), as.begin(), as.end());
  x[1].insert(x[1].end(), bs.begin(), bs.end());
  Bcast bc;
  bc.out.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t u = x[0][i], v = x[1][i];
    if (u != v && u != 1 && v != 1)
      throw OpError("a " + shape_str(as) + " and b " + shape_str(bs) + " do not broadcast together");
    bc.out[i] = u == 1 ? v : u;
  }
  bc.C = bc.out.back();
  bc.lead.assign(bc.out.begin(), bc.out.end() - 1);
  bc.R = bc.C ? numel(bc.out) / bc.C : 0;
  for (int k = 0; k < 2; ++k) {
    bc.full[k] = x[k] == bc.out;
    bc.last1[k] = x[k].back() == 1 && bc.C != 1;
    bc.stride[k].assign(n - 1, 0);
    int64_t st = x[k].back();
    for (int64_t i = static_cast<int64_t>(n) - 2; i >= 0; --i) {
      bc.stride[k][i] = x[k][i] == 1 ? 0 : st;
      st *= x[k][i];
    }
  }
  return bc;
}

std::vector<int64_t> dims(const Shape& s) { return std::vector<int64_t>(s.begin(), s.end()); }

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_add_layer_norm", [&] {
    LNParams p = parse(a);
    *nin = 4;
    *nout = p.num_outputs();
  });
}

constexpr int kBfloat16 = kBF16;

MXReturnValue infer_type(const Attrs& a, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_add_layer_norm", [&] {
    for (size_t i = 0; i < in->size(); ++i) {
      const int t = (*in)[i];
      if (t == kF32 || t == kF16 || (i < 2 && t == kBF16)) continue;
      throw OpError(i < 2 ? "input " + std::to_string(i) + " must be float32, float16 or bfloat16, got " +
                                dtype_name(t)
                          : "input " + std::to_string(i) + " (gamma/beta) must be float32 or float16, got " +
                                dtype_name(t));
    }
    const LNParams p = parse(a);
    for (auto& t : *out) t = p.out_dtype >= 0 ? p.out_dtype : (*in)[0];
    if (p.bf16_copy) out->back() = kBfloat16;
  });
}

// Row r of operand x (0: a, 1: b) of a float32 or bfloat16 tensor as float32 C values: the
// row itself, or widened / repeated (a last axis of 1) into buf.
const float* row_f32(const MXTensor& t, const Bcast& bc, int x, int64_t r, float* buf) {
  const int64_t off = bc.offset(x, r), C = bc.C;
  const bool half = t.dtype == kBfloat16;
  if (bc.last1[x]) {
    float v;
    if (half) from_bf16(static_cast<const uint16_t*>(t.data_ptr) + off, &v, 1);
    else v = static_cast<const float*>(t.data_ptr)[off];
    std::fill(buf, buf + C, v);
    return buf;
  }
  if (!half) return static_cast<const float*>(t.data_ptr) + off;
  from_bf16(static_cast<const uint16_t*>(t.data_ptr) + off, buf, C);
  return buf;
}

#ifdef MXF_HAVE_AVX512_PATH
// One float32 row in AVX-512 (the scalar loops below run 8 lanes under the x86-64-v3 build): s =
// a + b, its mean, the variance about it (a second pass, as the scalar loop), then y and its
// bfloat16 copy from the same registers (yc: null, or y rounded as to_bf16 rounds it).
MXF_AVX512 void row_avx512(const float* a, const float* b, int64_t C, float eps, const float* G,
                           const float* Be, float* s, float* y, uint16_t* yc) {
  using vmath::tail_mask16;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask16(C - c);
    const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + c), _mm512_maskz_loadu_ps(m, b + c));
    _mm512_mask_storeu_ps(s + c, m, v);
    acc = _mm512_add_ps(acc, v);
  }
  const float mean = _mm512_reduce_add_ps(acc) / C;
  const __m512 vm = _mm512_set1_ps(mean);
  acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask16(C - c);
    const __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, s + c), vm);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(d, d));
  }
  const float rstd = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / C + eps);
  const __m512 vr = _mm512_set1_ps(rstd);
  for (int64_t c = 0; c < C; c += 16) {
    const __mmask16 m = tail_mask16(C - c);
    const __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + c), vm);
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(d, vr), _mm512_maskz_loadu_ps(m, G + c)),
                                   _mm512_maskz_loadu_ps(m, Be + c));
    _mm512_mask_storeu_ps(y + c, m, v);
    if (yc) _mm512_mask_cvtepi32_storeu_epi16(yc + c, m, vmath::bf16_bits16(_mm512_castps_si512(v)));
  }
}
#endif

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_add_layer_norm", [&] {
    // gamma and beta (C,) from the sum's last axis, as LayerNorm infers them
    require_known_input(*in, 0, "a");
    require_known_input(*in, 1, "b");
    const Bcast bc = bcast_of(dims((*in)[0]), dims((*in)[1]));
    const int64_t C = bc.C;
    fill_input(in, 2, Shape{static_cast<unsigned int>(C)}, "gamma");
    fill_input(in, 3, Shape{static_cast<unsigned int>(C)}, "beta");
    require_known_shapes(*in);
    for (int i = 2; i < 4; ++i)
      if (!((*in)[i].size() == 1 && static_cast<int64_t>((*in)[i][0]) == C))
        throw OpError(std::string(i == 2 ? "gamma" : "beta") + " must have shape (" +
                      std::to_string(C) + ",), got " + shape_str((*in)[i]));
    const Shape o(bc.out.begin(), bc.out.end());
    for (auto& t : *out) t = o;
  });
}

void forward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out);

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_add_layer_norm", [&] {
    if (!any_f16(*in, *out)) return forward_f32(a, in, out);
    Float32Call c(*in, *out);
    forward_f32(a, &c.in, &c.out);
    c.finish();
  });
}

// The forward pass on float32 and bfloat16 tensors.
void forward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
  {
    LNParams p = parse(a);
    const Bcast bc = bcast_of((*in)[0].shape, (*in)[1].shape);
    const int64_t C = bc.C, R = bc.R;
    const float *G = (*in)[2].data<float>(), *Be = (*in)[3].data<float>();
    const bool half = (*out)[0].dtype == kBfloat16;  // y and s in bfloat16
    for (int i = 2; i < 4; ++i) require_f32((*in)[i], "fused_add_layer_norm gamma/beta");
    float* Y = half ? nullptr : (*out)[0].data<float>();
    float* S = p.output_sum && !half ? (*out)[1].data<float>() : nullptr;
    uint16_t* Yh = half ? static_cast<uint16_t*>((*out)[0].data_ptr) : nullptr;
    uint16_t* Sh = half && p.output_sum ? static_cast<uint16_t*>((*out)[1].data_ptr) : nullptr;
    uint16_t* Yc = p.bf16_copy ? static_cast<uint16_t*>(out->back().data_ptr) : nullptr;
    if (Yc && out->back().dtype != kBfloat16) throw OpError("the bf16_copy output must be bfloat16");
    // A row costs a few microseconds: a small tensor (BERT's 128 x 768) runs on fewer threads
    // than the team (an OpenMP barrier costs more than the rows it would share out), and the
    // moments are summed in SIMD lanes (omp simd reductions: 16 partial sums, not one chain
    // of dependent adds).
    const int64_t kRowsPerThread = 32;
    const int threads = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(omp_get_max_threads(), R * C / (kRowsPerThread * 768))));
    const bool avx512 = cpu_has_avx512();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      thread_local std::vector<float> tmp, abuf, bbuf, ybuf;  // kept between calls
      for (auto* v : {&tmp, &abuf, &bbuf, &ybuf})
        if (v->size() < static_cast<size_t>(C)) v->resize(C);
#pragma omp for schedule(dynamic, 8)
      for (int64_t r = 0; r < R; ++r) {
        const float* ar = row_f32((*in)[0], bc, 0, r, abuf.data());
        const float* br = row_f32((*in)[1], bc, 1, r, bbuf.data());
        float* s = S ? S + r * C : tmp.data();
#ifdef MXF_HAVE_AVX512_PATH
        if (avx512 && !half) {
          row_avx512(ar, br, C, p.eps, G, Be, s, Y + r * C, Yc ? Yc + r * C : nullptr);
          continue;
        }
#endif
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
        if (Yc) to_bf16(y, Yc + r * C, C);
      }
    }
  }
}

// inputs: [dy, (dsum), a, b, gamma, beta, y, (sum)]; outputs: [da, db, dgamma, dbeta].
// ds = dL/ds per output element; da and db are ds summed over the axes their operand broadcasts.
void backward_f32(const Attrs& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out);

MXReturnValue backward(const Attrs& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                       const OpResource&) {
  return guarded("fused_add_layer_norm backward", [&] {
    if (!any_f16(*in, *out)) return backward_f32(attrs, in, out);
    Float32Call c(*in, *out);
    backward_f32(attrs, &c.in, &c.out);
    c.finish();
  });
}

void backward_f32(const Attrs& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
  {
    LNParams p = parse(attrs);
    if (p.bf16_copy) throw OpError("bf16_copy has no backward (reduced precision is for inference)");
    const int k = p.output_sum ? 2 : 1;
    for (int i = 0; i < 2; ++i)
      if ((*in)[k + i].dtype == kBfloat16)
        throw OpError("bfloat16 inputs have no backward (reduced precision is for inference)");
    const float* dY = (*in)[0].data<float>();
    const float* dS = p.output_sum ? (*in)[1].data<float>() : nullptr;
    const Bcast bc = bcast_of((*in)[k].shape, (*in)[k + 1].shape);
    const int64_t C = bc.C, R = bc.R;
    const float* G = (*in)[k + 2].data<float>();
    float* dX[2] = {(*out)[0].data<float>(), (*out)[1].data<float>()};
    const int64_t nX[2] = {numel((*in)[k].shape), numel((*in)[k + 1].shape)};
    float *dG = (*out)[2].data<float>(), *dBe = (*out)[3].data<float>();
    const int nt = omp_get_max_threads();
    // per-thread partial sums: gamma, beta, and each operand that is broadcast (summed into)
    int64_t width = 2 * C;
    int64_t at[2] = {0, 0};
    for (int x = 0; x < 2; ++x)
      if (!bc.full[x]) {
        at[x] = width;
        width += nX[x];
      }
    std::vector<float> part(static_cast<size_t>(nt) * width, 0.f);
#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num();
      float* pg = part.data() + static_cast<size_t>(t) * width;
      float* pb = pg + C;
      std::vector<float> xh(C), gg(C), ds(C), abuf(C), bbuf(C);
#pragma omp for schedule(dynamic, 8)
      for (int64_t r = 0; r < R; ++r) {
        const float* ar = row_f32((*in)[k], bc, 0, r, abuf.data());
        const float* br = row_f32((*in)[k + 1], bc, 1, r, bbuf.data());
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
        // g·γ rounded once, as summed into m1: written again here, the compiler may contract it
        // into fma(dy, γ, -m1), whose exact product leaves a rounding residue where the terms
        // cancel (one feature: 0 in the unfused graph, the residue times rstd = 1/sqrt(eps) here)
        float* d = bc.full[0] ? dX[0] + r * C : ds.data();
        for (int64_t c = 0; c < C; ++c) {
          float v = rstd * (gg[c] - m1 - xh[c] * m2);
          if (dS) v += dS[r * C + c];
          d[c] = v;
        }
        for (int x = 0; x < 2; ++x) {
          if (bc.full[x]) {
            if (x == 1) std::memcpy(dX[1] + r * C, d, sizeof(float) * C);
            continue;
          }
          float* acc = pg + at[x] + bc.offset(x, r);
          if (bc.last1[x]) {
            float tot = 0.f;
            for (int64_t c = 0; c < C; ++c) tot += d[c];
            acc[0] += tot;
          } else {
            for (int64_t c = 0; c < C; ++c) acc[c] += d[c];
          }
        }
      }
    }
    std::fill(dG, dG + C, 0.f);
    std::fill(dBe, dBe + C, 0.f);
    for (int x = 0; x < 2; ++x)
      if (!bc.full[x]) std::fill(dX[x], dX[x] + nX[x], 0.f);
    for (int t = 0; t < nt; ++t) {
      const float* pg = part.data() + static_cast<size_t>(t) * width;
      for (int64_t c = 0; c < C; ++c) { dG[c] += pg[c]; dBe[c] += pg[C + c]; }
      for (int x = 0; x < 2; ++x)
        if (!bc.full[x])
          for (int64_t i = 0; i < nX[x]; ++i) dX[x][i] += pg[at[x] + i];
    }
  }
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
