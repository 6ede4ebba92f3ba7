// fused_deconv: a 2-D transposed convolution (MXNet's Deconvolution) [+ bias] [-> relu] through oneDNN 3.x.
//
// MXNet 1.9.1 runs Deconvolution through its oneDNN 2.x as a GEMM-based convolution backward;
// the oneDNN 3.x this project ships picks its blocked brgemm kernels for the same shapes when
// the layouts are its own (measured ~3x faster on the 4x4 stride-2 deconvolutions of pose and
// CenterNet heads; see README.md).  The op reads and writes NCHW: the input is reordered into the
// primitive's layout, the weight once per weight version, the result back to NCHW.  The
// primitive and its buffers are cached per shape.  Without oneDNN's API (or with
// MXFUSION_NO_DNNL_CONV=1) a direct loop computes the same, slowly.
//
//   y[n, o, oh, ow] = b[o] + sum_{c, kh, kw} x[n, c, ih, iw] * W[c, o, kh, kw]
//                     where oh = ih * S - P + kh * D (and the same for w);  y = relu(y) with act
//   OH = (H - 1) * S - 2 P + D (K - 1) + 1 + adj      (MXNet's Deconvolution; oneDNN pads P, P - adj)
#include <omp.h>

#include <cstdlib>
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

struct Geometry {
  int64_t N, C, H, W, O, KH, KW, SH, SW, PH, PW, AH, AW, DH, DW, OH, OW;
  bool bias, relu;
  auto key() const { return std::make_tuple(N, C, H, W, O, KH, KW, SH, SW, PH, PW, AH, AW, DH, DW, bias, relu); }
};

// One cached deconvolution: the primitive, the reorders from and to NCHW (null where the layouts
// agree), the weight in the primitive's layout and the weight version it holds.
struct Prim : DnnlObjects {
  std::mutex mu;
  dnnl_primitive_t deconv = nullptr, r_src = nullptr, r_w = nullptr, r_dst = nullptr;
  dnnl_memory_t u_src = nullptr, u_w = nullptr, u_dst = nullptr, bias = nullptr;
  dnnl_memory_t b_src = nullptr, b_w = nullptr, b_dst = nullptr;
  ParamVersion weight_version;  // the weight b_w holds

  bool create(const Geometry& g) {
    const DnnlApi& a = api;
    const dnnl_dims_t sd = {g.N, g.C, g.H, g.W}, dd = {g.N, g.O, g.OH, g.OW}, wd = {g.O, g.C, g.KH, g.KW},
                      bd = {g.O};
    // MXNet's weight is (C, O, KH, KW): oneDNN's (O, I, KH, KW) dims in "iohw" order
    const_dnnl_memory_desc_t usm = md(4, sd, dnnl_nchw), udm = md(4, dd, dnnl_nchw), uwm = md(4, wd, dnnl_iohw),
                             asm_ = md(4, sd, dnnl_format_tag_any), adm = md(4, dd, dnnl_format_tag_any),
                             awm = md(4, wd, dnnl_format_tag_any), bm = g.bias ? md(1, bd, dnnl_a) : nullptr;
    if (!usm || !udm || !uwm || !asm_ || !adm || !awm || (g.bias && !bm)) return false;
    dnnl_primitive_attr_t attr = nullptr;
    dnnl_post_ops_t po = nullptr;
    bool ok = MXF_OK(a.dnnl_primitive_attr_create(&attr));
    if (ok && g.relu)
      ok = MXF_OK(a.dnnl_post_ops_create(&po)) && MXF_OK(a.dnnl_post_ops_append_eltwise(po, dnnl_eltwise_relu, 0.f, 0.f)) &&
           MXF_OK(a.dnnl_primitive_attr_set_post_ops(attr, po));
    const dnnl_dims_t strides = {g.SH, g.SW}, dil = {g.DH - 1, g.DW - 1}, pl = {g.PH, g.PW},
                      pr = {g.PH - g.AH, g.PW - g.AW};
    dnnl_primitive_desc_t pd = nullptr;
    if (ok)
      ok = MXF_OK(a.dnnl_deconvolution_forward_primitive_desc_create(&pd, a.engine, dnnl_forward_inference,
                                                                     dnnl_deconvolution_direct, asm_, awm, bm, adm,
                                                                     strides, dil, pl, pr, attr));
    if (po) a.dnnl_post_ops_destroy(po);
    if (attr) a.dnnl_primitive_attr_destroy(attr);
    if (!ok) return false;
    pds.push_back(pd);
    deconv = prim(pd);
    const_dnnl_memory_desc_t csm = a.dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                             cwm = a.dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0),
                             cdm = a.dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
    if (!deconv || !csm || !cwm || !cdm) return false;
    if (!reorder(usm, csm, &r_src) || !reorder(uwm, cwm, &r_w) || !reorder(cdm, udm, &r_dst)) return false;
    u_src = mem(usm, nullptr);
    u_w = mem(uwm, nullptr);
    u_dst = mem(udm, nullptr);
    bias = g.bias ? mem(bm, nullptr) : nullptr;
    b_src = r_src ? mem(csm, DNNL_MEMORY_ALLOCATE) : u_src;
    b_w = r_w ? mem(cwm, DNNL_MEMORY_ALLOCATE) : u_w;
    b_dst = r_dst ? mem(cdm, DNNL_MEMORY_ALLOCATE) : u_dst;
    return u_src && u_w && u_dst && (!g.bias || bias) && b_src && b_w && b_dst;
  }

  bool exec(dnnl_primitive_t p, dnnl_stream_t s, std::initializer_list<dnnl_exec_arg_t> args) {
    return MXF_OK(api.dnnl_primitive_execute(p, s, static_cast<int>(args.size()), args.begin()));
  }

  bool run(dnnl_stream_t s, const float* X, const MXTensor& Wt, const float* B, float* Y) {
    const DnnlApi& a = api;
    std::lock_guard<std::mutex> lk(mu);
    if (!MXF_OK(a.dnnl_memory_set_data_handle(u_src, const_cast<float*>(X))) ||
        !MXF_OK(a.dnnl_memory_set_data_handle(u_w, Wt.data_ptr)) || !MXF_OK(a.dnnl_memory_set_data_handle(u_dst, Y)) ||
        (bias && !MXF_OK(a.dnnl_memory_set_data_handle(bias, const_cast<float*>(B)))))
      return false;
    if (r_w && weight_version.changed(Wt)) {  // the weight in the primitive's layout, once per version
      if (!exec(r_w, s, {{DNNL_ARG_FROM, u_w}, {DNNL_ARG_TO, b_w}})) {
        weight_version.forget();
        return false;
      }
    }
    if (r_src && !exec(r_src, s, {{DNNL_ARG_FROM, u_src}, {DNNL_ARG_TO, b_src}})) return false;
    if (bias) {
      if (!exec(deconv, s, {{DNNL_ARG_SRC, b_src}, {DNNL_ARG_WEIGHTS, b_w}, {DNNL_ARG_BIAS, bias},
                            {DNNL_ARG_DST, b_dst}}))
        return false;
    } else if (!exec(deconv, s, {{DNNL_ARG_SRC, b_src}, {DNNL_ARG_WEIGHTS, b_w}, {DNNL_ARG_DST, b_dst}})) {
      return false;
    }
    if (r_dst && !exec(r_dst, s, {{DNNL_ARG_FROM, b_dst}, {DNNL_ARG_TO, u_dst}})) return false;
    return MXF_OK(a.dnnl_stream_wait(s));
  }
};

bool dnnl_deconv(const Geometry& g, const float* X, const MXTensor& Wt, const float* B, float* Y) {
  if (dnnl_conv_disabled() || !dnnl().engine) return false;
  dnnl_stream_t stream = dnnl_thread_stream();
  if (!stream) return false;
  static std::mutex mu;
  static std::map<decltype(g.key()), std::unique_ptr<Prim>> cache;
  Prim* p;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto it = cache.find(g.key());
    if (it == cache.end()) {
      if (cache.size() >= 256) return false;
      auto made = std::make_unique<Prim>();
      if (!made->create(g)) made.reset();
      it = cache.emplace(g.key(), std::move(made)).first;
    }
    p = it->second.get();
  }
  return p && p->run(stream, X, Wt, B, Y);
}

// The same transposed convolution as a direct loop (no oneDNN): each output gathers the inputs
// that reach it, so the output planes are computed in parallel without races.
void direct_deconv(const Geometry& g, const float* X, const float* Wt, const float* B, float* Y) {
#pragma omp parallel for collapse(2)
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t o = 0; o < g.O; ++o) {
      float* y = Y + (n * g.O + o) * g.OH * g.OW;
      for (int64_t oh = 0; oh < g.OH; ++oh)
        for (int64_t ow = 0; ow < g.OW; ++ow) {
          float acc = B ? B[o] : 0.f;
          for (int64_t kh = 0; kh < g.KH; ++kh) {
            const int64_t th = oh + g.PH - kh * g.DH;
            if (th < 0 || th % g.SH) continue;
            const int64_t ih = th / g.SH;
            if (ih >= g.H) continue;
            for (int64_t kw = 0; kw < g.KW; ++kw) {
              const int64_t tw = ow + g.PW - kw * g.DW;
              if (tw < 0 || tw % g.SW) continue;
              const int64_t iw = tw / g.SW;
              if (iw >= g.W) continue;
              for (int64_t c = 0; c < g.C; ++c)
                acc += X[((n * g.C + c) * g.H + ih) * g.W + iw] * Wt[((c * g.O + o) * g.KH + kh) * g.KW + kw];
            }
          }
          y[oh * g.OW + ow] = g.relu ? (acc > 0.f ? acc : 0.f) : acc;
        }
    }
}


struct Params {
  int64_t KH, KW, SH, SW, PH, PW, AH, AW, DH, DW, O;
  bool bias, relu;
};

Params parse(const Attrs& a) {
  Params p;
  std::tie(p.KH, p.KW) = attr_pair(a, "kernel", 0);
  std::tie(p.SH, p.SW) = attr_pair(a, "stride", 1);
  std::tie(p.PH, p.PW) = attr_pair(a, "pad", 0);
  std::tie(p.AH, p.AW) = attr_pair(a, "adj", 0);
  std::tie(p.DH, p.DW) = attr_pair(a, "dilate", 1);
  p.O = attr_int(a, "num_filter", 0);
  p.bias = !attr_bool(a, "no_bias", false);
  p.relu = attr_choice(a, "act", "none", {"none", "relu"}) == "relu";
  if (p.KH < 1 || p.KW < 1 || p.SH < 1 || p.SW < 1 || p.DH < 1 || p.DW < 1)
    throw OpError("kernel, stride and dilate must be positive");
  if (p.PH < 0 || p.PW < 0 || p.AH < 0 || p.AW < 0 || p.AH > p.PH || p.AW > p.PW)
    throw OpError("pad must be non-negative and adj between 0 and pad");
  if (p.O < 1) throw OpError("num_filter must be positive");
  return p;
}

template <class S>
Geometry geometry(const Params& p, const S& x) {
  Geometry g;
  g.N = x[0], g.C = x[1], g.H = x[2], g.W = x[3], g.O = p.O, g.KH = p.KH, g.KW = p.KW, g.SH = p.SH, g.SW = p.SW;
  g.PH = p.PH, g.PW = p.PW, g.AH = p.AH, g.AW = p.AW, g.DH = p.DH, g.DW = p.DW, g.bias = p.bias, g.relu = p.relu;
  g.OH = (g.H - 1) * g.SH - 2 * g.PH + g.DH * (g.KH - 1) + 1 + g.AH;
  g.OW = (g.W - 1) * g.SW - 2 * g.PW + g.DW * (g.KW - 1) + 1 + g.AW;
  return g;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_deconv", [&] {
    *nin = parse(a).bias ? 3 : 2;
    *nout = 1;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_deconv", [&] {
    require_known_shapes(*in);
    const Params p = parse(a);
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, C, H, W), got " + shape_str(x));
    const Shape want{x[1], static_cast<unsigned>(p.O), static_cast<unsigned>(p.KH), static_cast<unsigned>(p.KW)};
    if ((*in)[1] != want) throw OpError("weight must be " + shape_str(want) + ", got " + shape_str((*in)[1]));
    if (p.bias && !((*in)[2].size() == 1 && static_cast<int64_t>((*in)[2][0]) == p.O))
      throw OpError("bias must be (" + std::to_string(p.O) + ",), got " + shape_str((*in)[2]));
    const Geometry g = geometry(p, x);
    if (g.OH < 1 || g.OW < 1) throw OpError("the output of input " + shape_str(x) + " would be empty");
    (*out)[0] = Shape{x[0], static_cast<unsigned>(g.O), static_cast<unsigned>(g.OH), static_cast<unsigned>(g.OW)};
  });
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) {
  return guarded("fused_deconv", [&] {
    for (auto& t : *in) require_f32(t, "fused_deconv input");
    const Params p = parse(a);
    const Geometry g = geometry(p, (*in)[0].shape);
    const float* X = (*in)[0].data<float>();
    const float* B = p.bias ? (*in)[2].data<float>() : nullptr;
    float* Y = (*out)[0].data<float>();
    if (!dnnl_deconv(g, X, (*in)[1], B, Y)) direct_deconv(g, X, (*in)[1].data<float>(), B, Y);
  });
}

}  // namespace

REGISTER_OP(fused_deconv)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
