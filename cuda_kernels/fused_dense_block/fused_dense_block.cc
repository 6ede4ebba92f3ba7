// fused_dense_block: DenseNet's dense block as one op, its convolutions run by oneDNN 3.x over one
// NHWC concatenation buffer that is never copied.
//
//   cat = x                                                        (N, C0, H, W)
//   for l in 0 .. L-1:                                             Cl = C0 + l * k
//     a   = relu(cat * s_l + t_l)                                  (N, Cl, H, W)   pre-activation BN
//           (NaN gives 0 as Activation(relu) does, or stays NaN as the relu op does: pre_act)
//     h   = relu(conv1x1(a, W1_l) + b1_l)                          (N, B, H, W)    post-conv BN folded
//     new = conv3x3(h, W2_l, pad 1) + b2_l                         (N, k, H, W)
//     cat = concat(cat, new, axis 1)
//   y = cat | relu(cat * s + t) (post_act)                         (N, C0 + L * k, H, W)
//
// Per call: x is reordered NCHW -> its channels of one buffer of all C0 + L * k channels; per layer
// one pass applies the scale-shift-relu to the channels so far (into a scratch tensor), the 1x1
// convolution runs with its bias and relu as post-ops, the 3x3 convolution writes its k channels
// into the buffer; the buffer is reordered back to NCHW once.  When C0, k and B are multiples of 16
// (DenseNet's), one sample at a time through an nChw16c buffer, where channels [C, C + k) are
// contiguous and the 3x3 convolution writes them in place; otherwise NHWC for the whole batch, the
// 3x3 convolution's k channels copied into the buffer.  The primitives are created
// once per input shape and the weights reordered into oneDNN's layouts once per weight version (op
// state).  MXNet 1.9.1's own oneDNN ops reorder every piece of every concatenation out of their
// blocked layout when a Concat or BatchNorm reads it; see README.md for figures.  Without oneDNN's
// API (or with MXFUSION_NO_DNNL_CONV=1) direct loops compute the same, slowly.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "dnnl_api.h"
#include "dnnl_blocks.h"
#include "mxf_common.h"

using namespace mxf;

namespace {

struct Params {
  int64_t L, k, B;  // layers, growth, bottleneck width
  bool nhwc;        // layout=nhwc: never the blocked buffer
  bool nan_relu;    // pre_act=relu: the pre-activation keeps NaN (MXNet's relu op); act_relu: NaN gives 0
  int post;         // post_act: 0 none, 1 act_relu, 2 relu (NaN kept): y = relu(cat * s + t), two more inputs
};

Params parse(const Attrs& a) {
  Params p;
  p.L = attr_int(a, "num_layers", 0);
  p.k = attr_int(a, "growth", 0);
  p.B = attr_int(a, "bottleneck", 0);
  p.nhwc = attr_choice(a, "layout", "auto", {"auto", "nhwc"}) == "nhwc";
  p.nan_relu = attr_choice(a, "pre_act", "act_relu", {"act_relu", "relu"}) == "relu";
  const std::string post = attr_choice(a, "post_act", "none", {"none", "act_relu", "relu"});
  p.post = post == "none" ? 0 : (post == "act_relu" ? 1 : 2);
  if (p.L < 1 || p.L > 256) throw OpError("num_layers must be in [1, 256]");
  if (p.k < 1 || p.B < 1) throw OpError("growth and bottleneck must be positive");
  return p;
}

// input slots: x, then per layer s, t, W1, b1, W2, b2
constexpr int kPerLayer = 6;
inline int slot(int64_t l, int j) { return 1 + static_cast<int>(l) * kPerLayer + j; }
inline int num_inputs(const Params& p) { return 1 + static_cast<int>(p.L) * kPerLayer + (p.post ? 2 : 0); }

struct Geometry {
  int64_t N, C0, H, W, Ct;
};

Geometry geometry(const Params& p, const Shape& x) {
  Geometry g;
  g.N = x[0], g.C0 = x[1], g.H = x[2], g.W = x[3];
  g.Ct = g.C0 + p.L * p.k;
  return g;
}

// MXNet's relu op keeps NaN; Activation(relu) (oneDNN's) gives 0 for it
inline float pre_relu(float v, bool keep_nan) { return v > 0.f ? v : (keep_nan && v != v ? v : 0.f); }

// a = relu(cat[:, :C] * s + t) for NHWC cat (row stride Ct) into NHWC a (row stride C)
void scale_shift_relu(const float* cat, int64_t Ct, int64_t C, int64_t rows, const float* s, const float* t,
                      float* a, bool keep_nan) {
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = cat + i * Ct;
    float* dst = a + i * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) {
      dst[c] = pre_relu(src[c] * s[c] + t[c], keep_nan);
    }
  }
}

// the same for the first C channels of a per-sample nChw16c buffer (C % 16 == 0): contiguous, so
// one pass of 16-lane rows, the 16 scales and shifts of the row's channel block
void scale_shift_relu_blocked(const float* cat, int64_t C, int64_t HW, const float* s, const float* t, float* a,
                              bool keep_nan) {
  const int64_t rows = (C / 16) * HW;
#pragma omp parallel for
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t cb = r / HW;
    const float* sc = s + cb * 16;
    const float* sh = t + cb * 16;
    const float* src = cat + r * 16;
    float* dst = a + r * 16;
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      dst[j] = pre_relu(src[j] * sc[j] + sh[j], keep_nan);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// oneDNN path


struct Layer {
  dnnl_primitive_t c1 = nullptr, c2 = nullptr, rw1 = nullptr, rw2 = nullptr;
  dnnl_memory_t a = nullptr, u_w1 = nullptr, w1 = nullptr, b1 = nullptr, u_w2 = nullptr, w2 = nullptr,
                b2 = nullptr;
};

struct Block : DnnlObjects {
  std::vector<Layer> layers;
  dnnl_primitive_t r_in = nullptr, r_out = nullptr;
  dnnl_memory_t u_x = nullptr, u_y = nullptr, x_in_cat = nullptr, cat = nullptr, h = nullptr, nw = nullptr;
  std::vector<float> scratch;  // the pre-activation of the widest layer (NHWC | nChw16c)
  // blocked mode (C0, k, B multiples of 16): one sample at a time, the concatenation one nChw16c
  // buffer whose channel range [C, C + k) is contiguous, so each 3x3 convolution writes its k
  // channels in place
  bool blocked = false;
  std::vector<dnnl_memory_t> slice;  // per layer: the buffer's channels [C, C + k) (nChw16c)
  std::mutex mu;
  std::vector<ParamVersion> weight_version;  // the weights the layers hold (w1, w2 of each)

  // a stride-1 convolution over NHWC src/dst with bias, [relu], weights in the layout oneDNN picks;
  // *uw_mem / *w_mem / *b_mem: the user's weight, the packed weight, the bias; *rw: the weight reorder
  dnnl_primitive_t conv(const_dnnl_memory_desc_t src, const_dnnl_memory_desc_t dst, const dnnl_dims_t wd,
                        int64_t O, int64_t P, bool relu, dnnl_primitive_t* rw, dnnl_memory_t* uw_mem,
                        dnnl_memory_t* w_mem, dnnl_memory_t* b_mem) {
    const dnnl_dims_t bd = {O};
    const_dnnl_memory_desc_t wany = md(4, wd, dnnl_format_tag_any), uw = md(4, wd, dnnl_oihw), bmd = md(1, bd, dnnl_a);
    if (!wany || !uw || !bmd) return nullptr;
    dnnl_post_ops_t po = nullptr;
    dnnl_primitive_attr_t attr = nullptr;
    bool ok = MXF_OK(api.dnnl_primitive_attr_create(&attr)) && MXF_OK(api.dnnl_post_ops_create(&po));
    if (ok && relu) ok = MXF_OK(api.dnnl_post_ops_append_eltwise(po, dnnl_eltwise_relu, 0.f, 0.f));
    if (ok) ok = MXF_OK(api.dnnl_primitive_attr_set_post_ops(attr, po));
    const dnnl_dims_t strides = {1, 1}, dil = {0, 0}, pad = {P, P};
    dnnl_primitive_desc_t pd = nullptr;
    if (ok)
      ok = MXF_OK(api.dnnl_convolution_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference,
                                                                     dnnl_convolution_direct, src, wany, bmd, dst,
                                                                     strides, dil, pad, pad, attr));
    if (po) api.dnnl_post_ops_destroy(po);
    if (attr) api.dnnl_primitive_attr_destroy(attr);
    if (!ok) return nullptr;
    pds.push_back(pd);
    dnnl_primitive_t c = prim(pd);
    const_dnnl_memory_desc_t cw = api.dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0),
                             cs = api.dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                             cd = api.dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
    if (!c || !cw || !api.dnnl_memory_desc_equal(cs, src) || !api.dnnl_memory_desc_equal(cd, dst)) return nullptr;
    if (!reorder(uw, cw, rw)) return nullptr;
    *uw_mem = mem(uw, nullptr);
    *w_mem = *rw ? mem(cw, DNNL_MEMORY_ALLOCATE) : *uw_mem;
    *b_mem = mem(bmd, nullptr);
    return (*uw_mem && *w_mem && *b_mem) ? c : nullptr;
  }

  // whether oneDNN has optimised (not reference) code for a stride-1 convolution of `in` to `out`
  // channels, kernel `K`, over nChw16c src and dst (its AVX-512 kernels; a CPU without AVX-512 has
  // none, and the block then runs NHWC)
  bool blocked_conv_fast(int64_t in, int64_t out, int64_t K, int64_t H, int64_t W) {
    const dnnl_dims_t sd = {1, in, H, W}, dd = {1, out, H, W}, wd = {out, in, K, K}, bd = {out};
    const_dnnl_memory_desc_t s = md(4, sd, dnnl_nChw16c), d = md(4, dd, dnnl_nChw16c),
                             w = md(4, wd, dnnl_format_tag_any), b = md(1, bd, dnnl_a);
    if (!s || !d || !w || !b) return false;
    const int64_t P = K / 2;
    const dnnl_dims_t strides = {1, 1}, dil = {0, 0}, pad = {P, P};
    dnnl_primitive_desc_t pd = nullptr;
    if (!MXF_OK(api.dnnl_convolution_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference,
                                                                   dnnl_convolution_direct, s, w, b, d, strides,
                                                                   dil, pad, pad, nullptr)))
      return false;
    const bool fast = !dnnl_reference_impl(pd);
    api.dnnl_primitive_desc_destroy(pd);
    return fast;
  }

  bool create(const Params& p, const Geometry& g) {
    if (!p.nhwc && g.C0 % 16 == 0 && p.k % 16 == 0 && p.B % 16 == 0 &&
        blocked_conv_fast(g.C0, p.B, 1, g.H, g.W) && blocked_conv_fast(p.B, p.k, 3, g.H, g.W)) {
      blocked = true;
      return create_blocked(p, g);
    }
    const int64_t N = g.N, H = g.H, W = g.W, Ct = g.Ct, B = p.B, k = p.k;
    const dnnl_dims_t xd = {N, g.C0, H, W}, yd = {N, Ct, H, W}, hd = {N, B, H, W}, nd = {N, k, H, W};
    const dnnl_dims_t in_cat = {H * W * Ct, 1, W * Ct, Ct};  // x's channels inside the NHWC buffer
    const_dnnl_memory_desc_t ux = md(4, xd, dnnl_nchw), xc = strided(xd, in_cat), uy = md(4, yd, dnnl_nchw),
                             cn = md(4, yd, dnnl_nhwc), hn = md(4, hd, dnnl_nhwc), nn = md(4, nd, dnnl_nhwc);
    if (!ux || !xc || !uy || !cn || !hn || !nn) return false;
    cat = mem(cn, DNNL_MEMORY_ALLOCATE);
    h = mem(hn, DNNL_MEMORY_ALLOCATE);
    nw = mem(nn, DNNL_MEMORY_ALLOCATE);
    if (!cat || !h || !nw) return false;
    void* base = nullptr;
    if (!MXF_OK(api.dnnl_memory_get_data_handle(cat, &base))) return false;
    x_in_cat = mem(xc, base);
    u_x = mem(ux, nullptr);
    u_y = mem(uy, nullptr);
    if (!x_in_cat || !u_x || !u_y || !reorder(ux, xc, &r_in) || !reorder(cn, uy, &r_out) || !r_in || !r_out)
      return false;
    const int64_t Cmax = g.C0 + (p.L - 1) * k;
    scratch.assign(static_cast<size_t>(N * H * W * Cmax), 0.f);
    layers.resize(static_cast<size_t>(p.L));
    for (int64_t l = 0; l < p.L; ++l) {
      Layer& ly = layers[static_cast<size_t>(l)];
      const int64_t C = g.C0 + l * k;
      const dnnl_dims_t ad = {N, C, H, W}, w1d = {B, C, 1, 1}, w2d = {k, B, 3, 3};
      const_dnnl_memory_desc_t an = md(4, ad, dnnl_nhwc);
      ly.a = mem(an, scratch.data());
      if (!ly.a) return false;
      ly.c1 = conv(an, hn, w1d, B, 0, true, &ly.rw1, &ly.u_w1, &ly.w1, &ly.b1);
      ly.c2 = conv(hn, nn, w2d, k, 1, false, &ly.rw2, &ly.u_w2, &ly.w2, &ly.b2);
      if (!ly.c1 || !ly.c2) return false;
    }
    return true;
  }

  bool create_blocked(const Params& p, const Geometry& g) {
    const int64_t H = g.H, W = g.W, Ct = g.Ct, B = p.B, k = p.k, HW = H * W;
    const dnnl_dims_t xd = {1, g.C0, H, W}, yd = {1, Ct, H, W}, hd = {1, B, H, W}, nd = {1, k, H, W};
    const_dnnl_memory_desc_t ux = md(4, xd, dnnl_nchw), xb = md(4, xd, dnnl_nChw16c), uy = md(4, yd, dnnl_nchw),
                             cb = md(4, yd, dnnl_nChw16c), hb = md(4, hd, dnnl_nChw16c),
                             nb = md(4, nd, dnnl_nChw16c);
    if (!ux || !xb || !uy || !cb || !hb || !nb) return false;
    cat = mem(cb, DNNL_MEMORY_ALLOCATE);
    h = mem(hb, DNNL_MEMORY_ALLOCATE);
    if (!cat || !h) return false;
    void* base = nullptr;
    if (!MXF_OK(api.dnnl_memory_get_data_handle(cat, &base))) return false;
    x_in_cat = mem(xb, base);  // channels [0, C0): the buffer's start
    u_x = mem(ux, nullptr);
    u_y = mem(uy, nullptr);
    if (!x_in_cat || !u_x || !u_y || !reorder(ux, xb, &r_in) || !reorder(cb, uy, &r_out) || !r_in || !r_out)
      return false;
    const int64_t Cmax = g.C0 + (p.L - 1) * k;
    scratch.assign(static_cast<size_t>(HW * Cmax), 0.f);
    layers.resize(static_cast<size_t>(p.L));
    for (int64_t l = 0; l < p.L; ++l) {
      Layer& ly = layers[static_cast<size_t>(l)];
      const int64_t C = g.C0 + l * k;
      const dnnl_dims_t ad = {1, C, H, W}, w1d = {B, C, 1, 1}, w2d = {k, B, 3, 3};
      const_dnnl_memory_desc_t ab = md(4, ad, dnnl_nChw16c);
      ly.a = mem(ab, scratch.data());
      slice.push_back(mem(nb, static_cast<float*>(base) + C * HW));
      if (!ly.a || !slice.back()) return false;
      ly.c1 = conv(ab, hb, w1d, B, 0, true, &ly.rw1, &ly.u_w1, &ly.w1, &ly.b1);
      ly.c2 = conv(hb, nb, w2d, k, 1, false, &ly.rw2, &ly.u_w2, &ly.w2, &ly.b2);
      if (!ly.c1 || !ly.c2) return false;
    }
    return true;
  }

  // one sample through the blocked buffer: x (C0, H, W) and y (Ct, H, W) NCHW
  bool run_blocked(const Params& p, const Geometry& g, const float* x, float* y, std::vector<MXTensor>& in,
                   dnnl_stream_t s) {
    if (!MXF_OK(api.dnnl_memory_set_data_handle(u_x, const_cast<float*>(x))) ||
        !MXF_OK(api.dnnl_memory_set_data_handle(u_y, y)))
      return false;
    if (!exec(r_in, s, {{DNNL_ARG_FROM, u_x}, {DNNL_ARG_TO, x_in_cat}}) || !MXF_OK(api.dnnl_stream_wait(s)))
      return false;
    void* cp = nullptr;
    if (!MXF_OK(api.dnnl_memory_get_data_handle(cat, &cp))) return false;
    const float* catp = static_cast<const float*>(cp);
    const int64_t HW = g.H * g.W;
    for (int64_t l = 0; l < p.L; ++l) {
      Layer& ly = layers[static_cast<size_t>(l)];
      const int64_t C = g.C0 + l * p.k;
      scale_shift_relu_blocked(catp, C, HW, in[slot(l, 0)].data<float>(), in[slot(l, 1)].data<float>(),
                               scratch.data(), p.nan_relu);
      if (!exec(ly.c1, s, {{DNNL_ARG_SRC, ly.a}, {DNNL_ARG_WEIGHTS, ly.w1}, {DNNL_ARG_BIAS, ly.b1},
                           {DNNL_ARG_DST, h}}) ||
          !exec(ly.c2, s, {{DNNL_ARG_SRC, h}, {DNNL_ARG_WEIGHTS, ly.w2}, {DNNL_ARG_BIAS, ly.b2},
                           {DNNL_ARG_DST, slice[static_cast<size_t>(l)]}}) ||
          !MXF_OK(api.dnnl_stream_wait(s)))
        return false;
    }
    if (p.post)  // in place: the buffer's last reader is the reorder below
      scale_shift_relu_blocked(catp, g.Ct, HW, in[slot(p.L, 0)].data<float>(), in[slot(p.L, 1)].data<float>(),
                               const_cast<float*>(catp), p.post == 2);
    return exec(r_out, s, {{DNNL_ARG_FROM, cat}, {DNNL_ARG_TO, u_y}}) && MXF_OK(api.dnnl_stream_wait(s));
  }

  bool exec(dnnl_primitive_t pr, dnnl_stream_t s, std::initializer_list<dnnl_exec_arg_t> args) {
    return MXF_OK(api.dnnl_primitive_execute(pr, s, static_cast<int>(args.size()), args.begin()));
  }

  bool run(const Params& p, const Geometry& g, const float* x, float* y, std::vector<MXTensor>& in) {
    std::lock_guard<std::mutex> lk(mu);
    dnnl_stream_t s = dnnl_thread_stream();
    if (!s) return false;
    weight_version.resize(static_cast<size_t>(2 * p.L));
    bool repack = false;
    for (int64_t l = 0; l < p.L; ++l)      // every weight asked (each keeps its own record)
      for (int j : {0, 1})
        if (weight_version[static_cast<size_t>(2 * l + j)].changed(in[slot(l, 2 + 2 * j)])) repack = true;
    auto unpacked = [&] {                  // a pack that failed: the next call packs again
      for (auto& v : weight_version) v.forget();
      return false;
    };
    for (int64_t l = 0; l < p.L; ++l) {
      Layer& ly = layers[static_cast<size_t>(l)];
      if (!MXF_OK(api.dnnl_memory_set_data_handle(ly.u_w1, in[slot(l, 2)].data_ptr)) ||
          !MXF_OK(api.dnnl_memory_set_data_handle(ly.b1, in[slot(l, 3)].data_ptr)) ||
          !MXF_OK(api.dnnl_memory_set_data_handle(ly.u_w2, in[slot(l, 4)].data_ptr)) ||
          !MXF_OK(api.dnnl_memory_set_data_handle(ly.b2, in[slot(l, 5)].data_ptr)))
        return unpacked();
      if (repack && ly.rw1 && !exec(ly.rw1, s, {{DNNL_ARG_FROM, ly.u_w1}, {DNNL_ARG_TO, ly.w1}})) return unpacked();
      if (repack && ly.rw2 && !exec(ly.rw2, s, {{DNNL_ARG_FROM, ly.u_w2}, {DNNL_ARG_TO, ly.w2}})) return unpacked();
    }
    if (blocked) {
      for (int64_t n = 0; n < g.N; ++n)
        if (!run_blocked(p, g, x + n * g.C0 * g.H * g.W, y + n * g.Ct * g.H * g.W, in, s)) return false;
      return true;
    }
    if (!MXF_OK(api.dnnl_memory_set_data_handle(u_x, const_cast<float*>(x))) ||
        !MXF_OK(api.dnnl_memory_set_data_handle(u_y, y)))
      return false;
    if (!exec(r_in, s, {{DNNL_ARG_FROM, u_x}, {DNNL_ARG_TO, x_in_cat}}) || !MXF_OK(api.dnnl_stream_wait(s)))
      return false;
    void *cp = nullptr, *np = nullptr;
    if (!MXF_OK(api.dnnl_memory_get_data_handle(cat, &cp)) || !MXF_OK(api.dnnl_memory_get_data_handle(nw, &np)))
      return false;
    float* catp = static_cast<float*>(cp);
    const float* newp = static_cast<const float*>(np);
    const int64_t rows = g.N * g.H * g.W, Ct = g.Ct, k = p.k;
    for (int64_t l = 0; l < p.L; ++l) {
      Layer& ly = layers[static_cast<size_t>(l)];
      const int64_t C = g.C0 + l * k;
      scale_shift_relu(catp, Ct, C, rows, in[slot(l, 0)].data<float>(), in[slot(l, 1)].data<float>(),
                       scratch.data(), p.nan_relu);
      if (!exec(ly.c1, s, {{DNNL_ARG_SRC, ly.a}, {DNNL_ARG_WEIGHTS, ly.w1}, {DNNL_ARG_BIAS, ly.b1},
                           {DNNL_ARG_DST, h}}) ||
          !exec(ly.c2, s, {{DNNL_ARG_SRC, h}, {DNNL_ARG_WEIGHTS, ly.w2}, {DNNL_ARG_BIAS, ly.b2},
                           {DNNL_ARG_DST, nw}}) ||
          !MXF_OK(api.dnnl_stream_wait(s)))
        return false;
#pragma omp parallel for
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(catp + i * Ct + C, newp + i * k, static_cast<size_t>(k) * sizeof(float));
    }
    if (p.post)  // in place (row stride Ct both ways)
      scale_shift_relu(catp, Ct, Ct, rows, in[slot(p.L, 0)].data<float>(), in[slot(p.L, 1)].data<float>(), catp,
                       p.post == 2);
    if (!exec(r_out, s, {{DNNL_ARG_FROM, cat}, {DNNL_ARG_TO, u_y}})) return false;
    return MXF_OK(api.dnnl_stream_wait(s));
  }
};

// ---------------------------------------------------------------------------------------------
// Direct loops (no oneDNN): NCHW, y itself is the concatenation.

void direct(const Params& p, const Geometry& g, const float* x, float* y, std::vector<MXTensor>& in) {
  const int64_t N = g.N, HW = g.H * g.W, Ct = g.Ct, B = p.B, k = p.k, H = g.H, W = g.W;
  for (int64_t n = 0; n < N; ++n) std::memcpy(y + n * Ct * HW, x + n * g.C0 * HW, sizeof(float) * g.C0 * HW);
  std::vector<float> a(static_cast<size_t>(Ct * HW)), hb(static_cast<size_t>(B * HW));
  for (int64_t l = 0; l < p.L; ++l) {
    const int64_t C = g.C0 + l * k;
    const float *s = in[slot(l, 0)].data<float>(), *t = in[slot(l, 1)].data<float>(),
                *W1 = in[slot(l, 2)].data<float>(), *b1 = in[slot(l, 3)].data<float>(),
                *W2 = in[slot(l, 4)].data<float>(), *b2 = in[slot(l, 5)].data<float>();
    for (int64_t n = 0; n < N; ++n) {
      float* yn = y + n * Ct * HW;
#pragma omp parallel for
      for (int64_t c = 0; c < C; ++c)
        for (int64_t i = 0; i < HW; ++i) {
          a[c * HW + i] = pre_relu(yn[c * HW + i] * s[c] + t[c], p.nan_relu);
        }
#pragma omp parallel for
      for (int64_t o = 0; o < B; ++o) {
        float* r = hb.data() + o * HW;
        for (int64_t i = 0; i < HW; ++i) r[i] = b1[o];
        for (int64_t c = 0; c < C; ++c) {
          const float wv = W1[o * C + c];
          const float* ar = a.data() + c * HW;
          for (int64_t i = 0; i < HW; ++i) r[i] += wv * ar[i];
        }
        for (int64_t i = 0; i < HW; ++i) r[i] = r[i] > 0.f ? r[i] : 0.f;
      }
#pragma omp parallel for
      for (int64_t o = 0; o < k; ++o) {
        float* r = yn + (C + o) * HW;
        for (int64_t i = 0; i < HW; ++i) r[i] = b2[o];
        for (int64_t c = 0; c < B; ++c) {
          const float* hr = hb.data() + c * HW;
          for (int64_t kh = 0; kh < 3; ++kh)
            for (int64_t kw = 0; kw < 3; ++kw) {
              const float wv = W2[((o * B + c) * 3 + kh) * 3 + kw];
              for (int64_t oh = 0; oh < H; ++oh) {
                const int64_t ih = oh - 1 + kh;
                if (ih < 0 || ih >= H) continue;
                for (int64_t ow = 0; ow < W; ++ow) {
                  const int64_t iw = ow - 1 + kw;
                  if (iw >= 0 && iw < W) r[oh * W + ow] += wv * hr[ih * W + iw];
                }
              }
            }
        }
      }
    }
  }
  if (p.post) {
    const float *s = in[slot(p.L, 0)].data<float>(), *t = in[slot(p.L, 1)].data<float>();
    for (int64_t n = 0; n < N; ++n)
#pragma omp parallel for
      for (int64_t c = 0; c < Ct; ++c)
        for (int64_t i = 0; i < HW; ++i) {
          float* v = y + (n * Ct + c) * HW + i;
          *v = pre_relu(*v * s[c] + t[c], p.post == 2);
        }
  }
}

// ---------------------------------------------------------------------------------------------

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_dense_block", [&] {
    *nin = num_inputs(parse(a));
    *nout = 1;
  });
}

void expect(const Shape& got, const Shape& want, const char* what, int64_t l) {
  if (got != want)
    throw OpError("layer " + std::to_string(l) + ": " + what + " must be " + shape_str(want) + ", got " +
                  shape_str(got));
}

MXReturnValue infer_shape(const Attrs& attrs, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_dense_block", [&] {
    const Params p = parse(attrs);
    require_known_input(*in, 0, "x");
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, C, H, W), got " + shape_str(x));
    const unsigned B = static_cast<unsigned>(p.B), k = static_cast<unsigned>(p.k);
    // every layer's parameters from x, growth and bottleneck (the layer's channels so far)
    for (int64_t l = 0; l <= p.L; ++l) {
      const unsigned C = x[1] + static_cast<unsigned>(l) * k;
      if (l == p.L) {
        if (p.post) {
          fill_input(in, slot(l, 0), Shape{C, 1, 1}, "the output's scale");
          fill_input(in, slot(l, 1), Shape{C, 1, 1}, "the output's shift");
        }
        break;
      }
      fill_input(in, slot(l, 0), Shape{C, 1, 1}, "a pre-activation scale");
      fill_input(in, slot(l, 1), Shape{C, 1, 1}, "a pre-activation shift");
      fill_input(in, slot(l, 2), Shape{B, C, 1, 1}, "a 1x1 weight");
      fill_input(in, slot(l, 3), Shape{B}, "a 1x1 bias");
      fill_input(in, slot(l, 4), Shape{k, B, 3, 3}, "a 3x3 weight");
      fill_input(in, slot(l, 5), Shape{k}, "a 3x3 bias");
    }
    require_known_shapes(*in);
    for (int64_t l = 0; l < p.L; ++l) {
      const unsigned C = x[1] + static_cast<unsigned>(l) * k;
      expect((*in)[slot(l, 0)], Shape{C, 1, 1}, "the pre-activation scale", l);
      expect((*in)[slot(l, 1)], Shape{C, 1, 1}, "the pre-activation shift", l);
      expect((*in)[slot(l, 2)], Shape{B, C, 1, 1}, "the 1x1 weight", l);
      expect((*in)[slot(l, 3)], Shape{B}, "the 1x1 bias", l);
      expect((*in)[slot(l, 4)], Shape{k, B, 3, 3}, "the 3x3 weight", l);
      expect((*in)[slot(l, 5)], Shape{k}, "the 3x3 bias", l);
    }
    const unsigned Ct = x[1] + static_cast<unsigned>(p.L) * k;
    if (p.post) {
      expect((*in)[slot(p.L, 0)], Shape{Ct, 1, 1}, "the output's scale", p.L);
      expect((*in)[slot(p.L, 1)], Shape{Ct, 1, 1}, "the output's shift", p.L);
    }
    (*out)[0] = Shape{x[0], Ct, x[2], x[3]};
  });
}

class DenseBlockOp : public mxnet::ext::CustomStatefulOp {
 public:
  explicit DenseBlockOp(const Attrs& a) : p_(parse(a)) {}

  MXReturnValue Forward(std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) override {
    return guarded("fused_dense_block", [&] {
      for (auto& t : *in) require_f32(t, "fused_dense_block input");
      const auto& xs = (*in)[0].shape;
      const Geometry g = geometry(p_, Shape(xs.begin(), xs.end()));
      const float* x = (*in)[0].data<float>();
      float* y = (*out)[0].data<float>();
      Block* b = block(g);
      if (!b || !b->run(p_, g, x, y, *in)) direct(p_, g, x, y, *in);
    });
  }

  // Fused for inference only (the rule refuses training): the refusal every such op gives.
  MXReturnValue Backward(std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource& res) override {
    return inference_only_backward(Attrs(), in, out, res);
  }

 private:
  Block* block(const Geometry& g) { return blocks_.get({g.N, g.C0, g.H, g.W}, p_, g); }

  Params p_;
  BlockCache<Block> blocks_;
};

MXReturnValue create_state(const Attrs& a, const mxnet::ext::MXContext&, const std::vector<Shape>&,
                           const std::vector<int>, mxnet::ext::CustomStatefulOp** op) {
  return guarded("fused_dense_block", [&] { *op = mxnet::ext::CustomStatefulOp::create<DenseBlockOp>(a); });
}

}  // namespace

REGISTER_OP(fused_dense_block)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setCreateOpState(create_state, "cpu");
