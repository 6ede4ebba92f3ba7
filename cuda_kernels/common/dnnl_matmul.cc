// oneDNN matmul with prepacked weights (see dnnl_matmul.h).  The handful of C API entry
// points used are declared here from oneDNN 3.x's dnnl.h / dnnl_types.h (opaque handles
// as void*; the enum values below are those of the 3.x headers).
#include "dnnl_matmul.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "mxf_common.h"

namespace mxf {

namespace {
using status = int;  // dnnl_status_t: 0 = dnnl_success
using dims12 = int64_t[12];  // dnnl_dims_t
constexpr int kF32 = 3;            // dnnl_f32
constexpr int kBF16 = 2;           // dnnl_bf16
constexpr int kTagAny = 1;         // dnnl_format_tag_any
constexpr int kCpu = 1;            // dnnl_cpu
constexpr int kInOrder = 1;        // dnnl_stream_default_flags
constexpr int kQueryWeightsMd = 131;  // dnnl_query_weights_md
constexpr int kArgSrc = 1, kArgDst = 17, kArgWeights = 33, kArgBias = 41;
void* const kAllocate = reinterpret_cast<void*>(~uintptr_t{0});  // DNNL_MEMORY_ALLOCATE

struct ExecArg {  // dnnl_exec_arg_t
  int arg;
  void* memory;
};

struct Api {
  status (*engine_create)(void**, int, size_t);
  status (*stream_create)(void**, void*, unsigned);
  status (*stream_wait)(void*);
  status (*stream_destroy)(void*);
  status (*md_with_strides)(void**, int, const int64_t*, int, const int64_t*);
  status (*md_with_tag)(void**, int, const int64_t*, int, int);
  status (*md_destroy)(void*);
  status (*md_clone)(void**, const void*);
  int (*md_equal)(const void*, const void*);
  status (*matmul_pd_create)(void**, void*, const void*, const void*, const void*, const void*,
                             const void*);
  const void* (*pd_query_md)(const void*, int, int);
  status (*pd_destroy)(void*);
  status (*prim_create)(void**, const void*);
  status (*prim_destroy)(void*);
  status (*prim_execute)(const void*, void*, int, const ExecArg*);
  status (*reorder_pd_create)(void**, const void*, void*, const void*, void*, const void*);
  status (*mem_create)(void**, const void*, void*, void*);
  status (*mem_set_handle)(void*, void*);
  status (*mem_destroy)(void*);
  void* engine = nullptr;
  std::string error;
};

template <class F>
bool bind_symbol(F& f, const char* name, std::string& err) {
  f = reinterpret_cast<F>(dnnl_symbol(name));
  if (!f) err += std::string(err.empty() ? "" : ", ") + name;
  return f != nullptr;
}

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* off = std::getenv("MXFUSION_NO_DNNL_MATMUL")) {
      if (*off && std::string(off) != "0") {  // debugging aid; the tests cover the sgemm path
        a.error = "oneDNN matmul disabled by MXFUSION_NO_DNNL_MATMUL";
        return;
      }
    }
    std::string miss;
    bind_symbol(a.engine_create, "dnnl_engine_create", miss);
    bind_symbol(a.stream_create, "dnnl_stream_create", miss);
    bind_symbol(a.stream_wait, "dnnl_stream_wait", miss);
    bind_symbol(a.stream_destroy, "dnnl_stream_destroy", miss);
    bind_symbol(a.md_with_strides, "dnnl_memory_desc_create_with_strides", miss);
    bind_symbol(a.md_with_tag, "dnnl_memory_desc_create_with_tag", miss);
    bind_symbol(a.md_destroy, "dnnl_memory_desc_destroy", miss);
    bind_symbol(a.md_clone, "dnnl_memory_desc_clone", miss);
    bind_symbol(a.md_equal, "dnnl_memory_desc_equal", miss);
    bind_symbol(a.matmul_pd_create, "dnnl_matmul_primitive_desc_create", miss);
    bind_symbol(a.pd_query_md, "dnnl_primitive_desc_query_md", miss);
    bind_symbol(a.pd_destroy, "dnnl_primitive_desc_destroy", miss);
    bind_symbol(a.prim_create, "dnnl_primitive_create", miss);
    bind_symbol(a.prim_destroy, "dnnl_primitive_destroy", miss);
    bind_symbol(a.prim_execute, "dnnl_primitive_execute", miss);
    bind_symbol(a.reorder_pd_create, "dnnl_reorder_primitive_desc_create", miss);
    bind_symbol(a.mem_create, "dnnl_memory_create", miss);
    bind_symbol(a.mem_set_handle, "dnnl_memory_set_data_handle", miss);
    bind_symbol(a.mem_destroy, "dnnl_memory_destroy", miss);
    if (!miss.empty()) {
      a.error = "oneDNN matmul API not found (" + miss + ")";
      return;
    }
    if (a.engine_create(&a.engine, kCpu, 0) != 0) {
      a.engine = nullptr;
      a.error = "oneDNN CPU engine could not be created";
    }
  });
  return a;
}

// Owns a oneDNN memory descriptor.
struct Md {
  void* p = nullptr;
  ~Md() { if (p) api().md_destroy(p); }
  bool strided(int64_t d0, int64_t d1, int64_t s0, int64_t s1, int dt = kF32) {
    const dims12 d = {d0, d1}, s = {s0, s1};
    return api().md_with_strides(&p, 2, d, dt, s) == 0;
  }
};

// The calling thread's oneDNN stream (MXNet may run ops from several engine threads);
// null when none can be created.
void* thread_stream() {
  struct Stream {
    void* s = nullptr;
    ~Stream() { if (s) api().stream_destroy(s); }
  };
  thread_local Stream st;
  const Api& a = api();
  if (!st.s && a.engine && a.stream_create(&st.s, a.engine, kInOrder) != 0) st.s = nullptr;
  return st.s;
}

// The matmul primitive Y (M, N) = X (M, K) * W (K, N) [+ bias (1, N)] for row-major X
// and Y and the weight layout `wmd` (oneDNN caches primitives: a repeat is cheap).
struct MatmulPrim {
  Md src, bias, dst;
  void* pd = nullptr;
  void* prim = nullptr;
  ~MatmulPrim() {
    if (prim) api().prim_destroy(prim);
    if (pd) api().pd_destroy(pd);
  }
  bool create(int64_t M, int64_t N, int64_t K, const void* wmd, bool has_bias, int src_dt = kF32,
              int dst_dt = kF32) {
    const Api& a = api();
    return src.strided(M, K, K, 1, src_dt) && dst.strided(M, N, N, 1, dst_dt) &&
           (!has_bias || bias.strided(1, N, N, 1)) &&
           a.matmul_pd_create(&pd, a.engine, src.p, wmd, has_bias ? bias.p : nullptr, dst.p,
                              nullptr) == 0 &&
           a.prim_create(&prim, pd) == 0;
  }
};
}  // namespace

struct PackedMatmul::Packed {
  Md md;                 // the blocked weight layout
  void* mem = nullptr;   // oneDNN-allocated, holding W in that layout
  ~Packed() { if (mem) api().mem_destroy(mem); }
};

struct PackedMatmul::Shape {
  MatmulPrim mm;
  Packed* w = nullptr;
  void *src = nullptr, *bias = nullptr, *dst = nullptr;  // memories; handles set per call
  ~Shape() {
    for (void* m : {src, bias, dst})
      if (m) api().mem_destroy(m);
  }
};

PackedMatmul::PackedMatmul(int64_t N, int64_t K, bool bias, bool bf16, bool dst_bf16)
    : N_(N), K_(K), bias_(bias), bf16_(bf16), dst_bf16_(bf16 && dst_bf16) {}

std::unique_ptr<PackedMatmul> PackedMatmul::create(int64_t N, int64_t K, bool bias,
                                                   std::string* why, bool bf16, bool dst_bf16) {
  const Api& a = api();
  if (!a.engine) {
    if (why) *why = a.error;
    return nullptr;
  }
  return std::unique_ptr<PackedMatmul>(new PackedMatmul(N, K, bias, bf16, dst_bf16));
}

PackedMatmul::~PackedMatmul() = default;

PackedMatmul::Packed* PackedMatmul::packed_for(const void* wmd, const void* W) {
  const Api& a = api();
  for (auto& p : packed_)
    if (a.md_equal(p->md.p, wmd)) return p.get();
  void* stream = thread_stream();
  if (!stream) return nullptr;
  auto p = std::make_unique<Packed>();
  Md user;  // W (N, K) row-major is the (K, N) weight matrix with strides (1, K)
  void* rpd = nullptr;
  void* rprim = nullptr;
  void* umem = nullptr;
  bool ok = a.md_clone(&p->md.p, wmd) == 0 && user.strided(K_, N_, 1, K_, bf16_ ? kBF16 : kF32) &&
            a.mem_create(&p->mem, p->md.p, a.engine, kAllocate) == 0 &&
            a.mem_create(&umem, user.p, a.engine, const_cast<void*>(W)) == 0 &&
            a.reorder_pd_create(&rpd, user.p, a.engine, p->md.p, a.engine, nullptr) == 0 &&
            a.prim_create(&rprim, rpd) == 0;
  if (ok) {
    const ExecArg args[2] = {{kArgSrc, umem}, {kArgDst, p->mem}};
    ok = a.prim_execute(rprim, stream, 2, args) == 0 && a.stream_wait(stream) == 0;
  }
  if (rprim) a.prim_destroy(rprim);
  if (rpd) a.pd_destroy(rpd);
  if (umem) a.mem_destroy(umem);
  if (!ok) return nullptr;
  packed_.push_back(std::move(p));
  return packed_.back().get();
}

namespace {
bool unpacked(const void* X, int64_t M, const void* W, int64_t N, int64_t K, const float* bias,
              void* Y, int dt, int dst_dt = kF32) {
  const Api& a = api();
  void* stream = thread_stream();
  if (!stream) return false;
  Md wmd;  // W (N, K) row-major read in place as the (K, N) weights
  MatmulPrim mm;
  void *ms = nullptr, *mw = nullptr, *mb = nullptr, *md = nullptr;
  bool ok = wmd.strided(K, N, 1, K, dt) && mm.create(M, N, K, wmd.p, bias != nullptr, dt, dst_dt) &&
            a.mem_create(&ms, mm.src.p, a.engine, const_cast<void*>(X)) == 0 &&
            a.mem_create(&mw, wmd.p, a.engine, const_cast<void*>(W)) == 0 &&
            a.mem_create(&md, mm.dst.p, a.engine, Y) == 0 &&
            (!bias || a.mem_create(&mb, mm.bias.p, a.engine, const_cast<float*>(bias)) == 0);
  if (ok) {
    const ExecArg args[4] = {{kArgSrc, ms}, {kArgWeights, mw}, {kArgDst, md}, {kArgBias, mb}};
    ok = a.prim_execute(mm.prim, stream, bias ? 4 : 3, args) == 0 && a.stream_wait(stream) == 0;
  }
  for (void* m : {ms, mw, mb, md})
    if (m) a.mem_destroy(m);
  return ok;
}
}  // namespace

bool matmul_unpacked(const float* X, int64_t M, const float* W, int64_t N, int64_t K,
                     const float* bias, float* Y) {
  return unpacked(X, M, W, N, K, bias, Y, kF32);
}

bool matmul_unpacked_bf16(const uint16_t* X, int64_t M, const uint16_t* W, int64_t N, int64_t K,
                          const float* bias, void* Y, bool dst_bf16) {
  return unpacked(X, M, W, N, K, bias, Y, kBF16, dst_bf16 ? kBF16 : kF32);
}

void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {  // vectorizes: integer ops and a select
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    y[i] = static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
  }
}

void from_bf16(const uint16_t* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(y + i, &u, 4);
  }
}

bool PackedMatmul::run(const void* X, int64_t M, const void* W, const float* bias, void* Y) {
  const Api& a = api();
  void* stream = thread_stream();
  if (!stream) return false;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = shapes_.find(M);
  if (it != shapes_.end() && !it->second) return false;  // this M failed before
  if (it == shapes_.end()) {
    if (shapes_.size() >= kMaxShapes) return false;
    auto s = std::make_unique<Shape>();
    Md wany;  // "any": oneDNN picks the blocked layout, packed_for() reorders W into it
    const dims12 wd = {K_, N_};
    const int dt = bf16_ ? kBF16 : kF32;
    bool ok = a.md_with_tag(&wany.p, 2, wd, dt, kTagAny) == 0 &&
              s->mm.create(M, N_, K_, wany.p, bias_, dt, dst_bf16_ ? kBF16 : kF32);
    if (ok) {
      const void* wmd = a.pd_query_md(s->mm.pd, kQueryWeightsMd, 0);
      s->w = wmd ? packed_for(wmd, W) : nullptr;
      ok = s->w && a.mem_create(&s->src, s->mm.src.p, a.engine, nullptr) == 0 &&
           a.mem_create(&s->dst, s->mm.dst.p, a.engine, nullptr) == 0 &&
           (!bias_ || a.mem_create(&s->bias, s->mm.bias.p, a.engine, nullptr) == 0);
    }
    if (!ok) {
      shapes_.emplace(M, nullptr);  // remember: sgemm serves this M from now on
      return false;
    }
    it = shapes_.emplace(M, std::move(s)).first;
  }
  Shape& s = *it->second;
  if (a.mem_set_handle(s.src, const_cast<void*>(X)) != 0 || a.mem_set_handle(s.dst, Y) != 0 ||
      (bias_ && a.mem_set_handle(s.bias, const_cast<float*>(bias)) != 0))
    return false;
  ExecArg args[4] = {{kArgSrc, s.src}, {kArgWeights, s.w->mem}, {kArgDst, s.dst}, {kArgBias, s.bias}};
  return a.prim_execute(s.mm.prim, stream, bias_ ? 4 : 3, args) == 0 && a.stream_wait(stream) == 0;
}

}  // namespace mxf
