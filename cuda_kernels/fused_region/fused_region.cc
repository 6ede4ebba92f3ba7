// fused_region: a connected region of a CNN (convolutions, BatchNorm, activations, residual adds,
// SE scaling, pooling, concatenation) as one op on oneDNN 3.x primitives.  The contract (program
// JSON, inputs, numerics) is README.md; program.cc parses and checks the program.
//
// Per data-input shapes the op builds a Region (cached, BlockCache): one primitive per op with its
// post steps as oneDNN post-ops, the values inside in the layouts the primitives chose (a reader
// gets its producer's layout; a reorder only where a primitive takes another), an arena for them
// with a buffer reused once its values' last reader has run, and the weights reordered (cast in
// bfloat16, BatchNorm folded into a preceding convolution) once per weight version.  Only the
// region's edges are plain NCHW float32.
//
// Before building, the program is rewritten into the ops that run (plan()): a BatchNorm reading a
// convolution's value that nothing else reads is folded into the convolution's weights and bias; an
// act, add or mul whose operand is read by nothing else becomes post steps of the op making it (an
// add becomes oneDNN's sum post-op, in place in the added value's buffer when that value is dead
// after it).  Where oneDNN refuses a primitive with its post-ops, or only has its reference code for
// it, the steps run as separate in-place primitives (correctness first).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dnnl_api.h"
#include "dnnl_blocks.h"
#include "mxf_common.h"
#include "program.h"

using namespace mxf;
using namespace mxf::region;

namespace {

const char* const kOp = "fused_region";

// ---------------------------------------------------------------------------------------------
// The program as it runs: ops with the BatchNorms, activations, adds and muls they absorb.

struct PlanOp {
  const Op* op = nullptr;
  int index = 0;            // the program's op (messages)
  int out = 0;              // the value it makes (an absorbed op's value)
  std::vector<Step> post;   // its post steps and those of the ops it absorbed
  const Op* bn = nullptr;   // a BatchNorm folded into this convolution
};

std::vector<PlanOp> plan(const Program& p) {
  const int D = p.num_data, V = p.num_values();
  std::vector<int> reads(V, 0);
  for (const Op& op : p.ops) {
    for (int v : op.in) ++reads[v];
    for (const Step& s : op.post)
      if (s.kind != Step::Eltwise) ++reads[s.value];
  }
  for (int v : p.outputs) ++reads[v];
  std::vector<int> maker(V, -1);  // the plan op making each value
  std::vector<PlanOp> ops;
  // Moves `steps` (and the value op k makes) to the plan op making value v, where v is read only
  // by op k and each value the steps read is made before that plan op runs.
  auto absorb = [&](int v, int k, const std::vector<Step>& steps) {
    const int q = maker[v];
    if (q < 0 || reads[v] != 1) return false;
    for (const Step& s : steps)
      if (s.kind != Step::Eltwise && s.value >= D + ops[q].index) return false;
    ops[q].post.insert(ops[q].post.end(), steps.begin(), steps.end());
    ops[q].out = D + k;
    maker[D + k] = q;
    return true;
  };
  for (int k = 0; k < static_cast<int>(p.ops.size()); ++k) {
    const Op& op = p.ops[k];
    const int a = op.in[0];
    bool done = false;
    switch (op.kind) {
      case OpKind::BatchNorm: {
        const int q = maker[a];
        const bool conv = q >= 0 && (ops[q].op->kind == OpKind::Conv || ops[q].op->kind == OpKind::Deconv);
        if (conv && ops[q].post.empty() && !ops[q].bn && absorb(a, k, op.post))
          ops[q].bn = &op, done = true;
        break;
      }
      case OpKind::Act:
        done = absorb(a, k, op.post);
        break;
      case OpKind::Add: {  // x + v == v + x: either operand's maker may take it
        const int b = op.in[1];
        std::vector<Step> sa = {Step{Step::Add, Elt::Relu, 0.f, 0.f, b}}, sb = {Step{Step::Add, Elt::Relu, 0.f, 0.f, a}};
        sa.insert(sa.end(), op.post.begin(), op.post.end());
        sb.insert(sb.end(), op.post.begin(), op.post.end());
        done = a != b && (absorb(a, k, sa) || absorb(b, k, sb));
        break;
      }
      case OpKind::Mul: {
        std::vector<Step> s = {Step{Step::Mul, Elt::Relu, 0.f, 0.f, op.in[1]}};
        s.insert(s.end(), op.post.begin(), op.post.end());
        done = a != op.in[1] && absorb(a, k, s);
        break;
      }
      default:
        break;
    }
    if (done) continue;
    PlanOp po;
    po.op = &op;
    po.index = k;
    po.out = D + k;
    po.post = op.post;
    maker[D + k] = static_cast<int>(ops.size());
    ops.push_back(po);
  }
  return ops;
}

// ---------------------------------------------------------------------------------------------
// Layout choice

struct Config {
  bool bf16 = false;
  bool nhwc = false;  // activations in NHWC; else the layouts oneDNN picks ("any": blocked on AVX-512)
  dnnl_format_tag_t blocked = dnnl_aBcd8b;  // the channel-blocked layout of this CPU's vector width
};

// bfloat16 activations go NHWC where the CPU has AMX: oneDNN picks its AMX convolutions
// (brgconv:avx512_core_amx) only for NHWC bfloat16 sources, and its blocked bfloat16 kernels are
// slower there than float32 (../DESIGN notes: ResNet-50's body 7.9 ms NHWC vs 42.7 ms blocked).
// On avx512_bf16 without AMX the blocked kernels win (19.7 ms blocked vs 55.4 ms NHWC on the
// 2-core EPYC), and in float32 blocked wins everywhere measured.  MXFUSION_REGION_LAYOUT=any|nhwc
// overrides it (tests, benchmarks).
Config config_for(bool bf16) {
  Config c;
  c.bf16 = bf16;
  const unsigned isa = static_cast<unsigned>(dnnl().dnnl_get_effective_cpu_isa());
  auto has = [isa](dnnl_cpu_isa_t level) { return (isa & static_cast<unsigned>(level)) == static_cast<unsigned>(level); };
  const char* env = std::getenv("MXFUSION_REGION_LAYOUT");
  const std::string v = env ? env : "";
  if (v.empty() || v == "auto") {
    c.nhwc = bf16 && has(dnnl_cpu_isa_avx512_core_amx);
  } else if (v == "any" || v == "nhwc") {
    c.nhwc = v == "nhwc";
  } else {
    throw OpError("MXFUSION_REGION_LAYOUT must be auto, any or nhwc, got '" + v + "'");
  }
  c.blocked = has(dnnl_cpu_isa_avx512_core) ? dnnl_aBcd16b : dnnl_aBcd8b;
  return c;
}

// A memory descriptor's layout in oneDNN's letters ("aBcd16b:bf16" is nChw16c in bfloat16).
std::string layout_str(const_dnnl_memory_desc_t md) {
  const DnnlApi& a = dnnl();
  if (!md) return "none";
  int nd = 0, nblks = 0;
  dnnl_format_kind_t fk = dnnl_format_kind_undef;
  dnnl_data_type_t dt = dnnl_data_type_undef;
  const dnnl_dims_t *strides = nullptr, *blks = nullptr, *idxs = nullptr;
  a.dnnl_memory_desc_query(md, dnnl_query_ndims_s32, &nd);
  a.dnnl_memory_desc_query(md, dnnl_query_format_kind, &fk);
  a.dnnl_memory_desc_query(md, dnnl_query_data_type, &dt);
  const std::string dts = dt == dnnl_bf16 ? ":bf16" : dt == dnnl_f32 ? ":f32" : ":?";
  if (fk != dnnl_blocked) return (fk == dnnl_format_kind_any ? "any" : "opaque") + dts;
  a.dnnl_memory_desc_query(md, dnnl_query_strides, &strides);
  a.dnnl_memory_desc_query(md, dnnl_query_inner_nblks_s32, &nblks);
  a.dnnl_memory_desc_query(md, dnnl_query_inner_blks, &blks);
  a.dnnl_memory_desc_query(md, dnnl_query_inner_idxs, &idxs);
  std::vector<int> order(nd);
  for (int i = 0; i < nd; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return (*strides)[x] > (*strides)[y]; });
  std::vector<bool> blocked(nd, false);
  for (int i = 0; i < nblks; ++i) blocked[(*idxs)[i]] = true;
  std::string s;
  for (int i : order) s += static_cast<char>((blocked[i] ? 'A' : 'a') + i);
  for (int i = 0; i < nblks; ++i) s += std::to_string((*blks)[i]) + static_cast<char>('a' + (*idxs)[i]);
  return s + dts;
}

std::string impl_name(const_dnnl_primitive_desc_t pd) {
  const char* name = nullptr;
  if (!pd || dnnl().dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name) != dnnl_success || !name)
    return "?";
  return name;
}

// The most recently built region's plan (mxf_region_last_plan, for tests and benchmarks), and how
// often regions packed weights and met parameters as MXNet's temporary copies (mxf_region_counters).
std::mutex g_plan_mu;
std::string g_last_plan;
std::atomic<long> g_packs{0}, g_temporaries{0};

// ---------------------------------------------------------------------------------------------
// A post step as it runs: an eltwise function, or an add / mul of a region value or of a constant
// tensor (a standalone BatchNorm's shift, the pooling divisor fix).

struct Item {
  enum Kind { Elt, Add, Mul } kind = Elt;
  dnnl_alg_kind_t alg = dnnl_eltwise_relu;
  float a = 0.f, b = 0.f;
  int value = -1;   // Add / Mul of a region value
  int tensor = -1;  // Add / Mul of a constant tensor
  const_dnnl_memory_desc_t md = nullptr;  // the layout the value is read in (default: its own)
};

Item item_of(const Step& s) {
  Item it;
  if (s.kind != Step::Eltwise) {
    it.kind = s.kind == Step::Add ? Item::Add : Item::Mul;
    it.value = s.value;
    return it;
  }
  it.a = s.a;
  it.b = s.b;
  switch (s.elt) {
    case Elt::Relu: it.alg = dnnl_eltwise_relu, it.a = 0.f; break;
    case Elt::Leaky: it.alg = dnnl_eltwise_relu; break;  // alpha: the negative slope
    case Elt::Clip: it.alg = dnnl_eltwise_clip_v2; break;
    case Elt::Sigmoid: it.alg = dnnl_eltwise_logistic; break;
    case Elt::Tanh: it.alg = dnnl_eltwise_tanh; break;
    case Elt::SoftRelu: it.alg = dnnl_eltwise_soft_relu, it.a = 1.f; break;  // (1/alpha)·log(1 + e^(alpha·x))
    case Elt::Elu: it.alg = dnnl_eltwise_elu; break;
    case Elt::Gelu: it.alg = dnnl_eltwise_gelu_erf; break;
    case Elt::Swish: it.alg = dnnl_eltwise_swish, it.a = 1.f; break;  // x·sigmoid(alpha·x)
    case Elt::HardSwish: it.alg = dnnl_eltwise_hardswish, it.a = 1.f / 6.f, it.b = 0.5f; break;
    case Elt::HardSigmoid: it.alg = dnnl_eltwise_hardsigmoid; break;
    case Elt::Linear: it.alg = dnnl_eltwise_linear; break;
  }
  return it;
}

// How the items join their primitive: the first add as oneDNN's sum post-op (the destination
// holds the added value beforehand) and the rest as eltwise/binary post-ops; all as post-ops with
// binary adds; or none, each then a primitive of its own run in place after the op.
enum class Fuse { Sum, Binary, None };

// ---------------------------------------------------------------------------------------------
// The region for one set of data-input shapes.

class Region : public DnnlObjects {
 public:
  struct Inputs {
    const Program* program;
    const std::vector<Dims>* values;  // every value's shape (infer_values)
    Config cfg;
  };

  // Builds everything; an OpError naming the op where oneDNN cannot run it.
  void create(const Inputs& in, int) {
    prog_ = in.program;
    dims_ = *in.values;
    cfg_ = in.cfg;
    dt_ = cfg_.bf16 ? dnnl_bf16 : dnnl_f32;
    if (!api.engine) throw OpError(api.error.empty() ? "oneDNN's CPU engine is unavailable" : api.error);
    build();
  }

  // One call: repack the weights if any changed, then run every primitive in order.
  void run(std::vector<MXTensor>& in, std::vector<MXTensor>& out) {
    std::lock_guard<std::mutex> lk(mu_);
    dnnl_stream_t s = dnnl_thread_stream();
    if (!s) throw OpError("no oneDNN stream");
    repack_if_changed(in, s);
    for (const auto& u : user_) {
      void* h = u.output ? out[u.index].data_ptr : in[u.index].data_ptr;
      check(api.dnnl_memory_set_data_handle(tensors_[u.tensor].mem, h), "binding an input or output");
    }
    for (const Exec& e : execs_)
      if (!MXF_OK(api.dnnl_primitive_execute(e.prim, s, static_cast<int>(e.bound.size()), e.bound.data())))
        throw OpError("oneDNN failed to run " + e.what);
    check(api.dnnl_stream_wait(s), "waiting for the stream");
  }

 private:
  enum StorageKind { kArena, kUser, kOwned };
  struct Storage {
    StorageKind kind = kArena;
    size_t bytes = 0, offset = 0;
    int first = INT_MAX, last = -1;  // the execs using it (a root's: its whole tree's)
    std::vector<int> values;         // the region values that live (or lived) in it (kept at the root)
    int parent = -1;                 // a slice of another storage (a concatenation's), at byte `sub`
    size_t sub = 0;
  };
  struct Tensor {
    const_dnnl_memory_desc_t md = nullptr;
    int storage = -1;
    dnnl_memory_t mem = nullptr;
    void* handle = DNNL_MEMORY_ALLOCATE;  // kOwned: its buffer (or allocated by oneDNN)
  };
  struct Exec {
    dnnl_primitive_t prim = nullptr;
    std::vector<std::pair<int, int>> args;  // (DNNL_ARG_*, tensor)
    std::vector<dnnl_exec_arg_t> bound;
    std::string what;
  };
  struct User {  // a data input or output's tensor, bound per call
    bool output;
    int index, tensor;
  };
  // a convolution's weights as the primitive reads them, made from the parameters per version
  struct ConvPack {
    const PlanOp* po;
    Dims wdims;                   // (O, C, KH, KW) or (G, O/G, C/G, KH, KW)
    dnnl_memory_t user = nullptr; // float32 plain, over the parameter (or the folded copy)
    dnnl_primitive_t reorder = nullptr;
    int packed = -1, bias = -1;   // tensors
    std::vector<float> folded, bias_values;
    bool transposed = false;      // a deconvolution: the parameter is (C, O, KH, KW)
  };
  // A constant operand of a binary primitive (a BatchNorm's scale or shift, the pooling divisor
  // fix): float32 values written plain, reordered into the layout the primitive reads -- oneDNN's
  // binary kernels take their second operand only in the first's layout family (a plain
  // (1, C, 1, 1) beside a blocked source runs its reference code).
  struct Const {
    std::vector<float> values;
    dnnl_memory_t plain = nullptr;
    dnnl_primitive_t reorder = nullptr;
    int tensor = -1;
  };
  struct BnPack {  // a BatchNorm not folded: y = x·scale + shift
    const Op* op;
    Const *scale, *shift;
  };

  // ---- descriptors, tensors, execs ----------------------------------------------------------
  static void check(dnnl_status_t st, const std::string& what) {
    if (st != dnnl_success) throw OpError("oneDNN failed " + what + " (status " + std::to_string(st) + ")");
  }
  const_dnnl_memory_desc_t keep(dnnl_memory_desc_t m) {
    if (m) mds.push_back(m);
    return m;
  }
  const_dnnl_memory_desc_t md_tag(const Dims& d, dnnl_data_type_t dt, dnnl_format_tag_t tag) {
    const_dnnl_memory_desc_t m = md(static_cast<int>(d.size()), d.data(), tag, dt);
    if (!m) throw OpError("oneDNN could not describe a tensor of " + dims_str(d));
    return m;
  }
  const_dnnl_memory_desc_t plain(const Dims& d, dnnl_data_type_t dt) {
    dnnl_dims_t st;
    int64_t s = 1;
    for (int i = static_cast<int>(d.size()) - 1; i >= 0; --i) st[i] = s, s *= d[i];
    dnnl_memory_desc_t m = nullptr;
    check(api.dnnl_memory_desc_create_with_strides(&m, static_cast<int>(d.size()), d.data(), dt, st),
          "creating a descriptor");
    return keep(m);
  }
  const_dnnl_memory_desc_t query(const_dnnl_primitive_desc_t pd, dnnl_query_t what) {
    const_dnnl_memory_desc_t q = api.dnnl_primitive_desc_query_md(pd, what, 0);
    dnnl_memory_desc_t m = nullptr;
    if (!q || !MXF_OK(api.dnnl_memory_desc_clone(&m, q))) throw OpError("oneDNN gave no memory descriptor");
    return keep(m);
  }
  bool same(const_dnnl_memory_desc_t x, const_dnnl_memory_desc_t y) const {
    return api.dnnl_memory_desc_equal(x, y) != 0;
  }
  int new_storage(StorageKind k, size_t bytes) {
    Storage s;
    s.kind = k;
    s.bytes = bytes;
    storages_.push_back(s);
    return static_cast<int>(storages_.size()) - 1;
  }
  int new_tensor(const_dnnl_memory_desc_t md, int storage) {
    Tensor t;
    t.md = md;
    t.storage = storage;
    tensors_.push_back(t);
    return static_cast<int>(tensors_.size()) - 1;
  }
  int arena_tensor(const_dnnl_memory_desc_t md) {
    return new_tensor(md, new_storage(kArena, api.dnnl_memory_desc_get_size(md)));
  }
  int owned_tensor(const_dnnl_memory_desc_t md, void* handle) {
    const int t = new_tensor(md, new_storage(kOwned, api.dnnl_memory_desc_get_size(md)));
    tensors_[t].handle = handle;
    return t;
  }
  // The layout oneDNN's binary primitive wants for a second operand of dims `d` beside src0.
  const_dnnl_memory_desc_t like(const_dnnl_memory_desc_t src0, const Dims& d) {
    dnnl_primitive_desc_t pd = nullptr;
    if (!MXF_OK(api.dnnl_binary_primitive_desc_create(&pd, api.engine, dnnl_binary_mul, src0,
                                                      md_tag(d, dnnl_f32, dnnl_format_tag_any), src0, nullptr)))
      return plain(d, dnnl_f32);
    dnnl_memory_desc_t m = nullptr;
    const bool ok = MXF_OK(api.dnnl_memory_desc_clone(&m, api.dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 1)));
    api.dnnl_primitive_desc_destroy(pd);
    return ok ? keep(m) : plain(d, dnnl_f32);
  }
  Const* constant(const Dims& d, const_dnnl_memory_desc_t md, const std::string& what) {
    consts_.push_back(std::make_unique<Const>());
    Const* c = consts_.back().get();
    c->values.assign(numel(d), 0.f);
    const_dnnl_memory_desc_t pm = plain(d, dnnl_f32);
    check(api.dnnl_memory_create(&c->plain, pm, api.engine, c->values.data()), "creating a memory");
    mems.push_back(c->plain);
    c->tensor = owned_tensor(md, DNNL_MEMORY_ALLOCATE);
    c->reorder = primitive(reorder_pd(pm, md, what), what);
    return c;
  }
  const_dnnl_memory_desc_t md_of(int t) const { return tensors_[t].md; }
  int storage_of(int t) const { return tensors_[t].storage; }
  int root(int s) const {
    while (storages_[s].parent >= 0) s = storages_[s].parent;
    return s;
  }
  size_t abs_offset(int s) const {
    return storages_[s].parent < 0 ? storages_[s].offset : abs_offset(storages_[s].parent) + storages_[s].sub;
  }
  void lives_in(int value, int tensor) { storages_[root(storage_of(tensor))].values.push_back(value); }

  dnnl_primitive_t primitive(dnnl_primitive_desc_t pd, const std::string& what) {
    pds.push_back(pd);
    dnnl_primitive_t p = prim(pd, true);
    if (!p) throw OpError("oneDNN could not create the primitive of " + what);
    return p;
  }
  void exec(dnnl_primitive_desc_t pd, std::vector<std::pair<int, int>> args, const std::string& what) {
    Exec e;
    e.prim = primitive(pd, what);
    e.args = std::move(args);
    e.what = what;
    execs_.push_back(std::move(e));
    std::string line = what + ": " + impl_name(pd);
    const_dnnl_memory_desc_t src = api.dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                             dst = api.dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0);
    if (src || dst) line += " " + layout_str(src) + " -> " + layout_str(dst);
    plan_text_ += line + "\n";
  }
  dnnl_primitive_desc_t reorder_pd(const_dnnl_memory_desc_t from, const_dnnl_memory_desc_t to, const std::string& what) {
    dnnl_primitive_desc_t pd = nullptr;
    if (!MXF_OK(api.dnnl_reorder_primitive_desc_create(&pd, from, api.engine, to, api.engine, nullptr)))
      throw OpError("oneDNN has no reorder for " + what + " (" + layout_str(from) + " -> " + layout_str(to) + ")");
    return pd;
  }
  void copy(int from, int to, const std::string& what) {
    exec(reorder_pd(md_of(from), md_of(to), what), {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}}, what);
  }

  // ---- values ---------------------------------------------------------------------------------
  std::string vname(int v) const { return "value " + std::to_string(v); }
  bool is_data(int v) const { return v < prog_->num_data; }

  // Value v in layout md: its home tensor, or a reordered copy made once (at its first reader).
  int view(int v, const_dnnl_memory_desc_t md) {
    if (same(md_of(home_[v]), md)) return home_[v];
    for (int t : views_[v])
      if (same(md_of(t), md)) return t;
    const int t = arena_tensor(md);
    lives_in(v, t);
    copy(home_[v], t, vname(v) + " to " + layout_str(md));
    views_[v].push_back(t);
    return t;
  }
  // The layout a value entering the region takes inside it where its reader is not a convolution
  // (a convolution picks its own): what a convolution would write for its shape.
  const_dnnl_memory_desc_t preferred(const Dims& d) {
    if (d.size() != 4) return plain(d, dt_);
    if (cfg_.nhwc) return md_tag(d, dt_, dnnl_nhwc);
    const int64_t C = d[1];
    const_dnnl_memory_desc_t any = md_tag(d, dt_, dnnl_format_tag_any);
    const_dnnl_memory_desc_t w = md_tag({C, C, 1, 1}, dt_, dnnl_format_tag_any);
    const dnnl_dims_t one = {1, 1}, zero = {0, 0};
    dnnl_primitive_desc_t pd = nullptr;
    if (!MXF_OK(api.dnnl_convolution_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference,
                                                                   dnnl_convolution_direct, any, w, nullptr, any,
                                                                   one, zero, zero, zero, nullptr)))
      return md_tag(d, dt_, dnnl_nhwc);
    const_dnnl_memory_desc_t m = query(pd, dnnl_query_dst_md);
    api.dnnl_primitive_desc_destroy(pd);
    return m;
  }
  // The md a non-convolution reader reads value v in (without making the copy yet).
  const_dnnl_memory_desc_t inside_md(int v) {
    if (!is_data(v)) return md_of(home_[v]);
    auto it = preferred_.find(v);
    if (it == preferred_.end()) it = preferred_.emplace(v, preferred(dims_[v])).first;
    return it->second;
  }
  int inside(int v) { return view(v, inside_md(v)); }

  // Whether tensor t may be overwritten by the op at plan position `pos`: an arena buffer every
  // value of which is read last by this op at the latest and is no output.
  bool writable(int t, int pos) const {
    const Storage& s = storages_[root(storage_of(t))];
    if (s.kind != kArena) return false;
    for (int v : s.values)
      if (last_read_[v] > pos || output_[v]) return false;
    return true;
  }

  // ---- post steps -------------------------------------------------------------------------------
  int sum_item(const std::vector<Item>& items) const {
    for (size_t i = 0; i < items.size(); ++i)
      if (items[i].kind == Item::Add && items[i].value >= 0) return static_cast<int>(i);
    return -1;
  }
  const_dnnl_memory_desc_t item_md(const Item& it) {
    return it.tensor >= 0 ? md_of(it.tensor) : it.md ? it.md : inside_md(it.value);
  }
  // The attribute with the items as post-ops (*attr null for Fuse::None); false where oneDNN
  // refuses the post-ops themselves.
  bool attr_for(const std::vector<Item>& items, Fuse f, dnnl_primitive_attr_t* attr) {
    *attr = nullptr;
    if (f == Fuse::None || items.empty()) return true;
    dnnl_post_ops_t po = nullptr;
    bool ok = MXF_OK(api.dnnl_primitive_attr_create(attr)) && MXF_OK(api.dnnl_post_ops_create(&po));
    const int sum = f == Fuse::Sum ? sum_item(items) : -1;
    for (size_t i = 0; ok && i < items.size(); ++i) {
      const Item& it = items[i];
      if (static_cast<int>(i) == sum)
        ok = MXF_OK(api.dnnl_post_ops_append_sum(po, 1.f, 0, dnnl_data_type_undef));
      else if (it.kind == Item::Elt)
        ok = MXF_OK(api.dnnl_post_ops_append_eltwise(po, it.alg, it.a, it.b));
      else
        ok = MXF_OK(api.dnnl_post_ops_append_binary(po, it.kind == Item::Add ? dnnl_binary_add : dnnl_binary_mul,
                                                     item_md(it)));
    }
    if (ok) ok = MXF_OK(api.dnnl_primitive_attr_set_post_ops(*attr, po));
    if (po) api.dnnl_post_ops_destroy(po);
    if (!ok && *attr) {
      api.dnnl_primitive_attr_destroy(*attr);
      *attr = nullptr;
    }
    return ok;
  }

  // oneDNN 3.2 misreads a binary post-op whose operand is broadcast over the batch, (1, C, 1, 1)
  // per channel, when the destination has a batch over 1 and one spatial position (N, C, 1, 1): every
  // channel was given channel 0's operand (a BatchNorm's shift after its scale, measured on the
  // x64 jit binary and convolution kernels; its main binary operand is read right).  Such items run
  // as primitives of their own there (Fuse::None).
  bool broadcast_post_op_misread(const std::vector<Item>& items, Fuse f, const_dnnl_memory_desc_t D) const {
    const Dims dd = dims_of(D);
    if (dd.size() < 3 || dd[0] <= 1) return false;
    int64_t spatial = 1;
    for (size_t i = 2; i < dd.size(); ++i) spatial *= dd[i];
    if (spatial != 1) return false;
    const int sum = f == Fuse::Sum ? sum_item(items) : -1;
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      if (it.kind == Item::Elt || static_cast<int>(i) == sum) continue;
      const Dims od = it.tensor >= 0 ? dims_of(md_of(it.tensor)) : dims_[it.value];
      if (!od.empty() && od[0] == 1) return true;
    }
    return false;
  }
  Dims dims_of(const_dnnl_memory_desc_t md) const {
    int nd = 0;
    const dnnl_dims_t* d = nullptr;
    if (!md || !MXF_OK(api.dnnl_memory_desc_query(md, dnnl_query_ndims_s32, &nd)) ||
        !MXF_OK(api.dnnl_memory_desc_query(md, dnnl_query_dims, &d)))
      return Dims();
    return Dims(*d, *d + nd);
  }

  struct Choice {
    dnnl_primitive_desc_t pd = nullptr;
    Fuse fuse = Fuse::None;
    int variant = 0;
  };
  // The first primitive descriptor `make(attr, variant)` gives with one of oneDNN's direct kernels,
  // trying the items fused (as sum + post-ops, as post-ops) before separately, and each variant
  // (e.g. a source layout) in order; failing that the first gemm-based one, then the first reference
  // one (dnnl_impl_rank).  A convolution reading a plain value (a grouped convolution's, which only
  // oneDNN's gemm kernel takes on AVX2 where a group is narrower than a vector) thus reads it
  // reordered into the layout its direct kernel picks rather than running gemm on the plain layout.
  Choice choose(const std::vector<Item>& items, bool allow_sum, int variants,
                const std::function<dnnl_primitive_desc_t(const_dnnl_primitive_attr_t, int)>& make,
                const std::string& what) {
    std::vector<Fuse> modes;
    if (!items.empty()) {
      if (allow_sum && sum_item(items) >= 0) modes.push_back(Fuse::Sum);
      modes.push_back(Fuse::Binary);
    }
    modes.push_back(Fuse::None);
    Choice best;
    int best_rank = 4;
    for (Fuse f : modes)
      for (int v = 0; v < variants; ++v) {
        dnnl_primitive_attr_t attr = nullptr;
        if (!attr_for(items, f, &attr)) continue;
        dnnl_primitive_desc_t pd = make(attr, v);
        if (attr) api.dnnl_primitive_attr_destroy(attr);
        if (!pd) continue;
        if (f != Fuse::None && broadcast_post_op_misread(items, f, query(pd, dnnl_query_dst_md))) {
          api.dnnl_primitive_desc_destroy(pd);
          continue;
        }
        const int rank = dnnl_impl_rank(pd);
        if (rank >= best_rank) {
          api.dnnl_primitive_desc_destroy(pd);
          continue;
        }
        if (best.pd) api.dnnl_primitive_desc_destroy(best.pd);
        best = {pd, f, v};
        best_rank = rank;
        if (rank == 0) return best;
      }
    if (!best.pd)
      throw OpError(what + ": oneDNN has no primitive for it on this CPU" +
                    (dt_ == dnnl_bf16 ? " in bfloat16 (which needs avx512_bf16 or amx_bf16)" : ""));
    return best;
  }

  // The binary post-ops' operands (DNNL_ARG_ATTR_MULTIPLE_POST_OP(i) | DNNL_ARG_SRC_1), after the
  // choice: a region value in the layout the post-op was created with.
  void bind_items(std::vector<std::pair<int, int>>* args, const std::vector<Item>& items, Fuse f) {
    if (f == Fuse::None) return;
    const int sum = f == Fuse::Sum ? sum_item(items) : -1;
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      if (it.kind == Item::Elt || static_cast<int>(i) == sum) continue;
      const int t = it.tensor >= 0 ? it.tensor : view(it.value, item_md(it));
      args->push_back({DNNL_ARG_ATTR_MULTIPLE_POST_OP(static_cast<int>(i)) | DNNL_ARG_SRC_1, t});
    }
  }

  // The items as primitives of their own, in place on dst (Fuse::None).
  void run_items_apart(const std::vector<Item>& items, int dst, const std::string& what) {
    const_dnnl_memory_desc_t D = md_of(dst);
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      const std::string w = what + " post step " + std::to_string(i);
      if (it.kind == Item::Elt) {
        dnnl_primitive_desc_t pd = nullptr;
        if (!MXF_OK(api.dnnl_eltwise_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference, it.alg, D,
                                                                   D, it.a, it.b, nullptr)))
          throw OpError(w + ": oneDNN has no eltwise primitive for it");
        exec(pd, {{DNNL_ARG_SRC, dst}, {DNNL_ARG_DST, dst}}, w);
        continue;
      }
      const dnnl_alg_kind_t alg = it.kind == Item::Add ? dnnl_binary_add : dnnl_binary_mul;
      // the operand in its own layout, else in dst's (a full value) or plain (a gate)
      std::vector<const_dnnl_memory_desc_t> cands = {item_md(it)};
      if (it.tensor < 0) cands.push_back(same_dims(it.value, D) ? D : plain(dims_[it.value], dt_));
      Choice c = choose({}, false, static_cast<int>(cands.size()),
                        [&](const_dnnl_primitive_attr_t, int v) -> dnnl_primitive_desc_t {
                          dnnl_primitive_desc_t pd = nullptr;
                          return MXF_OK(api.dnnl_binary_primitive_desc_create(&pd, api.engine, alg, D, cands[v], D,
                                                                              nullptr)) ? pd : nullptr;
                        }, w);
      const int src1 = it.tensor >= 0 ? it.tensor : view(it.value, cands[c.variant]);
      exec(c.pd, {{DNNL_ARG_SRC_0, dst}, {DNNL_ARG_SRC_1, src1}, {DNNL_ARG_DST, dst}}, w);
    }
  }
  bool same_dims(int v, const_dnnl_memory_desc_t md) const {
    int nd = 0;
    const dnnl_dims_t* d = nullptr;
    api.dnnl_memory_desc_query(md, dnnl_query_ndims_s32, &nd);
    api.dnnl_memory_desc_query(md, dnnl_query_dims, &d);
    return Dims(*d, *d + nd) == dims_[v];
  }

  // The op's primitive with its items, and its value's home: exec the choice, fused or apart.
  void finish(const PlanOp& po, const Choice& c, std::vector<std::pair<int, int>> args, int dst,
              const std::vector<Item>& items, const std::string& what) {
    bind_items(&args, items, c.fuse);
    const char* how = items.empty() ? "" : c.fuse == Fuse::Sum ? " [sum in place]"
                                         : c.fuse == Fuse::Binary ? " [post-ops]" : " [steps apart]";
    exec(c.pd, std::move(args), what + how);
    if (c.fuse == Fuse::None) run_items_apart(items, dst, what);
    home_[po.out] = dst;
    lives_in(po.out, dst);
  }

  std::string op_what(const PlanOp& po) const {
    return "op " + std::to_string(po.index) + " (" + op_name(po.op->kind) + ")";
  }
  std::vector<Item> items_of(const PlanOp& po) const {
    std::vector<Item> items;
    for (const Step& s : po.post) items.push_back(item_of(s));
    return items;
  }
  // Whether a binary item reads a region value stored in tensor t's buffer.
  bool reads_buffer_of(const std::vector<Item>& items, int t) {
    const int r = root(storage_of(t));
    for (const Item& it : items)
      if (it.kind != Item::Elt && it.value >= 0 && home_[it.value] >= 0) {
        if (root(storage_of(home_[it.value])) == r) return true;
        for (int vw : views_[it.value])
          if (root(storage_of(vw)) == r) return true;
      }
    return false;
  }
  // dst of an elementwise-like op reading tensor `src`: in place where src's buffer is free
  int dst_for(int src, int pos) {
    return writable(src, pos) ? src : arena_tensor(md_of(src));
  }

  // ---- the ops ------------------------------------------------------------------------------------
  void conv(const PlanOp& po, int pos) {
    const Op& op = *po.op;
    const std::string what = op_what(po);
    const int x = op.in[0];
    const Dims &xd = dims_[x], &yd = dims_[po.out];
    const int64_t G = op.groups, O = op.filters, C = xd[1];
    ConvPack pk;
    pk.po = &po;
    pk.transposed = op.kind == OpKind::Deconv;  // oneDNN's (O, I, KH, KW) over MXNet's (C, O, KH, KW): "iohw"
    pk.wdims = G > 1 ? Dims{G, O / G, C / G, op.kernel[0], op.kernel[1]} : Dims{O, C, op.kernel[0], op.kernel[1]};
    const_dnnl_memory_desc_t wany = md_tag(pk.wdims, dt_, dnnl_format_tag_any);
    const bool bias = op.bias >= 0 || po.bn;
    const_dnnl_memory_desc_t bmd = bias ? plain({O}, dnnl_f32) : nullptr;
    const_dnnl_memory_desc_t dst = md_tag(yd, dt_, cfg_.nhwc ? dnnl_nhwc : dnnl_format_tag_any);
    const_dnnl_memory_desc_t src_any = md_tag(xd, dt_, dnnl_format_tag_any);
    // A convolution reads its producer's layout; where that has no direct kernel (a grouped
    // convolution's plain output, choose), the channel-blocked layout, reordered once; a data input
    // in the layout the convolution picks.
    std::vector<const_dnnl_memory_desc_t> srcs;
    if (!is_data(x)) {
      srcs.push_back(md_of(home_[x]));
      if (!cfg_.nhwc && xd.size() == 4) srcs.push_back(md_tag(xd, dt_, cfg_.blocked));
    }
    srcs.push_back(src_any);
    // A deconvolution reads the layout oneDNN picks for it first: on AVX2 its NHWC brgconv_strided
    // kernel, where a channel-blocked source gets its backward-data convolution (conv:any+jit:avx2),
    // measured 1.8-2x slower for simple-pose's 4x4/2 layers (22.2 vs 12.1 ms at 256 channels 32x24 in
    // isolation, 53 ms in the model) -- slower than MXNet's own GEMM-based Deconvolution.
    if (pk.transposed) std::rotate(srcs.begin(), srcs.end() - 1, srcs.end());
    // a deconvolution's adj extra rows at the end come out of its padding there (program: adj <= pad)
    const dnnl_dims_t strides = {op.stride[0], op.stride[1]}, dil = {op.dilate[0] - 1, op.dilate[1] - 1},
                      pad = {op.pad[0], op.pad[1]}, pad_r = {op.pad[0] - op.adj[0], op.pad[1] - op.adj[1]};
    std::vector<Item> items = items_of(po);
    auto make = [&](const_dnnl_primitive_attr_t attr, int v) -> dnnl_primitive_desc_t {
      dnnl_primitive_desc_t pd = nullptr;
      const dnnl_status_t st =
          pk.transposed
              ? api.dnnl_deconvolution_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference,
                                                                     dnnl_deconvolution_direct, srcs[v], wany, bmd,
                                                                     dst, strides, dil, pad, pad_r, attr)
              : api.dnnl_convolution_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference,
                                                                   dnnl_convolution_direct, srcs[v], wany, bmd, dst,
                                                                   strides, dil, pad, pad, attr);
      return MXF_OK(st) ? pd : nullptr;
    };
    Choice c = choose(items, true, static_cast<int>(srcs.size()), make, what);
    const int src = view(x, query(c.pd, dnnl_query_src_md));
    const_dnnl_memory_desc_t D = query(c.pd, dnnl_query_dst_md);
    // sum writes in place over the added value: where that value is dead after this op, in the
    // destination's layout and not the source.  Otherwise the add is a binary post-op reading the
    // value in the destination's layout (a copy only where the value is in another).
    bool in_place = false;
    if (c.fuse == Fuse::Sum) {
      Item& add = items[sum_item(items)];
      const int hr = home_[add.value];
      in_place = !is_data(add.value) && same(md_of(hr), D) && writable(hr, pos) && storage_of(hr) != storage_of(src);
      if (!in_place) {
        add.md = D;
        api.dnnl_primitive_desc_destroy(c.pd);
        const int v = c.variant;  // the source layout chosen above
        c = choose(items, false, 1, [&](const_dnnl_primitive_attr_t attr, int) { return make(attr, v); }, what);
        D = query(c.pd, dnnl_query_dst_md);
      }
    }
    pk.packed = owned_tensor(query(c.pd, dnnl_query_weights_md), DNNL_MEMORY_ALLOCATE);
    if (bias) {
      pk.bias_values.assign(O, 0.f);
      pk.bias = owned_tensor(bmd, pk.bias_values.data());
    }
    const int out = in_place ? home_[items[sum_item(items)].value] : arena_tensor(D);
    std::vector<std::pair<int, int>> args = {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, pk.packed}, {DNNL_ARG_DST, out}};
    if (bias) args.push_back({DNNL_ARG_BIAS, pk.bias});
    const_dnnl_memory_desc_t user_w = pk.transposed ? md_tag(pk.wdims, dnnl_f32, dnnl_iohw) : plain(pk.wdims, dnnl_f32);
    check(api.dnnl_memory_create(&pk.user, user_w, api.engine, DNNL_MEMORY_NONE), "creating a memory");
    mems.push_back(pk.user);
    dnnl_primitive_desc_t rpd = reorder_pd(user_w, md_of(pk.packed), what + " weights");
    pk.reorder = primitive(rpd, what + " weights");
    plan_text_ += what + " weights: " + impl_name(rpd) + " " + layout_str(user_w) + " -> " +
                  layout_str(md_of(pk.packed)) + "\n";
    if (po.bn) pk.folded.resize(numel(pk.wdims));
    convs_.push_back(std::move(pk));
    finish(po, c, std::move(args), out, items, what + (po.bn ? " + batchnorm" : ""));
  }

  void pool(const PlanOp& po) {
    const Op& op = *po.op;
    const std::string what = op_what(po);
    const int x = op.in[0];
    const Dims &xd = dims_[x], &yd = dims_[po.out];
    const int src = inside(x);
    int64_t k[2], s[2], pl[2], pr[2];
    bool fix = false;  // MXNet's divisor differs from oneDNN's at the ceil border (below)
    for (int i = 0; i < 2; ++i) {
      if (op.global) {
        k[i] = xd[2 + i], s[i] = 1, pl[i] = pr[i] = 0;
      } else {
        k[i] = op.kernel[i], s[i] = op.stride[i], pl[i] = op.pad[i];
        pr[i] = pool_pad_right(op, xd[2 + i], i);
        if (pr[i] > pl[i]) fix = true;
      }
    }
    // MXNet's average (pool.h): the divisor counts the window's elements clipped to [-pad, H + pad)
    // with count_include_pad, to [0, H) without.  oneDNN's exclude_padding is the latter exactly;
    // its include_padding divides by KH·KW, which is MXNet's wherever no window reaches past
    // H + pad -- i.e. always but for `full` with the ceil's extra right padding.  Without declared
    // padding that divisor is exclude_padding's; with it, the border windows' results are scaled
    // by KH·KW / MXNet's divisor (a constant (1, 1, OH, OW) tensor, the first post step).
    dnnl_alg_kind_t alg = dnnl_pooling_max;
    std::vector<Item> items;
    if (!op.max) {
      const bool exclude = !op.include_pad || (op.full && op.pad[0] == 0 && op.pad[1] == 0);
      alg = exclude ? dnnl_pooling_avg_exclude_padding : dnnl_pooling_avg_include_padding;
      fix = fix && !exclude && !op.global;
    } else {
      fix = false;
    }
    for (const Step& st : po.post) items.push_back(item_of(st));
    const_dnnl_memory_desc_t dst = md_tag(yd, dt_, dnnl_format_tag_any);
    const dnnl_dims_t dk = {k[0], k[1]}, ds = {s[0], s[1]}, dd = {0, 0}, dpl = {pl[0], pl[1]}, dpr = {pr[0], pr[1]};
    // with the fix, which comes before the post steps and which oneDNN's pooling takes only with its
    // reference code as a post-op, the steps run apart
    Choice c = choose(fix ? std::vector<Item>() : items, false, 1,
                      [&](const_dnnl_primitive_attr_t attr, int) -> dnnl_primitive_desc_t {
      dnnl_primitive_desc_t pd = nullptr;
      return MXF_OK(api.dnnl_pooling_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference, alg,
                                                                   md_of(src), dst, ds, dk, dd, dpl, dpr, attr))
                 ? pd : nullptr;
    }, what);
    const int out = arena_tensor(query(c.pd, dnnl_query_dst_md));
    if (fix) {
      items.insert(items.begin(), divisor_fix(op, xd, yd, md_of(out), what));
      c.fuse = Fuse::None;
    }
    finish(po, c, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, out}}, out, items, what);
  }
  Item divisor_fix(const Op& op, const Dims& xd, const Dims& yd, const_dnnl_memory_desc_t D, const std::string& what) {
    const int64_t OH = yd[2], OW = yd[3];
    auto span = [&](int i, int64_t o) {  // MXNet's window extent along axis i (padding counted)
      const int64_t start = o * op.stride[i] - op.pad[i];
      return std::min(start + op.kernel[i], xd[2 + i] + op.pad[i]) - start;
    };
    const Dims fd = {1, 1, OH, OW};
    Const* c = constant(fd, like(D, fd), what + " divisor");
    std::vector<float>& f = c->values;
    const float kk = static_cast<float>(op.kernel[0] * op.kernel[1]);
    for (int64_t h = 0; h < OH; ++h)
      for (int64_t w = 0; w < OW; ++w) f[h * OW + w] = kk / static_cast<float>(span(0, h) * span(1, w));
    Item it;
    it.kind = Item::Mul;
    it.tensor = c->tensor;
    return it;
  }

  void concat(const PlanOp& po, int pos) {
    const Op& op = *po.op;
    const std::string what = op_what(po);
    std::vector<int> srcs;
    std::vector<const_dnnl_memory_desc_t> mds_in;
    for (int v : op.in) {
      srcs.push_back(inside(v));
      mds_in.push_back(md_of(srcs.back()));
    }
    const Dims& yd = dims_[po.out];
    // the destination: the layout oneDNN picks from the sources, else the first source's tag family
    std::vector<const_dnnl_memory_desc_t> dsts = {md_tag(yd, dt_, dnnl_format_tag_any)};
    if (yd.size() == 4) dsts.push_back(md_tag(yd, dt_, dnnl_nhwc));
    const std::vector<Item> items = items_of(po);
    Choice c = choose(items, false, static_cast<int>(dsts.size()),
                      [&](const_dnnl_primitive_attr_t attr, int v) -> dnnl_primitive_desc_t {
                        dnnl_primitive_desc_t pd = nullptr;
                        return MXF_OK(api.dnnl_concat_primitive_desc_create(&pd, api.engine, dsts[v],
                                                                            static_cast<int>(mds_in.size()), 1,
                                                                            mds_in.data(), attr)) ? pd : nullptr;
                      }, what);
    const_dnnl_memory_desc_t D = query(c.pd, dnnl_query_dst_md);
    if (concat_in_place(po, pos, D, srcs, items, what)) {
      api.dnnl_primitive_desc_destroy(c.pd);
      return;
    }
    const int out = arena_tensor(D);
    std::vector<std::pair<int, int>> args = {{DNNL_ARG_DST, out}};
    for (size_t i = 0; i < srcs.size(); ++i) args.push_back({DNNL_ARG_MULTIPLE_SRC + static_cast<int>(i), srcs[i]});
    finish(po, c, std::move(args), out, items, what);
  }

  // A concatenation with nothing copied, where its layout makes each source a contiguous slice:
  // batch 1, channels blocked by 16 or 8 (or plain), each source's channels a multiple of the
  // block, each in the same layout.  The sources' buffers become slices of the result's (their
  // producers wrote there already: the allocator places the tree once), a source whose buffer
  // cannot move (a data input, a slice of another concatenation, read twice here, or -- with post
  // steps to run in place -- still read after this op) is copied into its slice.  DenseNet's
  // concatenations then cost nothing: each layer's features land beside the ones before.
  bool concat_in_place(const PlanOp& po, int pos, const_dnnl_memory_desc_t D, const std::vector<int>& srcs,
                       const std::vector<Item>& items, const std::string& what) {
    const Op& op = *po.op;
    const Dims& yd = dims_[po.out];
    if (yd.size() != 4 || yd[0] != 1) return false;
    if (const char* how = std::getenv("MXFUSION_REGION_CONCAT"))  // =copy: oneDNN's concat (A/B timing)
      if (std::string(how) == "copy") return false;
    const std::pair<dnnl_format_tag_t, int64_t> tags[] = {{dnnl_aBcd16b, 16}, {dnnl_aBcd8b, 8}, {dnnl_abcd, 1}};
    dnnl_format_tag_t tag = dnnl_format_tag_undef;
    int64_t blk = 0;
    for (const auto& t : tags)
      if (same(D, md_tag(yd, dt_, t.first))) tag = t.first, blk = t.second;
    if (!blk) return false;
    std::vector<size_t> offset;
    size_t at = 0;
    const size_t el = dt_ == dnnl_bf16 ? 2 : 4;
    for (size_t i = 0; i < srcs.size(); ++i) {
      const Dims& d = dims_[op.in[i]];
      if (d[1] % blk || !same(md_of(srcs[i]), md_tag(d, dt_, tag))) return false;
      offset.push_back(at);
      at += static_cast<size_t>(d[1] * d[2] * d[3]) * el;
    }
    const int whole = new_storage(kArena, api.dnnl_memory_desc_get_size(D));
    const int out = new_tensor(D, whole);
    int merged = 0;
    std::vector<int> taken;
    for (size_t i = 0; i < srcs.size(); ++i) {
      const int st = storage_of(srcs[i]);
      const bool movable = storages_[st].kind == kArena && storages_[st].parent < 0 &&
                           std::find(taken.begin(), taken.end(), st) == taken.end() &&
                           (items.empty() || writable(srcs[i], pos));
      if (movable) {
        storages_[st].parent = whole;
        storages_[st].sub = offset[i];
        std::vector<int>& vals = storages_[whole].values;
        vals.insert(vals.end(), storages_[st].values.begin(), storages_[st].values.end());
        storages_[st].values.clear();
        taken.push_back(st);
        ++merged;
      } else {
        const_dnnl_memory_desc_t md = md_of(srcs[i]);
        const int slice = new_storage(kArena, api.dnnl_memory_desc_get_size(md));
        storages_[slice].parent = whole;
        storages_[slice].sub = offset[i];
        copy(srcs[i], new_tensor(md, slice), what + " input " + std::to_string(i) + " into its slice");
      }
    }
    plan_text_ += what + ": in place, " + std::to_string(merged) + " of " + std::to_string(srcs.size()) +
                  " inputs written there by their producers\n";
    if (!items.empty()) run_items_apart(items, out, what);
    home_[po.out] = out;
    lives_in(po.out, out);
    return true;
  }

  // add, mul, act and a BatchNorm not folded: one binary or eltwise primitive over `a`, in place
  // where a's buffer is free, with the rest of the items as post-ops.
  void elementwise(const PlanOp& po, int pos) {
    const Op& op = *po.op;
    const std::string what = op_what(po);
    std::vector<Item> items = items_of(po);
    Item first;  // the op's own computation
    int a = op.in[0];
    if (op.kind == OpKind::Add || op.kind == OpKind::Mul) {
      first.kind = op.kind == OpKind::Add ? Item::Add : Item::Mul;
      first.value = op.in[1];
      // x + v == v + x: compute in place over whichever operand's buffer is free
      if (op.kind == OpKind::Add && !writable(inside(a), pos) && writable(inside(op.in[1]), pos))
        std::swap(a, first.value);
    } else if (op.kind == OpKind::BatchNorm) {
      Dims cd(dims_[a].size(), 1);
      cd[1] = dims_[a][1];
      const_dnnl_memory_desc_t cmd = like(inside_md(a), cd);
      BnPack bp{&op, constant(cd, cmd, what + " scale"), constant(cd, cmd, what + " shift")};
      bns_.push_back(bp);
      first.kind = Item::Mul;
      first.tensor = bp.scale->tensor;
      Item shift;
      shift.kind = Item::Add;
      shift.tensor = bp.shift->tensor;
      items.insert(items.begin(), shift);
    } else {  // act
      if (items.empty()) {  // the identity: the value is its input's (a buffer shared, never copied)
        const int t = inside(a);
        home_[po.out] = t;
        lives_in(po.out, t);
        return;
      }
      first = items.front();
      items.erase(items.begin());
    }
    const int src = inside(a);
    const_dnnl_memory_desc_t S = md_of(src);
    std::vector<const_dnnl_memory_desc_t> src1s;  // the second operand's layouts to try
    if (first.kind != Item::Elt) {
      if (first.tensor >= 0) {
        src1s.push_back(md_of(first.tensor));
      } else if (dims_[first.value] == dims_[a]) {
        src1s.push_back(inside_md(first.value));
        if (!same(src1s[0], S)) src1s.push_back(S);
      } else {  // a gate (N, C, 1, 1): its own layout, else plain
        src1s.push_back(inside_md(first.value));
        src1s.push_back(plain(dims_[first.value], dt_));
      }
    }
    const int variants = first.kind == Item::Elt ? 1 : static_cast<int>(src1s.size());
    Choice c = choose(items, false, variants, [&](const_dnnl_primitive_attr_t attr, int v) -> dnnl_primitive_desc_t {
      dnnl_primitive_desc_t pd = nullptr;
      dnnl_status_t st =
          first.kind == Item::Elt
              ? api.dnnl_eltwise_forward_primitive_desc_create(&pd, api.engine, dnnl_forward_inference, first.alg, S, S,
                                                               first.a, first.b, attr)
              : api.dnnl_binary_primitive_desc_create(&pd, api.engine,
                                                      first.kind == Item::Add ? dnnl_binary_add : dnnl_binary_mul, S,
                                                      src1s[v], S, attr);
      return MXF_OK(st) ? pd : nullptr;
    }, what);
    int src1 = -1;
    if (first.kind != Item::Elt)
      src1 = first.tensor >= 0 ? first.tensor : view(first.value, src1s[c.variant]);
    // in place only where no post step reads the buffer being overwritten (x · f(x) as an act op
    // with the steps [f…, mul x]: run apart, step 1 would overwrite the x that the last step reads;
    // oneDNN does not promise a binary post-op's operand may alias the destination either)
    const int out = reads_buffer_of(items, src) ? arena_tensor(S) : dst_for(src, pos);
    std::vector<std::pair<int, int>> args;
    if (first.kind == Item::Elt)
      args = {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, out}};
    else
      args = {{DNNL_ARG_SRC_0, src}, {DNNL_ARG_SRC_1, src1}, {DNNL_ARG_DST, out}};
    finish(po, c, std::move(args), out, items, what);
  }

  // ---- the whole region -----------------------------------------------------------------------------
  void build() {
    const auto t0 = std::chrono::steady_clock::now();
    const Program& p = *prog_;
    const int D = p.num_data, V = p.num_values();
    ops_ = plan(p);
    home_.assign(V, -1);
    views_.assign(V, {});
    last_read_.assign(V, -1);
    output_.assign(V, false);
    for (int v : p.outputs) output_[v] = true;
    for (int i = 0; i < static_cast<int>(ops_.size()); ++i) {
      for (int v : ops_[i].op->in) last_read_[v] = std::max(last_read_[v], i);
      for (const Step& s : ops_[i].post)
        if (s.kind != Step::Eltwise) last_read_[s.value] = std::max(last_read_[s.value], i);
    }
    plan_text_ = std::string("layout ") + (cfg_.nhwc ? "nhwc" : "any") + ", " + (cfg_.bf16 ? "bfloat16" : "float32") + "\n";
    for (int d = 0; d < D; ++d) {  // the data inputs: the caller's plain float32 arrays
      const int t = new_tensor(plain(dims_[d], dnnl_f32), new_storage(kUser, 0));
      user_.push_back({false, d, t});
      home_[d] = t;
      lives_in(d, t);
    }
    // The outputs (plain float32) are copied out as soon as their op has run, so that the buffers of
    // values a region gives back half-way (a backbone's stage read by a head) are free again for what
    // follows, as they would be between two regions; a value given back is never overwritten in
    // place (writable) nor absorbed into another op (plan counts outputs as readers).
    std::vector<bool> copied(p.outputs.size(), false);
    auto copy_out = [&](int value) {
      for (size_t k = 0; k < p.outputs.size(); ++k) {
        if (copied[k] || (value >= 0 && p.outputs[k] != value)) continue;
        const int v = p.outputs[k];
        const int t = new_tensor(plain(dims_[v], dnnl_f32), new_storage(kUser, 0));
        user_.push_back({true, static_cast<int>(k), t});
        copy(home_[v], t, "output " + std::to_string(k));
        copied[k] = true;
      }
    };
    for (int i = 0; i < static_cast<int>(ops_.size()); ++i) {
      const PlanOp& po = ops_[i];
      switch (po.op->kind) {
        case OpKind::Conv:
        case OpKind::Deconv: conv(po, i); break;
        case OpKind::Pool: pool(po); break;
        case OpKind::Concat: concat(po, i); break;
        default: elementwise(po, i); break;
      }
      copy_out(po.out);
    }
    copy_out(-1);
    allocate();
    plan_text_ += "built in " + std::to_string(ms_since(t0)) + " ms\n";
    publish_plan();
  }
  static long ms_since(std::chrono::steady_clock::time_point t0) {
    return static_cast<long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count());
  }
  void publish_plan() {
    if (const char* verbose = std::getenv("MXFUSION_REGION_VERBOSE"))
      if (*verbose && std::string(verbose) != "0") std::fprintf(stderr, "fused_region plan:\n%s", plan_text_.c_str());
    std::lock_guard<std::mutex> lk(g_plan_mu);
    g_last_plan = plan_text_;
  }

  // Buffers: each arena storage lives from its first exec to its last; storages whose lives
  // overlap get disjoint offsets (greedy, largest first), the rest share.
  void allocate() {
    for (size_t e = 0; e < execs_.size(); ++e)
      for (const auto& a : execs_[e].args) {
        Storage& s = storages_[root(storage_of(a.second))];
        s.first = std::min(s.first, static_cast<int>(e));
        s.last = std::max(s.last, static_cast<int>(e));
      }
    std::vector<int> order;
    for (size_t i = 0; i < storages_.size(); ++i)
      if (storages_[i].kind == kArena && storages_[i].parent < 0 && storages_[i].last >= 0)
        order.push_back(static_cast<int>(i));
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return storages_[x].bytes > storages_[y].bytes; });
    const size_t align = 64;
    std::vector<int> placed;
    size_t total = 0;
    for (int i : order) {
      Storage& s = storages_[i];
      std::vector<std::pair<size_t, size_t>> busy;  // [offset, end) of overlapping lives
      for (int j : placed) {
        const Storage& o = storages_[j];
        if (o.first <= s.last && s.first <= o.last) busy.push_back({o.offset, o.offset + o.bytes});
      }
      std::sort(busy.begin(), busy.end());
      size_t off = 0;
      for (const auto& b : busy) {
        if (off + s.bytes <= b.first) break;
        off = std::max(off, (b.second + align - 1) / align * align);
      }
      s.offset = off;
      total = std::max(total, off + s.bytes);
      placed.push_back(i);
    }
    arena_.reset(static_cast<char*>(std::aligned_alloc(4096, (std::max<size_t>(total, 1) + 4095) / 4096 * 4096)));
    if (!arena_) throw OpError("cannot allocate the region's " + std::to_string(total) + " bytes");
    for (Tensor& t : tensors_) {
      const Storage& s = storages_[t.storage];
      void* h = s.kind == kArena ? static_cast<void*>(arena_.get() + abs_offset(t.storage))
                                 : s.kind == kUser ? DNNL_MEMORY_NONE : t.handle;
      check(api.dnnl_memory_create(&t.mem, t.md, api.engine, h), "creating a memory");
      mems.push_back(t.mem);
    }
    for (Exec& e : execs_)
      for (const auto& a : e.args) e.bound.push_back({a.first, tensors_[a.second].mem});
    plan_text_ += "arena " + std::to_string(total) + " bytes\n";
  }

  // ---- weights ----------------------------------------------------------------------------------
  // Which parameters changed since the last call (ParamVersion, mxf_common.h: (data pointer, version),
  // or the contents of a version-0 temporary MXNet hands where its own oneDNN ops keep the array).
  std::vector<bool> changed_params(std::vector<MXTensor>& in) {
    const int D = prog_->num_data;
    const size_t P = prog_->params.size();
    std::vector<bool> changed(P, !packed_);
    seen_.resize(P);
    for (size_t k = 0; k < P; ++k) {
      if (seen_[k].changed(in[D + k])) changed[k] = true;
      if (seen_[k].temporary()) ++g_temporaries;
    }
    return changed;
  }

  // Packs what the changed parameters feed: a convolution's weights (BatchNorm folded: W·scale per
  // output channel, bias·scale + shift; cast to bfloat16 by the reorder), a BatchNorm's scale and
  // shift; on the first call also the constants.
  void repack_if_changed(std::vector<MXTensor>& in, dnnl_stream_t s) {
    const std::vector<bool> changed = changed_params(in);
    if (packed_ && std::find(changed.begin(), changed.end(), true) == changed.end()) return;
    try {
      repack(in, s, changed);
    } catch (...) {        // a pack cut short: the next call packs everything again
      for (ParamVersion& v : seen_) v.forget();
      packed_ = false;
      throw;
    }
  }

  void repack(std::vector<MXTensor>& in, dnnl_stream_t s, const std::vector<bool>& changed) {
    const auto t0 = std::chrono::steady_clock::now();
    ++g_packs;
    const int D = prog_->num_data;
    auto param = [&](int k) { return static_cast<const float*>(in[D + k].data_ptr); };
    auto touched = [&](std::initializer_list<int> ks) {
      for (int k : ks)
        if (k >= 0 && changed[k]) return true;
      return false;
    };
    auto bn_touched = [&](const Op* bn) { return bn && touched({bn->gamma, bn->beta, bn->mean, bn->var}); };
    // BatchNorm at inference: y = (x - mean)/sqrt(var + eps)·gamma + beta = x·scale + shift
    auto bn_affine = [&](const Op& bn, int64_t c, float* scale, float* shift) {
      const float g = bn.fix_gamma ? 1.f : param(bn.gamma)[c];
      scale[0] = g / std::sqrt(param(bn.var)[c] + bn.eps);
      shift[0] = param(bn.beta)[c] - param(bn.mean)[c] * scale[0];
    };
    auto run = [&](dnnl_primitive_t r, dnnl_memory_t from, dnnl_memory_t to, const std::string& what) {
      dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
      if (!MXF_OK(api.dnnl_primitive_execute(r, s, 2, args))) throw OpError("oneDNN failed to pack " + what);
    };
    for (ConvPack& pk : convs_) {
      const Op& op = *pk.po->op;
      if (!touched({op.weight, op.bias}) && !bn_touched(pk.po->bn)) continue;
      const float* w = param(op.weight);
      const float* b = op.bias >= 0 ? param(op.bias) : nullptr;
      const int64_t O = op.filters, per = numel(pk.wdims) / O;
      if (pk.po->bn) {
        // output channel o's weights: the runs of K at (c·O + o)·K -- one run of `per` for (O, …), C
        // runs of KH·KW for a deconvolution's (C, O, KH, KW)
        const int64_t K = pk.transposed ? op.kernel[0] * op.kernel[1] : per, runs = per / K;
        for (int64_t o = 0; o < O; ++o) {
          float scale, shift;
          bn_affine(*pk.po->bn, o, &scale, &shift);
          for (int64_t c = 0; c < runs; ++c)
            for (int64_t i = (c * O + o) * K; i < (c * O + o + 1) * K; ++i) pk.folded[i] = w[i] * scale;
          pk.bias_values[o] = (b ? b[o] : 0.f) * scale + shift;
        }
        w = pk.folded.data();
      } else if (b) {
        std::copy(b, b + O, pk.bias_values.begin());
      }
      check(api.dnnl_memory_set_data_handle(pk.user, const_cast<float*>(w)), "binding a weight");
      run(pk.reorder, pk.user, tensors_[pk.packed].mem, "the weights of op " + std::to_string(pk.po->index));
    }
    for (BnPack& bp : bns_) {
      if (packed_ && !bn_touched(bp.op)) continue;
      for (size_t c = 0; c < bp.scale->values.size(); ++c)
        bn_affine(*bp.op, c, &bp.scale->values[c], &bp.shift->values[c]);
      for (Const* c : {bp.scale, bp.shift}) run(c->reorder, c->plain, tensors_[c->tensor].mem, "a BatchNorm");
    }
    if (!packed_)
      for (const auto& c : consts_) run(c->reorder, c->plain, tensors_[c->tensor].mem, "a constant");
    check(api.dnnl_stream_wait(s), "packing the weights");
    if (!packed_) {  // the first packing's time, with the build's (first-call cost)
      plan_text_ += "weights packed in " + std::to_string(ms_since(t0)) + " ms\n";
      publish_plan();
    }
    packed_ = true;
  }

  struct Free {
    void operator()(char* p) const { std::free(p); }
  };

  const Program* prog_ = nullptr;
  std::vector<Dims> dims_;
  Config cfg_;
  dnnl_data_type_t dt_ = dnnl_f32;
  std::vector<PlanOp> ops_;
  std::vector<int> home_, last_read_;
  std::vector<std::vector<int>> views_;
  std::vector<bool> output_;
  std::map<int, const_dnnl_memory_desc_t> preferred_;
  std::vector<Storage> storages_;
  std::vector<Tensor> tensors_;
  std::vector<Exec> execs_;
  std::vector<User> user_;
  std::vector<ConvPack> convs_;
  std::vector<BnPack> bns_;
  std::vector<std::unique_ptr<Const>> consts_;
  std::unique_ptr<char, Free> arena_;
  std::vector<ParamVersion> seen_;  // each parameter as the last call saw it
  bool packed_ = false;
  std::string plan_text_;
  std::mutex mu_;
};

// ---------------------------------------------------------------------------------------------
// MXNet glue

Program parse(const Attrs& a) {
  if (!has_attr(a, "program")) throw OpError("attribute 'program' is required");
  const int64_t D = attr_int(a, "num_data", 0);
  if (D < 1 || D > 4096) throw OpError("attribute 'num_data' must be in [1, 4096]");
  Program p = parse_program(attr_str(a, "program", ""), static_cast<int>(D));
  if (!has_attr(a, "num_outputs")) throw OpError("attribute 'num_outputs' is required");
  const int64_t K = attr_int(a, "num_outputs", 0);
  if (K != static_cast<int64_t>(p.outputs.size()))
    throw OpError("attribute 'num_outputs' is " + std::to_string(K) + " but the program has " +
                  std::to_string(p.outputs.size()) + " outputs");
  return p;
}

bool is_bf16(const Attrs& a) {
  return attr_choice(a, "precision", "float32", {"float32", "bfloat16"}) == "bfloat16";
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded(kOp, [&] {
    const Program p = parse(a);
    is_bf16(a);
    *nin = p.num_data + static_cast<int>(p.params.size());
    *nout = static_cast<int>(p.outputs.size());
  });
}

Dims to_dims(const Shape& s) { return Dims(s.begin(), s.end()); }

MXReturnValue infer_shape(const Attrs& attrs, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded(kOp, [&] {
    const Program p = parse(attrs);
    const int D = p.num_data;
    std::vector<Dims> data;
    for (int i = 0; i < D; ++i) {
      const std::string what = "data input " + std::to_string(i);
      require_known_input(*in, i, what.c_str());
      data.push_back(to_dims((*in)[i]));
    }
    for (size_t k = 0; k < p.params.size(); ++k) {
      const std::string what = "parameter " + std::to_string(k);
      fill_input(in, D + k, Shape(p.params[k].begin(), p.params[k].end()), what.c_str());
    }
    require_known_shapes(*in);
    for (size_t k = 0; k < p.params.size(); ++k)
      if (to_dims((*in)[D + k]) != p.params[k])
        throw OpError("parameter " + std::to_string(k) + " (input " + std::to_string(D + k) + ") is " +
                      shape_str((*in)[D + k]) + " but the program's params say " + dims_str(p.params[k]));
    const std::vector<Dims> values = infer_values(p, data);
    for (size_t k = 0; k < p.outputs.size(); ++k) {
      const Dims& d = values[p.outputs[k]];
      (*out)[k] = Shape(d.begin(), d.end());
    }
  });
}

class RegionOp : public mxnet::ext::CustomStatefulOp {
 public:
  explicit RegionOp(const Attrs& a) : program_(parse(a)), bf16_(is_bf16(a)) {}

  MXReturnValue Forward(std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) override {
    return guarded(kOp, [&] {
      const Program& p = program_;
      const int D = p.num_data;
      if (in->size() != static_cast<size_t>(D) + p.params.size() || out->size() != p.outputs.size())
        throw OpError("called with " + std::to_string(in->size()) + " inputs and " + std::to_string(out->size()) +
                      " outputs; the program takes " + std::to_string(D + p.params.size()) + " and " +
                      std::to_string(p.outputs.size()));
      for (size_t i = 0; i < in->size(); ++i)
        require_f32((*in)[i], ("input " + std::to_string(i)).c_str());
      for (auto& t : *out) require_f32(t, "every output");
      for (size_t k = 0; k < p.params.size(); ++k)
        if ((*in)[D + k].shape != p.params[k])
          throw OpError("parameter " + std::to_string(k) + " is " + dims_str((*in)[D + k].shape) +
                        " but the program's params say " + dims_str(p.params[k]));
      const Config cfg = config_for(bf16_);
      std::vector<int64_t> key = {cfg.nhwc ? 1 : 0};
      std::vector<Dims> data;
      for (int i = 0; i < D; ++i) {
        data.push_back((*in)[i].shape);
        key.push_back(static_cast<int64_t>(data.back().size()));
        key.insert(key.end(), data.back().begin(), data.back().end());
      }
      const std::vector<Dims> values = infer_values(p, data);
      for (size_t k = 0; k < p.outputs.size(); ++k)
        if ((*out)[k].shape != values[p.outputs[k]])
          throw OpError("output " + std::to_string(k) + " is " + dims_str((*out)[k].shape) + ", the program makes " +
                        dims_str(values[p.outputs[k]]));
      Region::Inputs ri{&program_, &values, cfg};
      Region* r = regions_.get_or_throw(key, ri, 0);
      if (!r)
        throw OpError("more than " + std::to_string(BlockCache<Region>::kMax) +
                      " input shapes on one node: bind a node per shape");
      r->run(*in, *out);
    });
  }

  // Fused for inference only (the rule refuses training): the refusal every such op gives.
  MXReturnValue Backward(std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource& res) override {
    return inference_only_backward(Attrs(), in, out, res);
  }

 private:
  Program program_;
  bool bf16_;
  BlockCache<Region, std::vector<int64_t>> regions_;
};

MXReturnValue create_state(const Attrs& a, const mxnet::ext::MXContext&, const std::vector<Shape>&,
                           const std::vector<int>, mxnet::ext::CustomStatefulOp** op) {
  return guarded(kOp, [&] {
    if (!dnnl().engine) throw OpError("needs oneDNN 3.x: " + dnnl().error);
    *op = mxnet::ext::CustomStatefulOp::create<RegionOp>(a);
  });
}

}  // namespace

REGISTER_OP(fused_region)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setCreateOpState(create_state, "cpu");

// "" where fused_region can run here (oneDNN 3.x's API is bound and its CPU engine exists), else
// why not: the rule asks before it emits the op (fusion.native.library.region_status()).
extern "C" const char* mxf_region_status() {
  const DnnlApi& a = dnnl();
  return a.engine ? "" : (a.error.empty() ? "oneDNN's CPU engine is unavailable" : a.error.c_str());
}

// The most recently built region's primitives, one a line ("op 3 (conv): brgconv:avx512_core
// aBcd16b:f32 -> aBcd16b:f32"), with its layout and arena size: tests assert that no reference
// code runs on the hot path; MXFUSION_REGION_VERBOSE=1 prints each plan as it is built.
extern "C" const char* mxf_region_last_plan() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lk(g_plan_mu);
  copy = g_last_plan;
  return copy.c_str();
}

// "packs=N temporaries=M": how many times regions (re)packed weights, and how many parameters
// arrived as MXNet's version-0 temporary copies (compared by content), since the library loaded.
extern "C" const char* mxf_region_counters() {
  static thread_local std::string text;
  text = "packs=" + std::to_string(g_packs.load()) + " temporaries=" + std::to_string(g_temporaries.load());
  return text.c_str();
}
