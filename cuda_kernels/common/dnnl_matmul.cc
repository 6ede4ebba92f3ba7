// oneDNN matmul with prepacked weights (see dnnl_matmul.h), through the oneDNN function
// table of dnnl_api.h.
#include "dnnl_matmul.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "dnnl_api.h"
#include "mxf_common.h"
#include "vmath_avx512.h"

namespace mxf {

namespace {
// The table of oneDNN functions, unless MXFUSION_NO_DNNL_MATMUL turns this path off.
const DnnlApi* api_or_null(std::string* why) {
  static const bool off = [] {
    const char* e = std::getenv("MXFUSION_NO_DNNL_MATMUL");  // debugging aid; the tests cover sgemm
    return e && *e && std::string(e) != "0";
  }();
  if (off) {
    if (why) *why = "oneDNN matmul disabled by MXFUSION_NO_DNNL_MATMUL";
    return nullptr;
  }
  const DnnlApi& a = dnnl();
  if (!a.engine) {
    if (why) *why = a.error;
    return nullptr;
  }
  return &a;
}

// Owns a oneDNN memory descriptor.
struct Md {
  dnnl_memory_desc_t p = nullptr;
  ~Md() {
    if (p) dnnl().dnnl_memory_desc_destroy(p);
  }
  // a 2-D (d0, d1) matrix with strides (s0, s1)
  bool strided(int64_t d0, int64_t d1, int64_t s0, int64_t s1, dnnl_data_type_t dt = dnnl_f32) {
    const dnnl_dims_t d = {d0, d1}, s = {s0, s1};
    return dnnl().dnnl_memory_desc_create_with_strides(&p, 2, d, dt, s) == dnnl_success;
  }
};

// Owns a oneDNN memory (a descriptor bound to a buffer).
struct Mem {
  dnnl_memory_t p = nullptr;
  ~Mem() {
    if (p) dnnl().dnnl_memory_destroy(p);
  }
  bool create(const_dnnl_memory_desc_t md, void* handle) {
    const DnnlApi& a = dnnl();
    return a.dnnl_memory_create(&p, md, a.engine, handle) == dnnl_success;
  }
};

// Owns a primitive descriptor and its primitive.
struct Prim {
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_primitive_t prim = nullptr;
  ~Prim() {
    if (prim) dnnl().dnnl_primitive_destroy(prim);
    if (pd) dnnl().dnnl_primitive_desc_destroy(pd);
  }
  bool make() { return dnnl().dnnl_primitive_create(&prim, pd) == dnnl_success; }
  // runs it on the calling thread's stream and waits
  bool run(int nargs, const dnnl_exec_arg_t* args) const {
    const DnnlApi& a = dnnl();
    dnnl_stream_t stream = dnnl_thread_stream();
    return stream && a.dnnl_primitive_execute(prim, stream, nargs, args) == dnnl_success &&
           a.dnnl_stream_wait(stream) == dnnl_success;
  }
};

// The matmul primitive Y (M, N) = X (M, K) * W (K, N) [+ bias (1, N)] for row-major X
// and Y and the weight layout `wmd` (oneDNN caches primitives: a repeat is cheap).
struct MatmulPrim {
  Md src, bias, dst;
  Prim p;
  bool create(int64_t M, int64_t N, int64_t K, const_dnnl_memory_desc_t wmd, bool has_bias,
              dnnl_data_type_t src_dt = dnnl_f32, dnnl_data_type_t dst_dt = dnnl_f32,
              MatmulEltwise post = {}) {
    const DnnlApi& a = dnnl();
    // the post-op, when there is one: an attribute the primitive descriptor copies
    dnnl_primitive_attr_t attr = nullptr;
    dnnl_post_ops_t ops = nullptr;
    bool ok = post.alg == dnnl_alg_kind_undef ||
              (a.dnnl_primitive_attr_create(&attr) == dnnl_success &&
               a.dnnl_post_ops_create(&ops) == dnnl_success &&
               a.dnnl_post_ops_append_eltwise(ops, post.alg, post.alpha, post.beta) == dnnl_success &&
               a.dnnl_primitive_attr_set_post_ops(attr, ops) == dnnl_success);
    ok = ok && src.strided(M, K, K, 1, src_dt) && dst.strided(M, N, N, 1, dst_dt) &&
         (!has_bias || bias.strided(1, N, N, 1)) &&
         a.dnnl_matmul_primitive_desc_create(&p.pd, a.engine, src.p, wmd,
                                             has_bias ? bias.p : nullptr, dst.p,
                                             attr) == dnnl_success &&
         p.make();
    if (ops) a.dnnl_post_ops_destroy(ops);
    if (attr) a.dnnl_primitive_attr_destroy(attr);
    return ok;
  }
};
}  // namespace

struct PackedMatmul::Packed {
  Md md;    // the blocked weight layout
  Mem mem;  // oneDNN-allocated, holding W in that layout
};

struct PackedMatmul::Shape {
  MatmulPrim mm;
  Packed* w = nullptr;
  bool in_place = false;  // W read as it is (wmem's handle set per call), not packed
  Mem src, bias, dst, wmem;  // handles set per call
};

namespace {
// Whether oneDNN chose a plain (unblocked) layout for a matmul's "any" weights: a GEMM-based
// implementation, which gains nothing from a reorder.
bool plain_layout(const_dnnl_memory_desc_t md) {
  const DnnlApi& a = dnnl();
  dnnl_format_kind_t fk = dnnl_format_kind_undef;
  int nblks = -1;
  return a.dnnl_memory_desc_query(md, dnnl_query_format_kind, &fk) == dnnl_success &&
         fk == dnnl_blocked &&
         a.dnnl_memory_desc_query(md, dnnl_query_inner_nblks_s32, &nblks) == dnnl_success && nblks == 0;
}
}  // namespace

PackedMatmul::PackedMatmul(int64_t N, int64_t K, bool bias, bool bf16, bool dst_bf16,
                           MatmulEltwise post)
    : N_(N), K_(K), bias_(bias), bf16_(bf16), dst_bf16_(bf16 && dst_bf16), post_(post) {}

std::unique_ptr<PackedMatmul> PackedMatmul::create(int64_t N, int64_t K, bool bias,
                                                   std::string* why, bool bf16, bool dst_bf16,
                                                   MatmulEltwise post) {
  if (!api_or_null(why)) return nullptr;
  return std::unique_ptr<PackedMatmul>(new PackedMatmul(N, K, bias, bf16, dst_bf16, post));
}

PackedMatmul::~PackedMatmul() = default;

PackedMatmul::Packed* PackedMatmul::packed_for(const void* wmd_, const void* W) {
  const DnnlApi& a = dnnl();
  const auto wmd = static_cast<const_dnnl_memory_desc_t>(wmd_);
  for (auto& p : packed_)
    if (a.dnnl_memory_desc_equal(p->md.p, wmd)) return p.get();
  auto p = std::make_unique<Packed>();
  Md user;  // W (N, K) row-major is the (K, N) weight matrix with strides (1, K)
  Mem umem;
  Prim reorder;
  bool ok = a.dnnl_memory_desc_clone(&p->md.p, wmd) == dnnl_success &&
            user.strided(K_, N_, 1, K_, bf16_ ? dnnl_bf16 : dnnl_f32) &&
            p->mem.create(p->md.p, DNNL_MEMORY_ALLOCATE) &&
            umem.create(user.p, const_cast<void*>(W)) &&
            a.dnnl_reorder_primitive_desc_create(&reorder.pd, user.p, a.engine, p->md.p, a.engine,
                                                 nullptr) == dnnl_success &&
            reorder.make();
  if (ok) {
    const dnnl_exec_arg_t args[2] = {{DNNL_ARG_SRC, umem.p}, {DNNL_ARG_DST, p->mem.p}};
    ok = reorder.run(2, args);
  }
  if (!ok) return nullptr;
  packed_.push_back(std::move(p));
  return packed_.back().get();
}

namespace {
bool unpacked(const void* X, int64_t M, const void* W, int64_t N, int64_t K, const float* bias,
              void* Y, dnnl_data_type_t dt, dnnl_data_type_t dst_dt = dnnl_f32,
              MatmulEltwise post = {}) {
  if (!api_or_null(nullptr)) return false;
  Md wmd;  // W (N, K) row-major read in place as the (K, N) weights
  MatmulPrim mm;
  Mem ms, mw, mb, md;
  bool ok = wmd.strided(K, N, 1, K, dt) && mm.create(M, N, K, wmd.p, bias != nullptr, dt, dst_dt, post) &&
            ms.create(mm.src.p, const_cast<void*>(X)) && mw.create(wmd.p, const_cast<void*>(W)) &&
            md.create(mm.dst.p, Y) && (!bias || mb.create(mm.bias.p, const_cast<float*>(bias)));
  if (!ok) return false;
  const dnnl_exec_arg_t args[4] = {
      {DNNL_ARG_SRC, ms.p}, {DNNL_ARG_WEIGHTS, mw.p}, {DNNL_ARG_DST, md.p}, {DNNL_ARG_BIAS, mb.p}};
  return mm.p.run(bias ? 4 : 3, args);
}
}  // namespace

bool matmul_unpacked(const float* X, int64_t M, const float* W, int64_t N, int64_t K,
                     const float* bias, float* Y) {
  return unpacked(X, M, W, N, K, bias, Y, dnnl_f32);
}

bool matmul_unpacked_bf16(const uint16_t* X, int64_t M, const uint16_t* W, int64_t N, int64_t K,
                          const float* bias, void* Y, bool dst_bf16, MatmulEltwise post) {
  return unpacked(X, M, W, N, K, bias, Y, dnnl_bf16, dst_bf16 ? dnnl_bf16 : dnnl_f32, post);
}

void to_bf16(const float* x, uint16_t* y, int64_t n) {
  if (n >= 16 && cpu_has_avx512()) return to_bf16_avx512(x, y, n);
  for (int64_t i = 0; i < n; ++i) {  // vectorizes: integer ops and a select
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    y[i] = static_cast<uint16_t>(nan ? ((u >> 16) | 0x40u) : rounded);
  }
}

void from_bf16(const uint16_t* x, float* y, int64_t n) {
  if (n >= 16 && cpu_has_avx512()) return from_bf16_avx512(x, y, n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(y + i, &u, 4);
  }
}

}  // namespace mxf

// The library's rounding to bfloat16 and widening back, for the tests (the AVX-512 loops, or the
// portable ones under MXFUSION_DISABLE_AVX512=1): the bits every bf16 kernel writes and reads.
extern "C" void mxf_to_bf16(const float* x, uint16_t* y, int64_t n) { mxf::to_bf16(x, y, n); }
extern "C" void mxf_from_bf16(const uint16_t* x, float* y, int64_t n) { mxf::from_bf16(x, y, n); }

namespace mxf {

bool PackedMatmul::run(const void* X, int64_t M, const void* W, const float* bias, void* Y) {
  const DnnlApi& a = dnnl();
  std::lock_guard<std::mutex> lk(mu_);
  auto it = shapes_.find(M);
  if (it != shapes_.end() && !it->second) return false;  // this M failed before
  if (it == shapes_.end()) {
    if (shapes_.size() >= kMaxShapes) return false;
    auto s = std::make_unique<Shape>();
    Md wany;  // "any": oneDNN picks the blocked layout, packed_for() reorders W into it
    const dnnl_dims_t wd = {K_, N_};
    const dnnl_data_type_t dt = bf16_ ? dnnl_bf16 : dnnl_f32;
    bool ok = a.dnnl_memory_desc_create_with_tag(&wany.p, 2, wd, dt, dnnl_format_tag_any) ==
                  dnnl_success &&
              s->mm.create(M, N_, K_, wany.p, bias_, dt, dst_bf16_ ? dnnl_bf16 : dnnl_f32, post_);
    const_dnnl_memory_desc_t wmd =
        ok ? a.dnnl_primitive_desc_query_md(s->mm.p.pd, dnnl_query_weights_md, 0) : nullptr;
    Md plain;
    if (wmd && plain_layout(wmd)) {
      // a GEMM-based implementation (no blocked layout: AVX2 CPUs) took "any" as the plain
      // (K, N) matrix, whose rows N floats apart alias in the cache when N·4 bytes is a multiple
      // of 4 KiB (BERT's 768 -> 3072: 9.2 ms against 6.0 with W read as it is); W's own layout
      // instead, read in place: no copy
      auto s2 = std::make_unique<Shape>();
      ok = plain.strided(K_, N_, 1, K_, dt) &&
           s2->mm.create(M, N_, K_, plain.p, bias_, dt, dst_bf16_ ? dnnl_bf16 : dnnl_f32, post_) &&
           s2->src.create(s2->mm.src.p, nullptr) && s2->dst.create(s2->mm.dst.p, nullptr) &&
           (!bias_ || s2->bias.create(s2->mm.bias.p, nullptr)) &&
           s2->wmem.create(plain.p, nullptr);
      if (ok) {
        s2->in_place = true;
        s = std::move(s2);
      }
    } else if (ok) {
      s->w = wmd ? packed_for(wmd, W) : nullptr;
      ok = s->w && s->src.create(s->mm.src.p, nullptr) && s->dst.create(s->mm.dst.p, nullptr) &&
           (!bias_ || s->bias.create(s->mm.bias.p, nullptr));
    }
    if (!ok) {
      shapes_.emplace(M, nullptr);  // remember: sgemm serves this M from now on
      return false;
    }
    it = shapes_.emplace(M, std::move(s)).first;
  }
  Shape& s = *it->second;
  if (s.in_place && a.dnnl_memory_set_data_handle(s.wmem.p, const_cast<void*>(W)) != dnnl_success)
    return false;
  if (a.dnnl_memory_set_data_handle(s.src.p, const_cast<void*>(X)) != dnnl_success ||
      a.dnnl_memory_set_data_handle(s.dst.p, Y) != dnnl_success ||
      (bias_ && a.dnnl_memory_set_data_handle(s.bias.p, const_cast<float*>(bias)) != dnnl_success))
    return false;
  const dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, s.src.p},
                                   {DNNL_ARG_WEIGHTS, s.in_place ? s.wmem.p : s.w->mem.p},
                                   {DNNL_ARG_DST, s.dst.p},
                                   {DNNL_ARG_BIAS, s.bias.p}};
  return s.mm.p.run(bias_ ? 4 : 3, args);
}

}  // namespace mxf
