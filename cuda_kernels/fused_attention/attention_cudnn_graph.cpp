// fused_attention's cuDNN path, the frontend's part: loading libcudnn (and the CUDA runtime the
// frontend calls) at the first call, building and caching cuDNN SDPA graphs (forward with stats;
// backward, with dBias for an additive mask), running them, and the kernels of attention_cudnn.cu
// around them.  Host C++ only (the frontend's headers are heavy: the host compiler alone sees
// them).  See attention_cudnn.cu for what is given to cuDNN and why.  Compiled, not yet run on a GPU.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "attention_backends.h"
#include "mxf_cuda_types.h"
#include "cuda_try.h"


#if defined(MXF_WITH_CUDNN) && !defined(NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING)
#error "the cuDNN path is built in the frontend's dynamic-loading mode only (cuda_iface.cudnn_flags())"
#endif

#if !defined(MXF_WITH_CUDNN)
// Built without the frontend's or cuDNN's headers (pip install nvidia-cudnn-frontend
// nvidia-cudnn-cu13 where nvcc is, see cuda_iface.cudnn_flags()): cuDNN is never chosen.
namespace mxf_attn {
bool cudnn_available(std::string* why) {
  if (why) *why = "this build has no cuDNN frontend (its headers were not found when it was compiled)";
  return false;
}
size_t cudnn_forward_ws(const mxf_attention_args*, std::string* why) {
  cudnn_available(why);
  return static_cast<size_t>(-1);
}
int cudnn_forward(const mxf_attention_args*, void*, size_t, cudaStream_t) { return MXF_ERR_UNSUPPORTED; }
size_t cudnn_backward_ws(const mxf_attention_args*, const mxf_attention_grads*, std::string* why) {
  cudnn_available(why);
  return static_cast<size_t>(-1);
}
int cudnn_backward(const mxf_attention_args*, const mxf_attention_grads*, void*, size_t, cudaStream_t) {
  return MXF_ERR_UNSUPPORTED;
}
size_t cudnn_version() { return 0; }
}  // namespace mxf_attn
#else
#include <cudnn_frontend.h>

namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;  // the frontend's dynamic-loading mode resolves every cuDNN call here
}

namespace mxf_attn {
namespace {

namespace fe = cudnn_frontend;

#ifndef MXF_CUDNN_LIB_DIR
#define MXF_CUDNN_LIB_DIR ""
#endif
#ifndef MXF_CUDART_LIB_DIR
#define MXF_CUDART_LIB_DIR ""
#endif

struct Loaded {
  bool ok = false;
  std::string why;  // when not ok
  size_t version = 0;
};

void* open_first(const std::vector<std::string>& names, std::string* tried) {
  for (const std::string& n : names) {
    if (n.empty()) continue;
    void* h = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) return h;
    const char* e = dlerror();
    *tried += (tried->empty() ? "" : "; ") + n + ": " + (e ? e : "not found");
  }
  return nullptr;
}

std::string in_dir(const char* dir, const char* name) {
  return dir && *dir ? std::string(dir) + "/" + name : std::string();
}

// libcudnn.so.9, and the CUDA runtime the frontend calls through dlopen (libcudart.so.13, the
// major this library is built for; the frontend would otherwise take a libcudart.so.12 first).
const Loaded& load() {
  static Loaded L;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string tried;
    void* h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_NOLOAD);  // already in the process (PyTorch)
    if (!h) {
      const char* env = std::getenv("MXFUSION_CUDNN_LIB");  // when set, the only place looked at
      h = env && *env ? open_first({env}, &tried)
                      : open_first({in_dir(MXF_CUDNN_LIB_DIR, "libcudnn.so.9"), "libcudnn.so.9"}, &tried);
    }
    if (!h) {
      L.why = "libcudnn.so.9 could not be loaded (" + tried + "); pip install nvidia-cudnn-cu13, or set "
              "MXFUSION_CUDNN_LIB";
      return;
    }
    if (!std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME")) {
      const std::string major = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
      std::string t2;
      void* rt = dlopen(major.c_str(), RTLD_NOW | RTLD_NOLOAD);
      std::string name = major;
      if (!rt) {
        const std::string beside = in_dir(MXF_CUDART_LIB_DIR, major.c_str());
        rt = open_first({beside, major}, &t2);
        if (rt && !beside.empty() && dlopen(beside.c_str(), RTLD_NOW | RTLD_NOLOAD)) name = beside;
      }
      if (!rt) {
        L.why = "the CUDA runtime " + major + " (which the cuDNN frontend calls) could not be loaded (" + t2 + ")";
        return;
      }
      setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", name.c_str(), 0);
    }
    cudnn_frontend::cudnn_dlhandle = h;
    try {
      L.version = static_cast<size_t>(fe::detail::get_backend_version());
    } catch (const std::exception& e) {
      L.why = std::string("cuDNN loaded but not usable: ") + e.what();
      return;
    }
    if (L.version < 90000) {
      L.why = "cuDNN " + std::to_string(L.version) + " is older than 9.0";
      return;
    }
    L.ok = true;
  });
  return L;
}

bool device_ok(std::string* why) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  int major = 0, minor = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = std::string("no usable CUDA device (") + cudaGetErrorString(e) + ")";
    return false;
  }
  if (major < 8) {
    if (why) *why = "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
                    " (cuDNN's fused attention needs sm_80 or newer)";
    return false;
  }
  return true;
}

cudnnHandle_t handle_for(int dev) {  // one handle per thread and device, kept for the thread
  thread_local std::unordered_map<int, cudnnHandle_t> handles;
  auto it = handles.find(dev);
  if (it != handles.end()) return it->second;
  cudnnHandle_t h = nullptr;
  if (fe::detail::create_handle(&h) != CUDNN_STATUS_SUCCESS) return nullptr;
  handles[dev] = h;
  return h;
}

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kBias, kDBias, kSeqQ, kSeqKV, kDO, kDQ, kDK, kDV };

// The strides cuDNN is given: those of the op, except for dims of extent 1, which get the packed
// stride (the op's may be 0 or anything there).
void dims_strides(int64_t B, int64_t H, int64_t S, int64_t D, int64_t bs, int64_t hs, int64_t rs,
                  std::vector<int64_t>* dim, std::vector<int64_t>* str) {
  const int64_t r = S == 1 ? D : rs;
  const int64_t h = H == 1 ? S * r : hs;
  const int64_t b = B == 1 ? H * h : bs;
  *dim = {B, H, S, D};
  *str = {b, h, r, 1};
}

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t ws = 0;
  std::string why;  // set when the graph could not be built: the call runs the own kernel
};

std::mutex g_mu;
std::unordered_map<std::string, std::shared_ptr<Plan>> g_plans;

bool has_bias(const mxf_attention_args* a) { return a->mask_kind == MXF_MASK_ADDITIVE; }
bool has_lengths(const mxf_attention_args* a) { return a->mask_kind == MXF_MASK_VALID_LENGTH; }
bool bottom_right(const mxf_attention_args* a) { return a->causal == MXF_CAUSAL_EXCLUDE && a->Sq != a->Sk; }
bool dbias_wanted(const mxf_attention_args* a, const mxf_attention_grads* g) {
  return has_bias(a) && g && g->dmask && g->req_dmask != MXF_REQ_NULL;
}
// the bias's dims (1 where the mask broadcasts) and strides
void bias_layout(const mxf_attention_args* a, std::vector<int64_t>* dim, std::vector<int64_t>* str) {
  const int64_t sq = a->m_sq ? a->Sq : 1, hh = a->m_sh ? a->H : 1, bb = a->m_sb ? a->B : 1;
  const int64_t rq = a->m_sq ? a->m_sq : a->Sk, rh = a->m_sh ? a->m_sh : sq * rq, rb = a->m_sb ? a->m_sb : hh * rh;
  *dim = {bb, hh, sq, a->Sk};
  *str = {rb, rh, rq, 1};
}

std::string key_of(const mxf_attention_args* a, const mxf_attention_grads* g, bool backward, int dev) {
  std::ostringstream k;
  float sc = a->scale;
  uint32_t sbits;
  std::memcpy(&sbits, &sc, 4);
  // per thread: a plan is built with, and run on, this thread's cuDNN handle
  k << (backward ? 'b' : 'f') << std::this_thread::get_id() << '/' << dev << ':' << a->dtype << ':' << a->B << ',' << a->H << ',' << a->Sq << ','
    << a->Sk << ',' << a->D << ',' << a->Dv << ':' << a->q_bs << ',' << a->q_hs << ',' << a->q_rs << ','
    << a->k_bs << ',' << a->k_hs << ',' << a->k_rs << ',' << a->v_bs << ',' << a->v_hs << ',' << a->v_rs << ','
    << a->o_bs << ',' << a->o_hs << ',' << a->o_rs << ':' << a->mask_kind << ':' << a->causal << ':' << sbits;
  if (has_bias(a)) k << ":m" << a->m_sb << ',' << a->m_sh << ',' << a->m_sq;
  if (backward) k << ":d" << (dbias_wanted(a, g) ? 1 : 0);
  return k.str();
}

fe::DataType_t fe_type(int dtype) { return dtype == MXF_F16 ? fe::DataType_t::HALF : fe::DataType_t::BFLOAT16; }

std::shared_ptr<fe::graph::Tensor_attributes> tensor(fe::graph::Graph& g, const char* name, int64_t uid,
                                                     const std::vector<int64_t>& dim,
                                                     const std::vector<int64_t>& str) {
  return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(dim).set_stride(str));
}

std::shared_ptr<Plan> build(const mxf_attention_args* a, const mxf_attention_grads* gr, bool backward,
                            cudnnHandle_t handle) {
  auto plan = std::make_shared<Plan>();
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe_type(a->dtype))
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  std::vector<int64_t> d, s;
  dims_strides(a->B, a->H, a->Sq, a->D, a->q_bs, a->q_hs, a->q_rs, &d, &s);
  auto Q = tensor(*g, "Q", kQ, d, s);
  dims_strides(a->B, a->H, a->Sk, a->D, a->k_bs, a->k_hs, a->k_rs, &d, &s);
  auto K = tensor(*g, "K", kK, d, s);
  dims_strides(a->B, a->H, a->Sk, a->Dv, a->v_bs, a->v_hs, a->v_rs, &d, &s);
  auto V = tensor(*g, "V", kV, d, s);
  std::vector<int64_t> od, os;
  dims_strides(a->B, a->H, a->Sq, a->Dv, a->o_bs, a->o_hs, a->o_rs, &od, &os);
  const std::vector<int64_t> stats_dim = {a->B, a->H, a->Sq, 1}, stats_str = {a->H * a->Sq, a->Sq, 1, 1};
  std::shared_ptr<fe::graph::Tensor_attributes> bias, seq_q, seq_kv;
  if (has_bias(a)) {
    bias_layout(a, &d, &s);
    bias = tensor(*g, "bias", kBias, d, s);
  }
  if (has_lengths(a)) {
    seq_q = g->tensor(fe::graph::Tensor_attributes().set_name("seq_q").set_uid(kSeqQ).set_dim({a->B, 1, 1, 1})
                          .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
    seq_kv = g->tensor(fe::graph::Tensor_attributes().set_name("seq_kv").set_uid(kSeqKV).set_dim({a->B, 1, 1, 1})
                           .set_stride({1, 1, 1, 1}).set_data_type(fe::DataType_t::INT32));
  }
  auto align = bottom_right(a) ? fe::DiagonalAlignment_t::BOTTOM_RIGHT : fe::DiagonalAlignment_t::TOP_LEFT;
  if (!backward) {
    auto opt = fe::graph::SDPA_attributes().set_name("mxf_sdpa").set_generate_stats(true).set_attn_scale(a->scale);
    if (a->causal == MXF_CAUSAL_EXCLUDE) opt.set_diagonal_alignment(align).set_diagonal_band_right_bound(0);
    if (bias) opt.set_bias(bias);
    if (seq_q) opt.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto outs = g->sdpa(Q, K, V, opt);
    outs[0]->set_output(true).set_uid(kO).set_dim(od).set_stride(os);
    outs[1]->set_output(true).set_uid(kStats).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dim)
        .set_stride(stats_str);
  } else {
    auto O = tensor(*g, "O", kO, od, os);
    auto dO = tensor(*g, "dO", kDO, od, os);
    auto Stats = g->tensor(fe::graph::Tensor_attributes().set_name("Stats").set_uid(kStats).set_dim(stats_dim)
                               .set_stride(stats_str).set_data_type(fe::DataType_t::FLOAT));
    auto opt = fe::graph::SDPA_backward_attributes().set_name("mxf_sdpa_bwd").set_attn_scale(a->scale);
    if (a->causal == MXF_CAUSAL_EXCLUDE) opt.set_diagonal_alignment(align).set_diagonal_band_right_bound(0);
    if (bias) {
      opt.set_bias(bias);
      if (dbias_wanted(a, gr)) {
        bias_layout(a, &d, &s);
        opt.set_dbias(tensor(*g, "dbias", kDBias, d, s));
      }
    }
    if (seq_q) opt.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
    auto outs = g->sdpa_backward(Q, K, V, O, dO, Stats, opt);
    dims_strides(a->B, a->H, a->Sq, a->D, a->q_bs, a->q_hs, a->q_rs, &d, &s);
    outs[0]->set_output(true).set_uid(kDQ).set_dim(d).set_stride(s);
    dims_strides(a->B, a->H, a->Sk, a->D, a->k_bs, a->k_hs, a->k_rs, &d, &s);
    outs[1]->set_output(true).set_uid(kDK).set_dim(d).set_stride(s);
    dims_strides(a->B, a->H, a->Sk, a->Dv, a->v_bs, a->v_hs, a->v_rs, &d, &s);
    outs[2]->set_output(true).set_uid(kDV).set_dim(d).set_stride(s);
  }
  auto err = g->build(handle, {fe::HeurMode_t::A});
  if (err.is_good()) err = g->get_workspace_size(plan->ws);
  if (!err.is_good()) {
    plan->why = "cuDNN cannot build this attention graph: " + err.get_message();
    return plan;
  }
  plan->graph = std::move(g);
  return plan;
}

// The cached plan of a call (built on first use); null with why set when cuDNN is unusable.
std::shared_ptr<Plan> plan_for(const mxf_attention_args* a, const mxf_attention_grads* g, bool backward,
                               std::string* why) {
  const Loaded& L = load();
  if (!L.ok) {
    if (why) *why = L.why;
    return nullptr;
  }
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    if (why) *why = "no usable CUDA device";
    return nullptr;
  }
  const std::string key = key_of(a, g, backward, dev);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_plans.find(key);
    if (it != g_plans.end()) {
      if (!it->second->graph && why) *why = it->second->why;
      return it->second;
    }
  }
  std::shared_ptr<Plan> p;
  cudnnHandle_t h = handle_for(dev);
  if (!h) {
    p = std::make_shared<Plan>();
    p->why = "cudnnCreate failed";
  } else {
    try {
      p = build(a, g, backward, h);
    } catch (const std::exception& e) {
      p = std::make_shared<Plan>();
      p->why = std::string("cuDNN frontend: ") + e.what();
    }
  }
  std::lock_guard<std::mutex> lock(g_mu);
  auto ins = g_plans.emplace(key, p).first->second;  // a plan another thread built first wins
  if (!ins->graph && why) *why = ins->why;
  return ins;
}

// workspace pieces after cuDNN's own: forward [seq_q, seq_kv][stats][lastbad]; backward [seq
// lens][flag][own backward]
struct Carve {
  size_t seq = 0, stats = 0, lastbad = 0, flag = 0, own = 0, total = 0;
};
Carve carve(const mxf_attention_args* a, const mxf_attention_grads* g, const Plan& p, bool backward) {
  auto align256 = [](size_t n) { return (n + 255) & ~static_cast<size_t>(255); };
  Carve c;
  size_t off = align256(static_cast<size_t>(p.ws));
  c.seq = off;
  if (has_lengths(a)) off += align256(2 * static_cast<size_t>(a->B) * sizeof(int));
  const size_t N = static_cast<size_t>(a->B * a->H);
  if (!backward) {
    c.stats = off;
    if (!a->lse) off += align256(N * a->Sq * sizeof(float));
    c.lastbad = off;
    if (a->causal == MXF_CAUSAL_EXCLUDE || has_lengths(a)) off += align256((N * a->Dv + N) * sizeof(int));
  } else {
    c.flag = off;
    off += 256;
    c.own = off;
    off += own_backward_ws(a, g);
  }
  c.total = off;
  return c;
}

int fe_status(fe::error_t e) { return e.is_good() ? 0 : MXF_ERR_CUDNN; }

}  // namespace

size_t cudnn_version() { return load().ok ? load().version : 0; }

bool cudnn_available(std::string* why) {
  const Loaded& L = load();
  if (!L.ok) {
    if (why) *why = L.why;
    return false;
  }
  return device_ok(why);
}

size_t cudnn_forward_ws(const mxf_attention_args* a, std::string* why) {
  auto p = plan_for(a, nullptr, false, why);
  if (!p || !p->graph) return static_cast<size_t>(-1);
  return carve(a, nullptr, *p, false).total;
}

size_t cudnn_backward_ws(const mxf_attention_args* a, const mxf_attention_grads* g, std::string* why) {
  auto p = plan_for(a, g, true, why);
  if (!p || !p->graph) return static_cast<size_t>(-1);
  return carve(a, g, *p, true).total;
}

int cudnn_forward(const mxf_attention_args* a, void* ws, size_t ws_size, cudaStream_t st) {
  auto p = plan_for(a, nullptr, false, nullptr);
  if (!p || !p->graph) return MXF_ERR_UNSUPPORTED;
  const Carve c = carve(a, nullptr, *p, false);
  if (c.total > 0 && (!ws || ws_size < c.total)) return MXF_ERR_WORKSPACE;
  char* w = static_cast<char*>(ws);
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  cudnnHandle_t h = handle_for(dev);
  if (!h || fe::detail::set_stream(h, st) != CUDNN_STATUS_SUCCESS) return MXF_ERR_CUDNN;
  float* stats = a->lse ? a->lse : reinterpret_cast<float*>(w + c.stats);
  int* seq = has_lengths(a) ? reinterpret_cast<int*>(w + c.seq) : nullptr;
  if (seq) MXF_TRY(cudnn_launch_seqlen(a, seq, st));
  std::unordered_map<int64_t, void*> pack = {{kQ, const_cast<void*>(a->q)}, {kK, const_cast<void*>(a->k)},
                                             {kV, const_cast<void*>(a->v)}, {kO, a->o}, {kStats, stats}};
  if (has_bias(a)) pack[kBias] = const_cast<void*>(a->mask);
  if (seq) {
    pack[kSeqQ] = seq;
    pack[kSeqKV] = seq + a->B;
  }
  try {
    MXF_TRY(fe_status(p->graph->execute(h, pack, p->ws > 0 ? ws : nullptr)));
  } catch (const std::exception&) {
    return MXF_ERR_CUDNN;
  }
  // the op's semantics for non-finite rows and skipped non-finite values (attention_cudnn.cu)
  int* lastbad = a->causal == MXF_CAUSAL_EXCLUDE || has_lengths(a) ? reinterpret_cast<int*>(w + c.lastbad) : nullptr;
  return cudnn_launch_fixups(a, stats, lastbad, seq ? seq + a->B : nullptr, st);
}

int cudnn_backward(const mxf_attention_args* a, const mxf_attention_grads* g, void* ws, size_t ws_size,
                   cudaStream_t st) {
  auto p = plan_for(a, g, true, nullptr);
  if (!p || !p->graph) return MXF_ERR_UNSUPPORTED;
  const Carve c = carve(a, g, *p, true);
  if (!ws || ws_size < c.total) return MXF_ERR_WORKSPACE;
  char* w = static_cast<char*>(ws);
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  cudnnHandle_t h = handle_for(dev);
  if (!h || fe::detail::set_stream(h, st) != CUDNN_STATUS_SUCCESS) return MXF_ERR_CUDNN;
  int* flag = reinterpret_cast<int*>(w + c.flag);
  int* seq = has_lengths(a) ? reinterpret_cast<int*>(w + c.seq) : nullptr;
  if (seq) MXF_TRY(cudnn_launch_seqlen(a, seq, st));
  // the guard: any non-finite q, k, v, dO or lse sends the call to the own backward
  MXF_TRY(cudnn_launch_guard(a, g, flag, st));
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(a->q)}, {kK, const_cast<void*>(a->k)}, {kV, const_cast<void*>(a->v)},
      {kO, a->o}, {kDO, const_cast<void*>(g->dout)}, {kStats, a->lse},
      {kDQ, g->dq}, {kDK, g->dk}, {kDV, g->dv}};
  if (has_bias(a)) pack[kBias] = const_cast<void*>(a->mask);
  if (dbias_wanted(a, g)) pack[kDBias] = g->dmask;
  if (seq) {
    pack[kSeqQ] = seq;
    pack[kSeqKV] = seq + a->B;
  }
  try {
    MXF_TRY(fe_status(p->graph->execute(h, pack, p->ws > 0 ? ws : nullptr)));
  } catch (const std::exception&) {
    return MXF_ERR_CUDNN;
  }
  // where the guard fired, the own backward (the op's semantics for non-finite values) rewrites
  // every gradient; elsewhere its kernels return at once
  return own_backward(a, g, w + c.own, ws_size - c.own, st, flag);
}

}  // namespace mxf_attn
#endif  // MXF_WITH_CUDNN
