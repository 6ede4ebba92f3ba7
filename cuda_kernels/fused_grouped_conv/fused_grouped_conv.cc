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

#include "mxf_common.h"

using namespace mxf;

namespace {

using status = int;
using dims12 = int64_t[12];
constexpr int kF32 = 3, kTagAny = 1, kTagA = 2, kTagAbcd = 5, kTagAbcde = 6, kCpu = 1, kInOrder = 1;
constexpr int kForwardInference = 96, kConvDirect = 1, kEltwiseRelu = 0x20;
constexpr int kQuerySrcMd = 129, kQueryWeightsMd = 131, kQueryDstMd = 133;
constexpr int kArgSrc = 1, kArgDst = 17, kArgWeights = 33, kArgBias = 41;
void* const kAllocate = reinterpret_cast<void*>(~uintptr_t{0});

struct ExecArg {
  int arg;
  void* memory;
};

struct Api {
  status (*engine_create)(void**, int, size_t);
  status (*stream_create)(void**, void*, unsigned);
  status (*stream_wait)(void*);
  status (*md_with_tag)(void**, int, const int64_t*, int, int);
  status (*md_destroy)(void*);
  int (*md_equal)(const void*, const void*);
  status (*conv_pd_create)(void**, void*, int, int, const void*, const void*, const void*, const void*,
                           const int64_t*, const int64_t*, const int64_t*, const int64_t*, const void*);
  const void* (*pd_query_md)(const void*, int, int);
  status (*pd_destroy)(void*);
  status (*prim_create)(void**, const void*);
  status (*prim_destroy)(void*);
  status (*prim_execute)(const void*, void*, int, const ExecArg*);
  status (*reorder_pd_create)(void**, const void*, void*, const void*, void*, const void*);
  status (*mem_create)(void**, const void*, void*, void*);
  status (*mem_set_handle)(void*, void*);
  status (*mem_destroy)(void*);
  status (*post_ops_create)(void**);
  status (*post_ops_append_eltwise)(void*, int, float, float);
  status (*post_ops_destroy)(void*);
  status (*attr_create)(void**);
  status (*attr_set_post_ops)(void*, const void*);
  status (*attr_destroy)(void*);
  void* engine = nullptr;
};

template <class F>
void bind(F& f, const char* name, bool& ok) {
  f = reinterpret_cast<F>(dnnl_symbol(name));
  ok = ok && f != nullptr;
}

const Api* api() {
  static Api a;
  static bool ok = true;
  static std::once_flag once;
  std::call_once(once, [] {
    bind(a.engine_create, "dnnl_engine_create", ok);
    bind(a.stream_create, "dnnl_stream_create", ok);
    bind(a.stream_wait, "dnnl_stream_wait", ok);
    bind(a.md_with_tag, "dnnl_memory_desc_create_with_tag", ok);
    bind(a.md_destroy, "dnnl_memory_desc_destroy", ok);
    bind(a.md_equal, "dnnl_memory_desc_equal", ok);
    bind(a.conv_pd_create, "dnnl_convolution_forward_primitive_desc_create", ok);
    bind(a.pd_query_md, "dnnl_primitive_desc_query_md", ok);
    bind(a.pd_destroy, "dnnl_primitive_desc_destroy", ok);
    bind(a.prim_create, "dnnl_primitive_create", ok);
    bind(a.prim_destroy, "dnnl_primitive_destroy", ok);
    bind(a.prim_execute, "dnnl_primitive_execute", ok);
    bind(a.reorder_pd_create, "dnnl_reorder_primitive_desc_create", ok);
    bind(a.mem_create, "dnnl_memory_create", ok);
    bind(a.mem_set_handle, "dnnl_memory_set_data_handle", ok);
    bind(a.mem_destroy, "dnnl_memory_destroy", ok);
    bind(a.post_ops_create, "dnnl_post_ops_create", ok);
    bind(a.post_ops_append_eltwise, "dnnl_post_ops_append_eltwise", ok);
    bind(a.post_ops_destroy, "dnnl_post_ops_destroy", ok);
    bind(a.attr_create, "dnnl_primitive_attr_create", ok);
    bind(a.attr_set_post_ops, "dnnl_primitive_attr_set_post_ops", ok);
    bind(a.attr_destroy, "dnnl_primitive_attr_destroy", ok);
    if (ok && a.engine_create(&a.engine, kCpu, 0) != 0) ok = false;
  });
  return ok ? &a : nullptr;
}

void* thread_stream(const Api& a) {
  thread_local void* s = nullptr;
  if (!s && a.stream_create(&s, a.engine, kInOrder) != 0) s = nullptr;
  return s;
}

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
  std::vector<void*> mds, pds, prims, mems;
  void *conv = nullptr, *r_src = nullptr, *r_w = nullptr, *r_dst = nullptr;
  void *u_src = nullptr, *u_w = nullptr, *u_dst = nullptr, *bias = nullptr;
  void *b_src = nullptr, *b_w = nullptr, *b_dst = nullptr;
  ~Prim() {
    const Api* a = api();
    if (!a) return;
    for (void* p : prims) a->prim_destroy(p);
    for (void* p : pds) a->pd_destroy(p);
    for (void* m : mems) a->mem_destroy(m);
    for (void* m : mds) a->md_destroy(m);
  }
  void* md(const Api& a, int nd, const int64_t* d, int tag) {
    void* m = nullptr;
    if (a.md_with_tag(&m, nd, d, kF32, tag) != 0) return nullptr;
    mds.push_back(m);
    return m;
  }
  void* mem(const Api& a, const void* md, void* handle) {
    void* m = nullptr;
    if (a.mem_create(&m, md, a.engine, handle) != 0) return nullptr;
    mems.push_back(m);
    return m;
  }
  // a reorder from `from` to `to` (null when they are equal; `ok` false on error)
  void* reorder(const Api& a, const void* from, const void* to, bool& ok) {
    if (!ok || a.md_equal(from, to)) return nullptr;
    void *pd = nullptr, *p = nullptr;
    if (a.reorder_pd_create(&pd, from, a.engine, to, a.engine, nullptr) != 0) {
      ok = false;
      return nullptr;
    }
    pds.push_back(pd);
    if (a.prim_create(&p, pd) != 0) {
      ok = false;
      return nullptr;
    }
    prims.push_back(p);
    return p;
  }
  bool create(const Api& a, const Geometry& g) {
    const dims12 sd = {g.N, g.C, g.H, g.W}, dd = {g.N, g.O, g.OH, g.OW},
                 wd = {g.G, g.O / g.G, g.C / g.G, g.KH, g.KW}, bd = {g.O};
    void *usm = md(a, 4, sd, kTagAbcd), *udm = md(a, 4, dd, kTagAbcd), *uwm = md(a, 5, wd, kTagAbcde);
    void *asm_ = md(a, 4, sd, kTagAny), *adm = md(a, 4, dd, kTagAny), *awm = md(a, 5, wd, kTagAny);
    void* bm = g.bias ? md(a, 1, bd, kTagA) : nullptr;
    if (!usm || !udm || !uwm || !asm_ || !adm || !awm || (g.bias && !bm)) return false;
    void *attr = nullptr, *po = nullptr;
    if (g.relu) {
      if (a.attr_create(&attr) != 0 || a.post_ops_create(&po) != 0 ||
          a.post_ops_append_eltwise(po, kEltwiseRelu, 0.f, 0.f) != 0 || a.attr_set_post_ops(attr, po) != 0) {
        if (po) a.post_ops_destroy(po);
        if (attr) a.attr_destroy(attr);
        return false;
      }
    }
    const int64_t strides[2] = {g.SH, g.SW}, dil[2] = {g.DH - 1, g.DW - 1}, pad[2] = {g.PH, g.PW};
    void* pd = nullptr;
    const bool made = a.conv_pd_create(&pd, a.engine, kForwardInference, kConvDirect, asm_, awm, bm, adm, strides,
                                       dil, pad, pad, attr) == 0;
    if (po) a.post_ops_destroy(po);
    if (attr) a.attr_destroy(attr);
    if (!made) return false;
    pds.push_back(pd);
    if (a.prim_create(&conv, pd) != 0) return false;
    prims.push_back(conv);
    const void *csm = a.pd_query_md(pd, kQuerySrcMd, 0), *cwm = a.pd_query_md(pd, kQueryWeightsMd, 0),
               *cdm = a.pd_query_md(pd, kQueryDstMd, 0);
    bool ok = csm && cwm && cdm;
    r_src = reorder(a, usm, csm, ok);
    r_w = reorder(a, uwm, cwm, ok);
    r_dst = reorder(a, cdm, udm, ok);
    if (!ok) return false;
    u_src = mem(a, usm, nullptr);
    u_w = mem(a, uwm, nullptr);
    u_dst = mem(a, udm, nullptr);
    bias = g.bias ? mem(a, bm, nullptr) : nullptr;
    b_src = r_src ? mem(a, csm, kAllocate) : u_src;
    b_w = r_w ? mem(a, cwm, kAllocate) : u_w;
    b_dst = r_dst ? mem(a, cdm, kAllocate) : u_dst;
    return u_src && u_w && u_dst && (!g.bias || bias) && b_src && b_w && b_dst;
  }
  bool run(const Api& a, void* stream, const float* X, const float* Wt, const float* B, float* Y) {
    std::lock_guard<std::mutex> lk(mu);
    if (a.mem_set_handle(u_src, const_cast<float*>(X)) || a.mem_set_handle(u_w, const_cast<float*>(Wt)) ||
        a.mem_set_handle(u_dst, Y) || (bias && a.mem_set_handle(bias, const_cast<float*>(B))))
      return false;
    if (r_src) {
      const ExecArg r[2] = {{kArgSrc, u_src}, {kArgDst, b_src}};
      if (a.prim_execute(r_src, stream, 2, r)) return false;
    }
    if (r_w) {
      const ExecArg r[2] = {{kArgSrc, u_w}, {kArgDst, b_w}};
      if (a.prim_execute(r_w, stream, 2, r)) return false;
    }
    const ExecArg c[4] = {{kArgSrc, b_src}, {kArgWeights, b_w}, {kArgDst, b_dst}, {kArgBias, bias}};
    if (a.prim_execute(conv, stream, bias ? 4 : 3, c)) return false;
    if (r_dst) {
      const ExecArg r[2] = {{kArgSrc, b_dst}, {kArgDst, u_dst}};
      if (a.prim_execute(r_dst, stream, 2, r)) return false;
    }
    return a.stream_wait(stream) == 0;
  }
};

bool dnnl_conv(const Geometry& g, const float* X, const float* Wt, const float* B, float* Y) {
  if (const char* off = std::getenv("MXFUSION_NO_DNNL_CONV"))  // the direct loop (tests, debugging)
    if (*off && std::string(off) != "0") return false;
  const Api* a = api();
  if (!a) return false;
  void* stream = thread_stream(*a);
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
      if (!made->create(*a, g)) made.reset();
      it = cache.emplace(g.key(), std::move(made)).first;
    }
    p = it->second.get();
  }
  return p && p->run(*a, stream, X, Wt, B, Y);
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

// (a, b) of a tuple attribute like "(3, 3)" (one value is used for both)
std::pair<int64_t, int64_t> pair_attr(const Attrs& a, const char* name, int64_t dflt) {
  auto it = a.find(name);
  if (it == a.end()) return {dflt, dflt};
  std::string s = it->second;
  for (char& ch : s)
    if (ch == '(' || ch == ')' || ch == '[' || ch == ']' || ch == ',') ch = ' ';
  int64_t v[2] = {dflt, dflt};
  int k = 0;
  size_t pos = 0;
  while (k < 2) {
    while (pos < s.size() && s[pos] == ' ') ++pos;
    if (pos >= s.size()) break;
    size_t end = pos;
    while (end < s.size() && s[end] != ' ') ++end;
    v[k++] = std::stoll(s.substr(pos, end - pos));
    pos = end;
  }
  if (k == 0) return {dflt, dflt};
  if (k == 1) v[1] = v[0];
  return {v[0], v[1]};
}

struct Params {
  int64_t KH, KW, SH, SW, PH, PW, DH, DW, G, O;
  bool bias, relu;
};

Params parse(const Attrs& a) {
  Params p;
  std::tie(p.KH, p.KW) = pair_attr(a, "kernel", 0);
  std::tie(p.SH, p.SW) = pair_attr(a, "stride", 1);
  std::tie(p.PH, p.PW) = pair_attr(a, "pad", 0);
  std::tie(p.DH, p.DW) = pair_attr(a, "dilate", 1);
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

MXReturnValue infer_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_grouped_conv", [&] {
    for (size_t i = 0; i < in->size(); ++i)
      if ((*in)[i] != mxnet::ext::kFloat32) throw OpError("input " + std::to_string(i) + " must be float32");
    (*out)[0] = mxnet::ext::kFloat32;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_grouped_conv", [&] {
    require_known_shapes(*in);
    const Params p = parse(a);
    const Shape& x = (*in)[0];
    if (x.size() != 4) throw OpError("x must be (N, C, H, W), got " + shape_str(x));
    if (x[1] % p.G) throw OpError("x's channels " + std::to_string(x[1]) + " are not num_group groups");
    const Shape want{static_cast<unsigned>(p.O), static_cast<unsigned>(x[1] / p.G),
                     static_cast<unsigned>(p.KH), static_cast<unsigned>(p.KW)};
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
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu");
