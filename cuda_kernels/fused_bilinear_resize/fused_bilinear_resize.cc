// fused_bilinear_resize: MXNet 1.9.1's _contrib_BilinearResize2D on the CPU, multithreaded and vectorized.
//
// The same output shape (every `mode`, MXNet's int16 arithmetic included), the same source
// coordinates (align_corners True/False) and the same arithmetic per output element as MXNet:
//
//   y[h2, w2] = h0 · (w0 · x[h1, w1] + w1l · x[h1, w1 + w1p])
//             + h1l · (w0 · x[h1 + h1p, w1] + w1l · x[h1 + h1p, w1 + w1p])
//
// each product and sum rounded separately, in that order, so the results are MXNet's bit for bit.
// MXNet evaluates the formula element by element; here each bracket -- a horizontal
// interpolation of one input row -- is computed once per input row and output column (the
// same value for every output row that reads that input row), then the vertical step is one
// vector loop per output row.  Equal input and output sizes are a copy, as in MXNet (the
// formula would turn a neighbouring inf into NaN).  See README.md.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mxf_common.h"

// The interpolation's products and sums are rounded separately, as MXNet's build (no FMA)
// rounds them: GCC would otherwise fuse a * b + c into one multiply-add under -march=x86-64-v3.
// That covers the coordinate tables too (computed in double, as MXNet does, then rounded).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC optimize("fp-contract=off")
#endif

using namespace mxf;

namespace {

enum class Mode { size, odd_scale, like, to_even_down, to_even_up, to_odd_down, to_odd_up };

const std::vector<std::string> kModes = {"size", "odd_scale", "like", "to_even_down",
                                         "to_even_up", "to_odd_down", "to_odd_up"};

struct ResizeParams {
  Mode mode;
  int64_t height, width;
  bool has_sh, has_sw;
  float sh, sw;
  bool align_corners;
};

// dmlc::optional<float>: absent or "None" is no value
bool optional_float(const Attrs& a, const char* name, float* v) {
  if (!has_attr(a, name) || attr_str(a, name, "") == "None") return false;
  *v = attr_float(a, name, 0.f);
  return true;
}

ResizeParams parse(const Attrs& a) {
  ResizeParams p;
  const std::string m = attr_choice(a, "mode", "size", kModes);
  p.mode = static_cast<Mode>(std::find(kModes.begin(), kModes.end(), m) - kModes.begin());
  p.height = attr_int(a, "height", 1);
  p.width = attr_int(a, "width", 1);
  if (p.height < 1 || p.height > 10000 || p.width < 1 || p.width > 10000)
    throw OpError("height and width must be in [1, 10000] (MXNet's range)");
  p.has_sh = optional_float(a, "scale_height", &p.sh);
  p.has_sw = optional_float(a, "scale_width", &p.sw);
  p.align_corners = attr_bool(a, "align_corners", true);
  return p;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_bilinear_resize", [&] {
    *nin = parse(a).mode == Mode::like ? 2 : 1;
    *nout = 1;
  });
}

// MXNet's BilinearSampleOpInferShape: the new sizes are int16_t there, computed from the
// input's dims (int64) and the float scales exactly as below.
void out_size(const ResizeParams& p, int64_t H, int64_t W, const Shape* like, int64_t* oh, int64_t* ow) {
  int16_t nh = -1, nw = -1;
  switch (p.mode) {
    case Mode::size:
      if (p.has_sh) {
        if (!p.has_sw) throw OpError("scale_height is set but scale_width is not");
        nh = static_cast<int16_t>(static_cast<int>(p.sh * H));
        nw = static_cast<int16_t>(static_cast<int>(p.sw * W));
      } else {  // MXNet reads scale_width only with scale_height
        nh = static_cast<int16_t>(p.height);
        nw = static_cast<int16_t>(p.width);
      }
      break;
    case Mode::odd_scale:
      if (!p.has_sh || !p.has_sw) throw OpError("mode odd_scale needs scale_height and scale_width");
      nh = H % 2 == 0 ? static_cast<int16_t>(H * p.sh) : static_cast<int16_t>(static_cast<int16_t>((H - 1) * p.sh) + 1);
      nw = W % 2 == 0 ? static_cast<int16_t>(W * p.sw) : static_cast<int16_t>(static_cast<int16_t>((W - 1) * p.sw) + 1);
      break;
    case Mode::like:
      nh = static_cast<int16_t>((*like)[2]);
      nw = static_cast<int16_t>((*like)[3]);
      break;
    case Mode::to_even_down:
    case Mode::to_even_up:
    case Mode::to_odd_down:
    case Mode::to_odd_up: {
      // a size of the wanted parity stays; another moves one down or up
      const bool odd = p.mode == Mode::to_odd_down || p.mode == Mode::to_odd_up;
      const int step = p.mode == Mode::to_even_down || p.mode == Mode::to_odd_down ? -1 : 1;
      nh = static_cast<int16_t>((H % 2 == 1) == odd ? H : H + step);
      nw = static_cast<int16_t>((W % 2 == 1) == odd ? W : W + step);
      break;
    }
  }
  if (nh < 1 || nw < 1)
    throw OpError("the output would be " + std::to_string(nh) + "x" + std::to_string(nw) +
                  " (MXNet makes no such array)");
  *oh = nh;
  *ow = nw;
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_bilinear_resize", [&] {
    const ResizeParams p = parse(a);
    require_known_input(*in, 0, "data");
    const Shape& d = (*in)[0];
    if (d.size() != 4) throw OpError("data must be 4-D (N, C, H, W), got " + shape_str(d));
    if (d[2] < 1 || d[3] < 1) throw OpError("data has an empty plane: " + shape_str(d));
    const Shape* like = nullptr;
    if (p.mode == Mode::like) {
      require_known_input(*in, 1, "like");
      like = &(*in)[1];
      if (like->size() < 4) throw OpError("like must have rank >= 4, got " + shape_str(*like));
    }
    int64_t oh, ow;
    out_size(p, d[2], d[3], like, &oh, &ow);
    (*out)[0] = Shape{d[0], d[1], static_cast<unsigned>(oh), static_cast<unsigned>(ow)};
  });
}

// data float32; `like` only lends its shape, of any dtype
MXReturnValue infer_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_bilinear_resize", [&] {
    if ((*in)[0] != mxnet::ext::kFloat32) throw OpError("data must be float32");
    (*out)[0] = mxnet::ext::kFloat32;
  });
}

// MXNet's area_pixel_compute_scale<float> and area_pixel_compute_source_index<float>: the
// source coordinate of output index i.  Without align_corners it is computed in double
// (scale * (i + 0.5) - 0.5, i + 0.5 a double) and rounded to float, negatives clamped to 0.
float pixel_scale(int64_t in, int64_t out, bool ac) {
  if (out > 1) return ac ? static_cast<float>(in - 1) / (out - 1) : static_cast<float>(in) / out;
  return 0.f;
}

float source_index(float scale, int64_t i, bool ac) {
  if (ac) return scale * i;
  const float s = scale * (i + 0.5) - 0.5;
  return s < 0 ? 0.f : s;
}

// Per output index along one axis: the first source index, the second (itself at the
// last source index), and the two weights, as MXNet derives them from the coordinate.
struct Axis {
  std::vector<int> i0, i1;
  std::vector<float> l0, l1;
  Axis(int64_t in, int64_t out, bool ac) : i0(out), i1(out), l0(out), l1(out) {
    const float scale = pixel_scale(in, out, ac);
    for (int64_t k = 0; k < out; ++k) {
      const float r = source_index(scale, k, ac);
      int j = static_cast<int>(r);
      const int step = j < in - 1 ? 1 : 0;
      const float lambda = r - j;
      // MXNet's index cannot pass the last row or column in exact arithmetic; kept inside
      // the input should rounding ever say otherwise (MXNet would read past its plane there)
      j = std::min<int>(j, static_cast<int>(in - 1));
      i0[k] = j;
      i1[k] = j + step;
      l1[k] = lambda;
      l0[k] = 1.f - lambda;
    }
  }
};

// a[w] = l0[w] · row[i0[w]] + l1[w] · row[i1[w]]: the horizontal step (MXNet's brackets)
void horizontal(const float* __restrict row, const Axis& ax, int64_t ow, float* __restrict a) {
  const int* i0 = ax.i0.data();
  const int* i1 = ax.i1.data();
  const float* l0 = ax.l0.data();
  const float* l1 = ax.l1.data();
  for (int64_t w = 0; w < ow; ++w) a[w] = l0[w] * row[i0[w]] + l1[w] * row[i1[w]];
}

// y[w] = h0 · a[w] + h1 · b[w]: the vertical step.  `stream`: an output far larger than the caches
// (the heads' 150 x 480 x 480 maps) is written with non-temporal stores, which skip reading each
// line before writing it; the arithmetic is the same either way (vector extensions, not contracted).
// (Through an L1 buffer, so that rows of any width stream as whole lines, it measured slower.)
void vertical(const float* __restrict a, const float* __restrict b, float h0, float h1, int64_t ow,
              float* __restrict y, bool stream) {
  int64_t w = 0;
#if defined(__AVX__) && defined(__GNUC__) && !defined(__CUDACC__)
  if (stream) {
    typedef float v8 __attribute__((vector_size(32), aligned(4)));
    for (; w < ow && (reinterpret_cast<uintptr_t>(y + w) & 31); ++w) y[w] = h0 * a[w] + h1 * b[w];
    const v8 vh0 = {h0, h0, h0, h0, h0, h0, h0, h0}, vh1 = {h1, h1, h1, h1, h1, h1, h1, h1};
    for (; w + 8 <= ow; w += 8) {
      const v8 va = *reinterpret_cast<const v8*>(a + w), vb = *reinterpret_cast<const v8*>(b + w);
      const v8 v = vh0 * va + vh1 * vb;
      _mm256_stream_ps(y + w, reinterpret_cast<__m256>(v));
    }
  }
#else
  (void)stream;
#endif
#pragma omp simd
  for (int64_t i = w; i < ow; ++i) y[i] = h0 * a[i] + h1 * b[i];
}

// Two consecutive output rows that read the same two input rows (upscaling): each element as
// vertical() computes it, the two rows in one pass over a and b.
void vertical2(const float* __restrict a, const float* __restrict b, float p0, float p1, float q0, float q1,
               int64_t ow, float* __restrict y) {
  float* __restrict y1 = y + ow;
#pragma omp simd
  for (int64_t w = 0; w < ow; ++w) {
    const float va = a[w], vb = b[w];
    y[w] = p0 * va + p1 * vb;
    y1[w] = q0 * va + q1 * vb;
  }
}

MXReturnValue forward(const Attrs& attrs, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_bilinear_resize", [&] {
    const ResizeParams p = parse(attrs);
    require_f32((*in)[0], "data");
    const auto& is = (*in)[0].shape;
    const auto& os = (*out)[0].shape;
    if (is.size() != 4 || os.size() != 4) throw OpError("data and output must be 4-D");
    const int64_t P = os[0] * os[1], IH = is[2], IW = is[3], OH = os[2], OW = os[3];
    const float* X = (*in)[0].data<float>();
    float* Y = (*out)[0].data<float>();
    if (P == 0 || OH == 0 || OW == 0) return;
    const int threads = omp_get_max_threads();
    if (IH == OH && IW == OW) {  // MXNet copies
      const int64_t n = P * OH * OW;
      const int nt = n < (1 << 18) ? 1 : threads;
      const int64_t chunk = (n + nt - 1) / nt;
#pragma omp parallel for schedule(static) num_threads(nt)
      for (int t = 0; t < nt; ++t) {
        const int64_t b = t * chunk, e = std::min(n, b + chunk);
        if (b < e) std::memcpy(Y + b, X + b, (e - b) * sizeof(float));
      }
      return;
    }
    const Axis rows(IH, OH, p.align_corners), cols(IW, OW, p.align_corners);
    // tasks: (plane, block of output rows); enough of them to share out, each block long
    // enough that its first horizontal rows (recomputed per block) are a small part of it
    const int nt = P * OH * OW < (1 << 16) ? 1 : threads;
    int64_t per_plane = 1;
    if (P < 4 * nt) per_plane = std::min<int64_t>(std::max<int64_t>(1, OH / 8), (4 * nt + P - 1) / P);
    const int64_t block = (OH + per_plane - 1) / per_plane;
    const int64_t tasks = P * per_plane;
    // (rows of whole cache lines only: a line shared by two rows would be written both ways.  Not
    // for outputs that may stay in the caches: streamed, the pyramid's 512 x 60 x 60 measured slower)
    const bool stream = OW % 16 == 0 && P * OH * OW * int64_t(sizeof(float)) > (int64_t(32) << 20);
#pragma omp parallel num_threads(nt)
    {
      // the horizontal step of the last two input rows used (row index, values)
      std::vector<float> buf(2 * OW);
      float* slot[2] = {buf.data(), buf.data() + OW};
      int64_t held[2];
#pragma omp for schedule(dynamic)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t plane = t / per_plane, h_begin = (t % per_plane) * block;
        const int64_t h_end = std::min(OH, h_begin + block);
        const float* x = X + plane * IH * IW;
        float* y = Y + plane * OH * OW;
        held[0] = held[1] = -1;
        auto row = [&](int64_t r) -> const float* {
          if (held[0] == r) return slot[0];
          if (held[1] == r) return slot[1];
          // replace the row not needed any more: rows are read in increasing order
          const int k = held[0] < held[1] ? 0 : 1;
          horizontal(x + r * IW, cols, OW, slot[k]);
          held[k] = r;
          return slot[k];
        };
        for (int64_t h = h_begin; h < h_end;) {
          const int r0 = rows.i0[h], r1 = rows.i1[h];
          const float* a = row(r0);
          const float* b = row(r1);  // r1 is r0 or r0 + 1: it never evicts r0
          if (!stream && h + 1 < h_end && rows.i0[h + 1] == r0 && rows.i1[h + 1] == r1) {
            vertical2(a, b, rows.l0[h], rows.l1[h], rows.l0[h + 1], rows.l1[h + 1], OW, y + h * OW);
            h += 2;
          } else {
            vertical(a, b, rows.l0[h], rows.l1[h], OW, y + h * OW, stream);
            h += 1;
          }
        }
      }
#if defined(__AVX__) && defined(__GNUC__) && !defined(__CUDACC__)
      if (stream) _mm_sfence();  // the streamed stores are seen before the op returns
#endif
    }
  });
}

}  // namespace

REGISTER_OP(fused_bilinear_resize)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
