// fused_grouped_conv: a grouped 2-D convolution [+ bias] [-> relu] through oneDNN 3.x.
//
// The oneDNN 3.x shipped with this project runs ResNeXt's grouped convolutions (32 groups of
// 4-16 channels) at 49-128 GFLOP/s on one core in its blocked layout, 31-98 with the reorders
// from and to NCHW included (benchmarks/grouped_conv_dnnl.cc); in the network's block, next to
// MXNet's own oneDNN ops, the op measured slower than MXNet's (benchmarks/bench_grouped_conv.py),
// so its rule is opt-in.  The op reads and writes NCHW:
// the input is reordered into the convolution's layout, the weight into its own (small),
// and the result back.  The primitive and its buffers are cached per shape.  Without
// oneDNN's convolution API a direct loop computes the same (slowly).  See README.md.
#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "dnnl_api.h"
#include "mxf_common.h"

using namespace mxf;

namespace {

struct Geometry {
  int64_t N, C, H, W, O, KH, KW, SH, SW, PH, PW, DH, DW, G, OH, OW;
  bool bias, relu;
  auto key() const {
    return std::make_tuple(N, C, H, W, O, KH, KW, SH, SW, PH, PW, DH, DW, G, bias, relu);
  }
};

// One cached convolution: the primitive, the reorders from and to the user's layouts
// (null where the layouts agree) and the memories (user handles set per call).
struct Prim {
  std::mutex mu;
  std::vector<dnnl_memory_desc_t> mds;
  std::vector<dnnl_primitive_desc_t> pds;
  std::vector<dnnl_primitive_t> prims;
  std::vector<dnnl_memory_t> mems;
  dnnl_primitive_t conv = nullptr, r_src = nullptr, r_w = nullptr, r_dst = nullptr;
  dnnl_memory_t u_src = nullptr, u_w = nullptr, u_dst = nullptr, bias = nullptr;
  dnnl_memory_t b_src = nullptr, b_w = nullptr, b_dst = nullptr;
  ~Prim() {
    const DnnlApi& a = dnnl();
    for (auto p : prims) a.dnnl_primitive_destroy(p);
    for (auto p : pds) a.dnnl_primitive_desc_destroy(p);
    for (auto m : mems) a.dnnl_memory_destroy(m);
    for (auto m : mds) a.dnnl_memory_desc_destroy(m);
  }
  dnnl_memory_desc_t md(const DnnlApi& a, int nd, const int64_t* d, dnnl_format_tag_t tag) {
    dnnl_memory_desc_t m = nullptr;
    if (a.dnnl_memory_desc_create_with_tag(&m, nd, d, dnnl_f32, tag) != dnnl_success) return nullptr;
    mds.push_back(m);
    return m;
  }
  dnnl_memory_t mem(const DnnlApi& a, const_dnnl_memory_desc_t md, void* handle) {
    dnnl_memory_t m = nullptr;
    if (a.dnnl_memory_create(&m, md, a.engine, handle) != dnnl_success) return nullptr;
    mems.push_back(m);
    return m;
  }
  // a reorder from `from` to `to` (null when they are equal; `ok` false on error)
  dnnl_primitive_t reorder(const DnnlApi& a, const_dnnl_memory_desc_t from, const_dnnl_memory_desc_t to,
                           bool& ok) {
    if (!ok || a.dnnl_memory_desc_equal(from, to)) return nullptr;
    dnnl_primitive_desc_t pd = nullptr;
    dnnl_primitive_t p = nullptr;
    if (a.dnnl_reorder_primitive_desc_create(&pd, from, a.engine, to, a.engine, nullptr) != dnnl_success) {
      ok = false;
      return nullptr;
    }
    pds.push_back(pd);
    if (a.dnnl_primitive_create(&p, pd) != dnnl_success) {
      ok = false;
      return nullptr;
    }
    prims.push_back(p);
    return p;
  }
  bool create(const DnnlApi& a, const Geometry& g) {
    const dnnl_dims_t sd = {g.N, g.C, g.H, g.W}, dd = {g.N, g.O, g.OH, g.OW},
                      wd = {g.G, g.O / g.G, g.C / g.G, g.KH, g.KW}, bd = {g.O};
    auto usm = md(a, 4, sd, dnnl_abcd), udm = md(a, 4, dd, dnnl_abcd), uwm = md(a, 5, wd, dnnl_abcde);
    auto asm_ = md(a, 4, sd, dnnl_format_tag_any), adm = md(a, 4, dd, dnnl_format_tag_any),
         awm = md(a, 5, wd, dnnl_format_tag_any);
    auto bm = g.bias ? md(a, 1, bd, dnnl_a) : nullptr;
    if (!usm || !udm || !uwm || !asm_ || !adm || !awm || (g.bias && !bm)) return false;
    dnnl_primitive_attr_t attr = nullptr;
    dnnl_post_ops_t po = nullptr;
    if (g.relu) {
      if (a.dnnl_primitive_attr_create(&attr) != dnnl_success || a.dnnl_post_ops_create(&po) != dnnl_success ||
          a.dnnl_post_ops_append_eltwise(po, dnnl_eltwise_relu, 0.f, 0.f) != dnnl_success ||
          a.dnnl_primitive_attr_set_post_ops(attr, po) != dnnl_success) {
        if (po) a.dnnl_post_ops_destroy(po);
        if (attr) a.dnnl_primitive_attr_destroy(attr);
        return false;
      }
    }
    const dnnl_dims_t strides = {g.SH, g.SW}, dil = {g.DH - 1, g.DW - 1}, pad = {g.PH, g.PW};
    dnnl_primitive_desc_t pd = nullptr;
    const bool made = a.dnnl_convolution_forward_primitive_desc_create(
                          &pd, a.engine, dnnl_forward_inference, dnnl_convolution_direct, asm_, awm, bm, adm,
                          strides, dil, pad, pad, attr) == dnnl_success;
    if (po) a.dnnl_post_ops_destroy(po);
    if (attr) a.dnnl_primitive_attr_destroy(attr);
    if (!made) return false;
    pds.push_back(pd);
    if (dnnl_reference_impl(pd)) return false;  // only oneDNN's reference code: the direct loops instead
    if (a.dnnl_primitive_create(&conv, pd) != dnnl_success) return false;
    prims.push_back(conv);
    const_dnnl_memory_desc_t csm = a.dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                             cwm = a.dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0),
                             cdm = a.dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
    bool ok = csm && cwm && cdm;
    r_src = reorder(a, usm, csm, ok);
    r_w = reorder(a, uwm, cwm, ok);
    r_dst = reorder(a, cdm, udm, ok);
    if (!ok) return false;
    u_src = mem(a, usm, nullptr);
    u_w = mem(a, uwm, nullptr);
    u_dst = mem(a, udm, nullptr);
    bias = g.bias ? mem(a, bm, nullptr) : nullptr;
    b_src = r_src ? mem(a, csm, DNNL_MEMORY_ALLOCATE) : u_src;
    b_w = r_w ? mem(a, cwm, DNNL_MEMORY_ALLOCATE) : u_w;
    b_dst = r_dst ? mem(a, cdm, DNNL_MEMORY_ALLOCATE) : u_dst;
    return u_src && u_w && u_dst && (!g.bias || bias) && b_src && b_w && b_dst;
  }
  bool run(const DnnlApi& a, dnnl_stream_t stream, const float* X, const float* Wt, const float* B, float* Y) {
    std::lock_guard<std::mutex> lk(mu);
    if (a.dnnl_memory_set_data_handle(u_src, const_cast<float*>(X)) != dnnl_success ||
        a.dnnl_memory_set_data_handle(u_w, const_cast<float*>(Wt)) != dnnl_success ||
        a.dnnl_memory_set_data_handle(u_dst, Y) != dnnl_success ||
        (bias && a.dnnl_memory_set_data_handle(bias, const_cast<float*>(B)) != dnnl_success))
      return false;
    auto exec = [&](dnnl_primitive_t prim, int n, const dnnl_exec_arg_t* args) {
      return a.dnnl_primitive_execute(prim, stream, n, args) == dnnl_success;
    };
    if (r_src) {
      const dnnl_exec_arg_t r[2] = {{DNNL_ARG_SRC, u_src}, {DNNL_ARG_DST, b_src}};
      if (!exec(r_src, 2, r)) return false;
    }
    if (r_w) {
      const dnnl_exec_arg_t r[2] = {{DNNL_ARG_SRC, u_w}, {DNNL_ARG_DST, b_w}};
      if (!exec(r_w, 2, r)) return false;
    }
    const dnnl_exec_arg_t c[4] = {
        {DNNL_ARG_SRC, b_src}, {DNNL_ARG_WEIGHTS, b_w}, {DNNL_ARG_DST, b_dst}, {DNNL_ARG_BIAS, bias}};
    if (!exec(conv, bias ? 4 : 3, c)) return false;
    if (r_dst) {
      const dnnl_exec_arg_t r[2] = {{DNNL_ARG_SRC, b_dst}, {DNNL_ARG_DST, u_dst}};
      if (!exec(r_dst, 2, r)) return false;
    }
    return a.dnnl_stream_wait(stream) == dnnl_success;
  }
};

bool dnnl_conv(const Geometry& g, const float* X, const float* Wt, const float* B, float* Y) {
  if (const char* off = std::getenv("MXFUSION_NO_DNNL_CONV"))  // the direct loop (tests, debugging)
    if (*off && std::string(off) != "0") return false;
  const DnnlApi& a = dnnl();
  if (!a.engine) return false;
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
      if (!made->create(a, g)) made.reset();
      it = cache.emplace(g.key(), std::move(made)).first;
    }
    p = it->second.get();
  }
  return p && p->run(a, stream, X, Wt, B, Y);
}

// The same convolution as a direct loop (no oneDNN).
void direct_conv(const Geometry& g, const float* X, const float* Wt, const float* B, float* Y) {
  const int64_t cg = g.C / g.G, og = g.O / g.G;
#pragma omp parallel for collapse(2)
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t o = 0; o < g.O; ++o) {
      const int64_t grp = o / og;
      float* y = Y + (n * g.O + o) * g.OH * g.OW;
      for (int64_t i = 0; i < g.OH * g.OW; ++i) y[i] = B ? B[o] : 0.f;
      for (int64_t c = 0; c < cg; ++c) {
        const float* x = X + (n * g.C + grp * cg + c) * g.H * g.W;
        for (int64_t kh = 0; kh < g.KH; ++kh)
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            const float w = Wt[((o * cg + c) * g.KH + kh) * g.KW + kw];
            for (int64_t oh = 0; oh < g.OH; ++oh) {
              const int64_t ih = oh * g.SH - g.PH + kh * g.DH;
              if (ih < 0 || ih >= g.H) continue;
              for (int64_t ow = 0; ow < g.OW; ++ow) {
                const int64_t iw = ow * g.SW - g.PW + kw * g.DW;
                if (iw >= 0 && iw < g.W) y[oh * g.OW + ow] += w * x[ih * g.W + iw];
              }
            }
          }
      }
      if (g.relu)
        for (int64_t i = 0; i < g.OH * g.OW; ++i) y[i] = y[i] > 0.f ? y[i] : 0.f;
    }
}


struct Params {
  int64_t KH, KW, SH, SW, PH, PW, DH, DW, G, O;
  bool bias, relu;
};

Params parse(const Attrs& a) {
  Params p;
  std::tie(p.KH, p.KW) = attr_pair(a, "kernel", 0);
  std::tie(p.SH, p.SW) = attr_pair(a, "stride", 1);
  std::tie(p.PH, p.PW) = attr_pair(a, "pad", 0);
  std::tie(p.DH, p.DW) = attr_pair(a, "dilate", 1);
  p.G = attr_int(a, "num_group", 1);
  p.O = attr_int(a, "num_filter", 0);
  p.bias = !attr_bool(a, "no_bias", false);
  const std::string act = attr_choice(a, "act", "none", {"none", "relu", "act_relu"});
  p.relu = act != "none";
  if (p.KH < 1 || p.KW < 1 || p.SH < 1 || p.SW < 1 || p.PH < 0 || p.PW < 0 || p.DH < 1 || p.DW < 1)
    throw OpError("kernel, stride and dilate must be positive and pad non-negative");
  if (p.G < 1 || p.O < 1 || p.O % p.G) throw OpError("num_filter must be a positive multiple of num_group");
  return p;
}

template <class S>
Geometry geometry(const Params& p, const S& x) {
  Geometry g;
  g.N = x[0], g.C = x[1], g.H = x[2], g.W = x[3], g.O = p.O, g.KH = p.KH, g.KW = p.KW, g.SH = p.SH, g.SW = p.SW;
  g.PH = p.PH, g.PW = p.PW, g.DH = p.DH, g.DW = p.DW, g.G = p.G, g.bias = p.bias, g.relu = p.relu;
  g.OH = (g.H + 2 * g.PH - g.DH * (g.KH - 1) - 1) / g.SH + 1;
  g.OW = (g.W + 2 * g.PW - g.DW * (g.KW - 1) - 1) / g.SW + 1;
  return g;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_grouped_conv", [&] {
    *nin = parse(a).bias ? 3 : 2;
    *nout = 1;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_grouped_conv", [&] {
    const Params p = parse(a);
    require_known_input(*in, 0, "x");
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, C, H, W), got " + shape_str(x));
    if (x[1] % p.G) throw OpError("x's channels " + std::to_string(x[1]) + " are not num_group groups");
    const Shape want{static_cast<unsigned>(p.O), static_cast<unsigned>(x[1] / p.G),
                     static_cast<unsigned>(p.KH), static_cast<unsigned>(p.KW)};
    // weight and bias from x, num_filter, num_group and kernel, as Convolution infers them
    fill_input(in, 1, want, "weight");
    if (p.bias) fill_input(in, 2, Shape{static_cast<unsigned>(p.O)}, "bias");
    require_known_shapes(*in);
    if ((*in)[1] != want) throw OpError("weight must be " + shape_str(want) + ", got " + shape_str((*in)[1]));
    if (p.bias && !((*in)[2].size() == 1 && static_cast<int64_t>((*in)[2][0]) == p.O))
      throw OpError("bias must be (" + std::to_string(p.O) + ",), got " + shape_str((*in)[2]));
    const Geometry g = geometry(p, x);
    if (g.OH < 1 || g.OW < 1) throw OpError("the kernel does not fit the padded input " + shape_str(x));
    (*out)[0] = Shape{x[0], static_cast<unsigned>(g.O), static_cast<unsigned>(g.OH), static_cast<unsigned>(g.OW)};
  });
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) {
  return guarded("fused_grouped_conv", [&] {
    const Params p = parse(a);
    const Geometry g = geometry(p, (*in)[0].shape);
    const float* X = (*in)[0].data<float>();
    const float* Wt = (*in)[1].data<float>();
    const float* B = p.bias ? (*in)[2].data<float>() : nullptr;
    float* Y = (*out)[0].data<float>();
    if (!dnnl_conv(g, X, Wt, B, Y)) direct_conv(g, X, Wt, B, Y);
  });
}

}  // namespace

REGISTER_OP(fused_grouped_conv)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
