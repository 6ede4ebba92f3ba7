// fused_inverted_residual: MobileNet's inverted-residual block as one op, run by oneDNN 3.x with the
// activations kept in one layout (NHWC) from the block's input to its output.
//
//   a = act(conv1x1(x, We) + be)                     [expand]   (N, E, H, W)
//   d = act(dwconv_KxK(a, Wd, stride S, pad P) + bd)            (N, E, OH, OW)
//   [SE]  p = mean_{h,w} d;  h = relu(W1 p + b1);  g = clip(W2 h + b2 + add, lo, hi) / div;  d *= g
//   y = conv1x1(d, Wp) + bp  [+ x]                   [residual]  (N, O, OH, OW)
//
// act: relu, or hard-swish x * clip(x + 3, 0, 6) / 6 (oneDNN's eltwise_hardswish with
// alpha = 1/6, beta = 1/2).  Per call: x is reordered NCHW -> NHWC once, the three convolutions
// run with their bias and activation (and the residual add, a binary post-op reading the
// reordered x) fused, the SE pool/gate/scale run on the NHWC map in place, and y is reordered
// back to NCHW once.  The primitives are created once per input shape and the weights reordered
// into oneDNN's layouts once per weight version (op state).  MXNet 1.9.1's own oneDNN ops pay a
// layout reorder at each op boundary and have no hard-swish post-op; see README.md for figures.
// Without oneDNN's API (or with MXFUSION_NO_DNNL_CONV=1) direct loops compute the same, slowly.
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
  bool expand, se, residual, hswish;
  int64_t K, S, P, E, O;
  ClipGate clip;  // the SE gate
};

Params parse(const Attrs& a) {
  Params p;
  p.expand = attr_bool(a, "expand", true);
  p.se = attr_bool(a, "se", false);
  p.residual = attr_bool(a, "residual", false);
  p.hswish = attr_choice(a, "act", "relu", {"relu", "hard_swish"}) == "hard_swish";
  p.K = attr_int(a, "kernel", 3);
  p.S = attr_int(a, "stride", 1);
  p.P = attr_int(a, "pad", (p.K - 1) / 2);
  p.E = attr_int(a, "num_expand", 0);
  p.O = attr_int(a, "num_filter", 0);
  p.clip = parse_clip_gate(a);
  if (p.K < 1 || p.S < 1 || p.P < 0) throw OpError("kernel and stride must be positive and pad non-negative");
  if (p.E < 1 || p.O < 1) throw OpError("num_expand and num_filter must be positive");
  return p;
}

// input slots: x, [We, be], Wd, bd, [W1, b1, W2, b2], Wp, bp
struct Slots {
  int we = -1, be = -1, wd, bd, w1 = -1, b1 = -1, w2 = -1, b2 = -1, wp, bp, n;
};
Slots slots(const Params& p) {
  Slots s;
  int k = 1;
  if (p.expand) s.we = k++, s.be = k++;
  s.wd = k++, s.bd = k++;
  if (p.se) s.w1 = k++, s.b1 = k++, s.w2 = k++, s.b2 = k++;
  s.wp = k++, s.bp = k++;
  s.n = k;
  return s;
}

struct Geometry {
  int64_t N, C, H, W, OH, OW, M;  // M: the SE's hidden width (0 without SE)
};

Geometry geometry(const Params& p, const std::vector<Shape>& in, const Slots& s) {
  const Shape& x = in[0];
  Geometry g;
  g.N = x[0], g.C = x[1], g.H = x[2], g.W = x[3];
  g.OH = (g.H + 2 * p.P - p.K) / p.S + 1;
  g.OW = (g.W + 2 * p.P - p.K) / p.S + 1;
  g.M = p.se ? static_cast<int64_t>(in[s.w1][0]) : 0;
  return g;
}

template <class T>
std::vector<Shape> shapes_of(const std::vector<T>& ts) {
  std::vector<Shape> out;
  for (const auto& t : ts) out.emplace_back(t.shape.begin(), t.shape.end());
  return out;
}

inline float hard_swish(float v) {  // GluonCV's: x * (clip(x + 3, 0, 6) / 6)
  float t = v + 3.f;
  t = t < 0.f ? 0.f : (t > 6.f ? 6.f : t);
  return v * (t / 6.f);
}
inline float act(const Params& p, float v) { return p.hswish ? hard_swish(v) : (v > 0.f ? v : 0.f); }

// SE on an NHWC map d (N, HW, E) in place: pool, the two small layers, the gate, the scale.
void squeeze_excite(const Params& p, const Geometry& g, const float* W1, const float* b1, const float* W2,
                    const float* b2, float* d) {
  const int64_t E = p.E, M = g.M, HW = g.OH * g.OW;
  std::vector<float> pooled(E), hidden(M), gate(E);
  for (int64_t n = 0; n < g.N; ++n) {
    float* dn = d + n * HW * E;
    std::fill(pooled.begin(), pooled.end(), 0.f);
    for (int64_t i = 0; i < HW; ++i) {
      const float* r = dn + i * E;
      for (int64_t c = 0; c < E; ++c) pooled[c] += r[c];
    }
    for (int64_t c = 0; c < E; ++c) pooled[c] /= static_cast<float>(HW);
    for (int64_t m = 0; m < M; ++m) {
      float acc = b1[m];
      for (int64_t c = 0; c < E; ++c) acc += W1[m * E + c] * pooled[c];
      hidden[m] = acc > 0.f ? acc : 0.f;
    }
    for (int64_t c = 0; c < E; ++c) {
      float acc = b2[c];
      for (int64_t m = 0; m < M; ++m) acc += W2[c * M + m] * hidden[m];
      gate[c] = p.clip(acc);
    }
#pragma omp parallel for
    for (int64_t i = 0; i < HW; ++i) {
      float* r = dn + i * E;
      for (int64_t c = 0; c < E; ++c) r[c] *= gate[c];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// oneDNN path


// The primitives of one input shape, and the weights in their layouts.
struct Block : DnnlObjects {
  const DnnlApi& a = dnnl();
  dnnl_primitive_t r_in = nullptr, r_out = nullptr, c1 = nullptr, c2 = nullptr, c3 = nullptr;
  dnnl_primitive_t rw[3] = {nullptr, nullptr, nullptr};  // weight reorders (null: layouts agree)
  dnnl_memory_t u_x = nullptr, u_y = nullptr, x_nhwc = nullptr, t1 = nullptr, t2 = nullptr, y_nhwc = nullptr;
  dnnl_memory_t u_w[3] = {nullptr, nullptr, nullptr}, w[3] = {nullptr, nullptr, nullptr};
  dnnl_memory_t bias[3] = {nullptr, nullptr, nullptr};
  std::mutex mu;
  ParamVersion weight_version[3];  // the weights w[] hold

  // a convolution over NHWC src/dst with bias, weights in the layout oneDNN picks, the block's
  // activation (or none) and, with `add`, a binary add of an NHWC tensor of dst's shape
  dnnl_primitive_t conv(const_dnnl_memory_desc_t src, const_dnnl_memory_desc_t uw, int wnd, const dnnl_dims_t wd,
                        int64_t O, int64_t OH, int64_t OW, int64_t N, int64_t S, int64_t P,
                        dnnl_alg_kind_t eltwise, const_dnnl_memory_desc_t add, int slot) {
    const dnnl_dims_t dd = {N, O, OH, OW}, bd = {O};
    const_dnnl_memory_desc_t wany = md(wnd, wd, dnnl_format_tag_any);  // oneDNN picks the weight layout
    if (!wany) return nullptr;
    const_dnnl_memory_desc_t dst = md(4, dd, dnnl_nhwc), bmd = md(1, bd, dnnl_a);
    if (!dst || !bmd) return nullptr;
    dnnl_post_ops_t po = nullptr;
    dnnl_primitive_attr_t attr = nullptr;
    bool ok = MXF_OK(a.dnnl_primitive_attr_create(&attr)) && MXF_OK(a.dnnl_post_ops_create(&po));
    if (ok && eltwise == dnnl_eltwise_hardswish)
      ok = MXF_OK(a.dnnl_post_ops_append_eltwise(po, eltwise, 1.f / 6.f, 0.5f));
    else if (ok && eltwise == dnnl_eltwise_relu)
      ok = MXF_OK(a.dnnl_post_ops_append_eltwise(po, eltwise, 0.f, 0.f));
    if (ok && add) ok = MXF_OK(a.dnnl_post_ops_append_binary(po, dnnl_binary_add, add));
    if (ok) ok = MXF_OK(a.dnnl_primitive_attr_set_post_ops(attr, po));
    const dnnl_dims_t strides = {S, S}, dil = {0, 0}, pad = {P, P};
    dnnl_primitive_desc_t pd = nullptr;
    if (ok)
      ok = MXF_OK(a.dnnl_convolution_forward_primitive_desc_create(&pd, a.engine, dnnl_forward_inference,
                                                                   dnnl_convolution_direct, src, wany, bmd, dst,
                                                                   strides, dil, pad, pad, attr));
    if (po) a.dnnl_post_ops_destroy(po);
    if (attr) a.dnnl_primitive_attr_destroy(attr);
    if (!ok) return nullptr;
    pds.push_back(pd);
    dnnl_primitive_t c = prim(pd);
    const_dnnl_memory_desc_t cw = a.dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0),
                             cs = a.dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                             cd = a.dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
    // the activations stay NHWC: refuse a convolution that wants another layout
    if (!c || !cw || !a.dnnl_memory_desc_equal(cs, src) || !a.dnnl_memory_desc_equal(cd, dst)) return nullptr;
    if (!reorder(uw, cw, &rw[slot])) return nullptr;
    u_w[slot] = mem(uw, nullptr);
    w[slot] = rw[slot] ? mem(cw, DNNL_MEMORY_ALLOCATE) : u_w[slot];
    bias[slot] = mem(bmd, nullptr);
    if (!u_w[slot] || !w[slot] || !bias[slot]) return nullptr;
    return c;
  }

  bool create(const Params& p, const Geometry& g) {
    const int64_t N = g.N, C = g.C, H = g.H, W = g.W, E = p.E, O = p.O;
    const dnnl_dims_t xd = {N, C, H, W}, ad = {N, E, H, W}, dd = {N, E, g.OH, g.OW}, yd = {N, O, g.OH, g.OW};
    const dnnl_dims_t wed = {E, C, 1, 1}, wdd = {E, 1, 1, p.K, p.K}, wpd = {O, E, 1, 1};
    const_dnnl_memory_desc_t ux = md(4, xd, dnnl_nchw), xn = md(4, xd, dnnl_nhwc), uy = md(4, yd, dnnl_nchw),
                             an = md(4, ad, dnnl_nhwc), dn = md(4, dd, dnnl_nhwc), yn = md(4, yd, dnnl_nhwc);
    const_dnnl_memory_desc_t uwe = md(4, wed, dnnl_oihw), uwd = md(5, wdd, dnnl_goihw), uwp = md(4, wpd, dnnl_oihw);
    if (!ux || !xn || !uy || !an || !dn || !yn || !uwe || !uwd || !uwp) return false;
    const dnnl_alg_kind_t act = p.hswish ? dnnl_eltwise_hardswish : dnnl_eltwise_relu;
    if (p.expand && !(c1 = conv(xn, uwe, 4, wed, E, H, W, N, 1, 0, act, nullptr, 0))) return false;
    if (!(c2 = conv(p.expand ? an : xn, uwd, 5, wdd, E, g.OH, g.OW, N, p.S, p.P, act, nullptr, 1))) return false;
    if (!(c3 = conv(dn, uwp, 4, wpd, O, g.OH, g.OW, N, 1, 0, dnnl_alg_kind_undef, p.residual ? xn : nullptr, 2)))
      return false;
    if (!reorder(ux, xn, &r_in) || !reorder(yn, uy, &r_out)) return false;
    u_x = mem(ux, nullptr);
    u_y = mem(uy, nullptr);
    x_nhwc = r_in ? mem(xn, DNNL_MEMORY_ALLOCATE) : u_x;
    t1 = p.expand ? mem(an, DNNL_MEMORY_ALLOCATE) : x_nhwc;
    t2 = mem(dn, DNNL_MEMORY_ALLOCATE);
    y_nhwc = r_out ? mem(yn, DNNL_MEMORY_ALLOCATE) : u_y;
    return u_x && u_y && x_nhwc && t1 && t2 && y_nhwc;
  }

  bool exec(dnnl_primitive_t pr, dnnl_stream_t s, std::initializer_list<dnnl_exec_arg_t> args) {
    return MXF_OK(a.dnnl_primitive_execute(pr, s, static_cast<int>(args.size()), args.begin()));
  }

  // x, y: NCHW; ws[k], bs[k]: the user's weight and bias of conv k (0 expand, 1 depthwise, 2 project)
  bool run(const Params& p, const Geometry& g, const float* x, float* y, MXTensor* ws[3],
           const float* bs[3], const float* se[4]) {
    std::lock_guard<std::mutex> lk(mu);
    dnnl_stream_t s = dnnl_thread_stream();
    if (!s) return false;
    bool repack = false;
    for (int k = 0; k < 3; ++k)           // every weight asked (each keeps its own record)
      if (ws[k] && weight_version[k].changed(*ws[k])) repack = true;
    auto unpacked = [&] {                 // a pack that failed: the next call packs again
      for (auto& v : weight_version) v.forget();
      return false;
    };
    for (int k = 0; k < 3; ++k) {
      if (!ws[k]) continue;
      if (!MXF_OK(a.dnnl_memory_set_data_handle(u_w[k], ws[k]->data_ptr)) ||
          !MXF_OK(a.dnnl_memory_set_data_handle(bias[k], const_cast<float*>(bs[k]))))
        return unpacked();
      if (repack && rw[k] && !exec(rw[k], s, {{DNNL_ARG_FROM, u_w[k]}, {DNNL_ARG_TO, w[k]}})) return unpacked();
    }
    if (!MXF_OK(a.dnnl_memory_set_data_handle(u_x, const_cast<float*>(x))) ||
        !MXF_OK(a.dnnl_memory_set_data_handle(u_y, y)))
      return false;
    if (r_in && !exec(r_in, s, {{DNNL_ARG_FROM, u_x}, {DNNL_ARG_TO, x_nhwc}})) return false;
    if (c1 && !exec(c1, s, {{DNNL_ARG_SRC, x_nhwc}, {DNNL_ARG_WEIGHTS, w[0]}, {DNNL_ARG_BIAS, bias[0]},
                            {DNNL_ARG_DST, t1}}))
      return false;
    if (!exec(c2, s, {{DNNL_ARG_SRC, t1}, {DNNL_ARG_WEIGHTS, w[1]}, {DNNL_ARG_BIAS, bias[1]}, {DNNL_ARG_DST, t2}}))
      return false;
    if (p.se) {
      if (!MXF_OK(a.dnnl_stream_wait(s))) return false;
      void* h = nullptr;
      if (!MXF_OK(a.dnnl_memory_get_data_handle(t2, &h))) return false;
      squeeze_excite(p, g, se[0], se[1], se[2], se[3], static_cast<float*>(h));
    }
    if (p.residual) {
      if (!exec(c3, s, {{DNNL_ARG_SRC, t2}, {DNNL_ARG_WEIGHTS, w[2]}, {DNNL_ARG_BIAS, bias[2]},
                        {DNNL_ARG_DST, y_nhwc}, {DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1, x_nhwc}}))
        return false;
    } else if (!exec(c3, s, {{DNNL_ARG_SRC, t2}, {DNNL_ARG_WEIGHTS, w[2]}, {DNNL_ARG_BIAS, bias[2]},
                             {DNNL_ARG_DST, y_nhwc}})) {
      return false;
    }
    if (r_out && !exec(r_out, s, {{DNNL_ARG_FROM, y_nhwc}, {DNNL_ARG_TO, u_y}})) return false;
    return MXF_OK(a.dnnl_stream_wait(s));
  }
};

// ---------------------------------------------------------------------------------------------
// Direct loops (no oneDNN): NCHW throughout, the SE on an NHWC copy.

void direct(const Params& p, const Geometry& g, const float* x, float* y, MXTensor* ws[3],
            const float* bs[3], const float* se[4]) {
  const int64_t N = g.N, C = g.C, HW = g.H * g.W, OHW = g.OH * g.OW, E = p.E, O = p.O, K = p.K;
  std::vector<float> a(p.expand ? N * E * HW : 0), d(N * E * OHW), dn(N * OHW * E);
  const float* src = x;
  if (p.expand) {
    const float* We = ws[0]->data<float>();
#pragma omp parallel for collapse(2)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        float* r = a.data() + (n * E + e) * HW;
        for (int64_t i = 0; i < HW; ++i) r[i] = bs[0][e];
        for (int64_t c = 0; c < C; ++c) {
          const float wv = We[e * C + c];
          const float* xr = x + (n * C + c) * HW;
          for (int64_t i = 0; i < HW; ++i) r[i] += wv * xr[i];
        }
        for (int64_t i = 0; i < HW; ++i) r[i] = act(p, r[i]);
      }
    src = a.data();
  }
  const float* Wd = ws[1]->data<float>();
#pragma omp parallel for collapse(2)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) {
      const float* in = src + (n * E + e) * HW;
      float* r = d.data() + (n * E + e) * OHW;
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          float acc = bs[1][e];
          for (int64_t kh = 0; kh < K; ++kh) {
            const int64_t ih = oh * p.S - p.P + kh;
            if (ih < 0 || ih >= g.H) continue;
            for (int64_t kw = 0; kw < K; ++kw) {
              const int64_t iw = ow * p.S - p.P + kw;
              if (iw >= 0 && iw < g.W) acc += Wd[(e * K + kh) * K + kw] * in[ih * g.W + iw];
            }
          }
          r[oh * g.OW + ow] = act(p, acc);
        }
    }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < OHW; ++i) dn[(n * OHW + i) * E + e] = d[(n * E + e) * OHW + i];
  if (p.se) squeeze_excite(p, g, se[0], se[1], se[2], se[3], dn.data());
  const float* Wp = ws[2]->data<float>();
#pragma omp parallel for collapse(2)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o) {
      float* r = y + (n * O + o) * OHW;
      for (int64_t i = 0; i < OHW; ++i) {
        const float* dr = dn.data() + (n * OHW + i) * E;
        float acc = bs[2][o];
        for (int64_t e = 0; e < E; ++e) acc += Wp[o * E + e] * dr[e];
        r[i] = p.residual ? acc + x[(n * C + o) * HW + i] : acc;
      }
    }
}

// ---------------------------------------------------------------------------------------------

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_inverted_residual", [&] {
    *nin = slots(parse(a)).n;
    *nout = 1;
  });
}

void expect(const Shape& got, const Shape& want, const char* what) {
  if (got != want) throw OpError(std::string(what) + " must be " + shape_str(want) + ", got " + shape_str(got));
}

MXReturnValue infer_shape(const Attrs& attrs, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_inverted_residual", [&] {
    const Params p = parse(attrs);
    const Slots s = slots(p);
    require_known_input(*in, 0, "x");
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, C, H, W), got " + shape_str(x));
    const unsigned C = x[1], E = static_cast<unsigned>(p.E), O = static_cast<unsigned>(p.O),
                   K = static_cast<unsigned>(p.K);
    // the convolutions' weights and biases from x, num_expand, num_filter, kernel (and the SE's
    // num_hidden), as Convolution infers them
    if (p.expand) {
      fill_input(in, s.we, Shape{E, C, 1, 1}, "the expand weight");
      fill_input(in, s.be, Shape{E}, "the expand bias");
    }
    fill_input(in, s.wd, Shape{E, 1, K, K}, "the depthwise weight");
    fill_input(in, s.bd, Shape{E}, "the depthwise bias");
    if (p.se && has_attr(attrs, "num_hidden")) {
      const unsigned M = static_cast<unsigned>(attr_int(attrs, "num_hidden", 0));
      fill_input(in, s.w1, Shape{M, E, 1, 1}, "the SE's first weight");
      fill_input(in, s.b1, Shape{M}, "the SE's first bias");
      fill_input(in, s.w2, Shape{E, M, 1, 1}, "the SE's second weight");
      fill_input(in, s.b2, Shape{E}, "the SE's second bias");
    }
    fill_input(in, s.wp, Shape{O, E, 1, 1}, "the projection weight");
    fill_input(in, s.bp, Shape{O}, "the projection bias");
    require_known_shapes(*in);
    if (!p.expand && C != E) throw OpError("without expand, x's channels must be num_expand");
    if (p.residual && C != O) throw OpError("the residual add needs x's channels to be num_filter");
    if (p.expand) {
      expect((*in)[s.we], Shape{E, C, 1, 1}, "the expand weight");
      expect((*in)[s.be], Shape{E}, "the expand bias");
    }
    expect((*in)[s.wd], Shape{E, 1, K, K}, "the depthwise weight");
    expect((*in)[s.bd], Shape{E}, "the depthwise bias");
    if (p.se) {
      const Shape& w1 = (*in)[s.w1];
      if (w1.size() != 4 || w1[0] < 1) throw OpError("the SE's first weight must be (M, E, 1, 1)");
      const unsigned M = w1[0];
      expect(w1, Shape{M, E, 1, 1}, "the SE's first weight");
      expect((*in)[s.b1], Shape{M}, "the SE's first bias");
      expect((*in)[s.w2], Shape{E, M, 1, 1}, "the SE's second weight");
      expect((*in)[s.b2], Shape{E}, "the SE's second bias");
    }
    expect((*in)[s.wp], Shape{O, E, 1, 1}, "the projection weight");
    expect((*in)[s.bp], Shape{O}, "the projection bias");
    const Geometry g = geometry(p, *in, s);
    if (g.OH < 1 || g.OW < 1) throw OpError("the kernel does not fit the padded input " + shape_str(x));
    if (p.residual && (g.OH != g.H || g.OW != g.W)) throw OpError("the residual add needs the output's plane size");
    (*out)[0] = Shape{x[0], O, static_cast<unsigned>(g.OH), static_cast<unsigned>(g.OW)};
  });
}

class InvertedResidualOp : public mxnet::ext::CustomStatefulOp {
 public:
  explicit InvertedResidualOp(const Attrs& a) : p_(parse(a)), s_(slots(p_)) {}

  MXReturnValue Forward(std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) override {
    return guarded("fused_inverted_residual", [&] {
      for (auto& t : *in) require_f32(t, "fused_inverted_residual input");
      const Geometry g = geometry(p_, shapes_of(*in), s_);
      MXTensor* ws[3] = {p_.expand ? &(*in)[s_.we] : nullptr, &(*in)[s_.wd], &(*in)[s_.wp]};
      const float* bs[3] = {p_.expand ? (*in)[s_.be].data<float>() : nullptr, (*in)[s_.bd].data<float>(),
                            (*in)[s_.bp].data<float>()};
      const float* se[4] = {nullptr, nullptr, nullptr, nullptr};
      if (p_.se)
        for (int k = 0; k < 4; ++k) se[k] = (*in)[s_.w1 + k].data<float>();
      const float* x = (*in)[0].data<float>();
      float* y = (*out)[0].data<float>();
      Block* b = block(g);
      if (!b || !b->run(p_, g, x, y, ws, bs, se)) direct(p_, g, x, y, ws, bs, se);
    });
  }

  // Fused for inference only (the rule refuses training): the refusal every such op gives.
  MXReturnValue Backward(std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource& res) override {
    return inference_only_backward(Attrs(), in, out, res);
  }

 private:
  Block* block(const Geometry& g) { return blocks_.get({g.N, g.C, g.H, g.W}, p_, g); }

  Params p_;
  Slots s_;
  BlockCache<Block> blocks_;
};

MXReturnValue create_state(const Attrs& a, const mxnet::ext::MXContext&, const std::vector<Shape>&,
                           const std::vector<int>, mxnet::ext::CustomStatefulOp** op) {
  return guarded("fused_inverted_residual", [&] { *op = mxnet::ext::CustomStatefulOp::create<InvertedResidualOp>(a); });
}

}  // namespace

REGISTER_OP(fused_inverted_residual)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setCreateOpState(create_state, "cpu");
