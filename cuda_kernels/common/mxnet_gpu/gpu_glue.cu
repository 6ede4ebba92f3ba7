// MXNet "gpu" implementations of the fused ops that have a CUDA kernel.
//
// Compiled by nvcc into the op library (libmxfusion_ops.so) when the build finds nvcc: under
// nvcc, MXNet's lib_api.h types OpResource::get_cuda_stream() as cudaStream_t.  Each function
// reads the op's attributes and shapes with the same code as the CPU op (attribute parsing,
// attention geometry), then calls the kernel's C interface (*/<op>.h, conventions in
// common/mxf_cuda_types.h) on MXNet's stream, with the scratch memory the kernel asks for
// taken from MXNet's workspace (OpResource::alloc_gpu, once per call: MXNet hands out one
// temporary space per op, which a second, larger request would replace).  Outputs are written
// (lib_api passes no OpReqType: MXF_REQ_WRITE).
//
// The kernels themselves live in libmxfusion_cuda.so (beside this library, or the file
// MXFUSION_CUDA_LIB names), opened on the first GPU call: loading the op library needs no
// CUDA library (no libcuda, no cuBLASLt), so the same build loads in MXNet's CPU-only wheel,
// where no GPU context exists and these functions are never called.
#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "act.h"
#include "gpu_glue.h"
#include "half.h"
#include "mxf_common.h"
#include "fused_add_layer_norm/fused_add_layer_norm.h"
#include "fused_attention/attention_geom.h"
#include "fused_attention/fused_attention.h"
#include "fused_dense/fused_dense.h"
#include "fused_elemwise/fused_elemwise.h"
#include "mxf_cuda_types.h"

namespace mxf {
namespace gpu {
namespace {

// ---- the kernel library, opened once ------------------------------------------------------

struct Kernels {
  decltype(&mxf_cuda_error_string) error_string = nullptr;
  decltype(&mxf_dense_forward_workspace_size) dense_forward_ws = nullptr;
  decltype(&mxf_dense_forward) dense_forward = nullptr;
  decltype(&mxf_dense_backward_workspace_size) dense_backward_ws = nullptr;
  decltype(&mxf_dense_backward) dense_backward = nullptr;
  decltype(&mxf_attention_forward_workspace_size) attention_forward_ws = nullptr;
  decltype(&mxf_attention_forward) attention_forward = nullptr;
  decltype(&mxf_attention_backward_workspace_size) attention_backward_ws = nullptr;
  decltype(&mxf_attention_backward) attention_backward = nullptr;
  decltype(&mxf_add_layer_norm_forward) add_layer_norm_forward = nullptr;
  decltype(&mxf_add_layer_norm_backward_workspace_size) add_layer_norm_backward_ws = nullptr;
  decltype(&mxf_add_layer_norm_backward) add_layer_norm_backward = nullptr;
  decltype(&mxf_elemwise_forward_ex) elemwise_forward = nullptr;
  decltype(&mxf_elemwise_backward_workspace_size) elemwise_backward_ws = nullptr;
  decltype(&mxf_elemwise_backward) elemwise_backward = nullptr;
  std::string error;  // why the library could not be used (empty: it can)
};

std::string kernel_library_path() {
  const char* env = std::getenv("MXFUSION_CUDA_LIB");
  if (env && *env) return env;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&kernel_library_path), &info) && info.dli_fname) {
    std::string self(info.dli_fname);
    const size_t slash = self.rfind('/');
    return (slash == std::string::npos ? std::string() : self.substr(0, slash + 1)) +
           "libmxfusion_cuda.so";
  }
  return "libmxfusion_cuda.so";
}

template <class F>
void bind(void* h, const char* name, F* fn, std::string* err) {
  *fn = reinterpret_cast<F>(dlsym(h, name));
  if (!*fn && err->empty()) *err = std::string("symbol ") + name + " missing (an older build?)";
}

const Kernels& kernels() {
  static Kernels k;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string path = kernel_library_path();
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      k.error = "the CUDA kernel library " + path + " could not be loaded (" +
                (e ? e : "unknown error") + "); build it with `python -m fusion.build` where nvcc is";
      return;
    }
    bind(h, "mxf_cuda_error_string", &k.error_string, &k.error);
    bind(h, "mxf_dense_forward_workspace_size", &k.dense_forward_ws, &k.error);
    bind(h, "mxf_dense_forward", &k.dense_forward, &k.error);
    bind(h, "mxf_dense_backward_workspace_size", &k.dense_backward_ws, &k.error);
    bind(h, "mxf_dense_backward", &k.dense_backward, &k.error);
    bind(h, "mxf_attention_forward_workspace_size", &k.attention_forward_ws, &k.error);
    bind(h, "mxf_attention_forward", &k.attention_forward, &k.error);
    bind(h, "mxf_attention_backward_workspace_size", &k.attention_backward_ws, &k.error);
    bind(h, "mxf_attention_backward", &k.attention_backward, &k.error);
    bind(h, "mxf_add_layer_norm_forward", &k.add_layer_norm_forward, &k.error);
    bind(h, "mxf_add_layer_norm_backward_workspace_size", &k.add_layer_norm_backward_ws, &k.error);
    bind(h, "mxf_add_layer_norm_backward", &k.add_layer_norm_backward, &k.error);
    bind(h, "mxf_elemwise_forward_ex", &k.elemwise_forward, &k.error);
    bind(h, "mxf_elemwise_backward_workspace_size", &k.elemwise_backward_ws, &k.error);
    bind(h, "mxf_elemwise_backward", &k.elemwise_backward, &k.error);
    if (!k.error.empty()) k.error = "the CUDA kernel library " + path + ": " + k.error;
  });
  if (!k.error.empty()) throw OpError(k.error);
  return k;
}

// ---- checks and helpers shared by the ops ----------------------------------------------------

void require_gpu(const std::vector<MXTensor>& ts, const char* what) {
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i].ctx.dev_type != "gpu")
      throw OpError(std::string(what) + " " + std::to_string(i) + " is on " + ts[i].ctx.dev_type +
                    ", not on the GPU");
}

void check(int rc, const char* what) {
  if (rc == 0) return;
  throw OpError(std::string(what) + " failed: " + kernels().error_string(rc));
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw OpError(std::string(what) + " failed: " + cudaGetErrorString(e));
}

cudaStream_t stream_of(const OpResource& res) {
  return res.get_cuda_stream();  // MXNet's stream for this op (cudaStream_t under nvcc)
}

// mshadow's dtype code -> the kernels' (mxf_cuda_types.h)
constexpr int kBfloat16 = 12;
int kernel_dtype(int code) {
  switch (code) {
    case mxnet::ext::kFloat32: return MXF_F32;
    case mxnet::ext::kFloat16: return MXF_F16;
    case kBfloat16: return MXF_BF16;
    default: return -1;
  }
}

// The one dtype of the floating-point tensors of a call (the kernels take one for all).
int common_dtype(const std::vector<const MXTensor*>& ts, const char* op) {
  const int code = ts.front()->dtype;
  for (const MXTensor* t : ts)
    if (t->dtype != code)
      throw OpError(std::string(op) + ": the GPU kernel takes one dtype for all its tensors, got codes " +
                    std::to_string(code) + " and " + std::to_string(t->dtype));
  const int d = kernel_dtype(code);
  if (d < 0)
    throw OpError(std::string(op) + ": the GPU kernel takes float32, float16 or bfloat16, got dtype code " +
                  std::to_string(code));
  return d;
}

size_t dtype_bytes(int code) {
  switch (code) {
    case mxnet::ext::kFloat64:
    case mxnet::ext::kInt64: return 8;
    case mxnet::ext::kFloat16:
    case kBfloat16: return 2;
    case mxnet::ext::kUint8:
    case mxnet::ext::kInt8: return 1;
    default: return 4;
  }
}

// Scratch memory of one call, from MXNet's workspace in a single request.
class Workspace {
 public:
  size_t add(size_t bytes) {  // offset of a new part (256-byte aligned)
    const size_t off = total_;
    total_ += (bytes + 255) / 256 * 256;
    return off;
  }
  void allocate(const OpResource& res) {
    if (total_ == 0) return;
    if (total_ > static_cast<size_t>(INT32_MAX))
      throw OpError("needs " + std::to_string(total_) + " bytes of workspace, more than MXNet hands out");
    base_ = static_cast<char*>(res.alloc_gpu(static_cast<int>(total_)));
    if (!base_) throw OpError("MXNet's GPU workspace is not available");
  }
  void* at(size_t off) const { return base_ ? base_ + off : nullptr; }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
  char* base_ = nullptr;
};

// ---- one dtype for a kernel that takes one --------------------------------------------------------

__device__ __forceinline__ float load_as_float(const void* p, int dt, int64_t i) {
  if (dt == MXF_F16) return __half2float(static_cast<const __half*>(p)[i]);
  if (dt == MXF_BF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}

// dst = src in another dtype (kernel codes), rounded to nearest even; with `saturate` a finite
// value beyond float16's range becomes its largest finite value (an additive mask's "very
// negative" stays very negative instead of turning into -inf), inf and NaN stay.
__global__ void convert_kernel(const void* src, int sdt, void* dst, int ddt, int64_t n, bool saturate) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v = load_as_float(src, sdt, i);
    if (saturate && ddt == MXF_F16 && isfinite(v)) v = fminf(fmaxf(v, -65504.f), 65504.f);
    if (ddt == MXF_F16) static_cast<__half*>(dst)[i] = __float2half_rn(v);
    else if (ddt == MXF_BF16) static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(v);
    else static_cast<float*>(dst)[i] = v;
  }
}

void convert(const void* src, int sdt, void* dst, int ddt, int64_t n, cudaStream_t st, bool saturate = false) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 4096);
  convert_kernel<<<static_cast<unsigned>(blocks), 256, 0, st>>>(src, sdt, dst, ddt, n, saturate);
  check_cuda(cudaGetLastError(), "converting a tensor's dtype");
}

// The tensors of a call in the one dtype its kernel takes (`kd`, a kernel code): each tensor of
// another dtype gets a workspace copy, converted before the kernel (an input) or after it (an
// output: written whole, lib_api's req is write).  Plan with add() before Workspace::allocate().
class OneDtype {
 public:
  explicit OneDtype(int kd) : kd_(kd) {}
  int dtype() const { return kd_; }
  void add(Workspace* ws, const MXTensor* t, bool output, bool saturate = false) {
    const int d = kernel_dtype(t->dtype);
    if (d < 0)
      throw OpError("the GPU kernels take float32, float16 or bfloat16, got " + dtype_name(t->dtype));
    if (d == kd_) return;
    parts_.push_back({t, ws->add(static_cast<size_t>(numel(t->shape)) * mxf_cuda_dtype_bytes(kd_)), output,
                      saturate, d});
  }
  void* ptr(const Workspace& ws, const MXTensor* t) const {
    for (const Part& p : parts_)
      if (p.t == t) return ws.at(p.off);
    return t->data_ptr;
  }
  void before(const Workspace& ws, cudaStream_t st) const {
    for (const Part& p : parts_)
      if (!p.output) convert(p.t->data_ptr, p.dt, ws.at(p.off), kd_, numel(p.t->shape), st, p.saturate);
  }
  void after(const Workspace& ws, cudaStream_t st) const {
    for (const Part& p : parts_)
      if (p.output) convert(ws.at(p.off), kd_, p.t->data_ptr, p.dt, numel(p.t->shape), st);
  }

 private:
  static size_t mxf_cuda_dtype_bytes(int kd) { return kd == MXF_F32 ? 4 : 2; }
  struct Part {
    const MXTensor* t;
    size_t off;
    bool output, saturate;
    int dt;
  };
  int kd_;
  std::vector<Part> parts_;
};

// The kernel dtype of tensors that may differ: their one dtype, or float32 where they differ.
int one_or_float32(const std::vector<const MXTensor*>& ts) {
  for (const MXTensor* t : ts)
    if (t->dtype != ts.front()->dtype) return MXF_F32;
  const int d = kernel_dtype(ts.front()->dtype);
  if (d < 0) throw OpError("the GPU kernels take float32, float16 or bfloat16, got " + dtype_name(ts.front()->dtype));
  return d;
}

// ---- fused_add_layer_norm --------------------------------------------------------------------

// b's rows pair with a's rows modulo b_rows: the one broadcast the CUDA kernels take (b over a's
// leading dims, the form the rule emits at its probe shapes; the CPU op takes any broadcast)
int64_t b_rows_of(const std::vector<int64_t>& as, const std::vector<int64_t>& bs) {
  bool ok = !as.empty() && bs.size() <= as.size() && !bs.empty() && bs.back() == as.back();
  size_t lead = 0;
  while (ok && lead < bs.size() && bs[lead] == 1 && lead + 1 < bs.size()) ++lead;
  for (size_t i = lead; ok && i < bs.size(); ++i) ok = bs[i] == as[as.size() - bs.size() + i];
  if (!ok)
    throw OpError("b " + shape_str(bs) + " must equal a " + shape_str(as) +
                  " or match its trailing dimensions (broadcast over leading dimensions)");
  return numel(bs) / std::max<int64_t>(bs.back(), 1);
}

// ---- fused_attention -------------------------------------------------------------------------

// The (batch, head) strides of a mask whose per-head offsets are `noff` (n = b*H + h), or
// false when the broadcast pattern has none (a plain layout's leading dims broadcasting unevenly).
bool head_strides(const std::vector<int64_t>& noff, int64_t B, int64_t H, int64_t* sb, int64_t* sh) {
  *sh = H > 1 ? noff[1] : 0;
  *sb = B > 1 ? noff[H] : 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      if (noff[b * H + h] != b * *sb + h * *sh) return false;
  return true;
}

// The q, k, v pointers of the kernel for the op's data-input tensors `data` (or their gradients,
// which share their layout).  bind_views offsets the inputs' pointers in float elements; the
// tensors may hold 2-byte elements, so the views are bound to markers (one per input, far
// apart) and each view's element offset is applied to its input's pointer in its element size.
void place_qkv(const attn::Params& p, const attn::Geom& g0, const std::vector<const MXTensor*>& data,
               const void** q, const void** k, const void** v) {
  constexpr uintptr_t kStep = uintptr_t(1) << 40;
  std::vector<float*> marks;
  for (size_t i = 0; i < data.size(); ++i) marks.push_back(reinterpret_cast<float*>((i + 1) * kStep));
  attn::Geom g = g0;
  attn::bind_views(p, &g, marks, nullptr);
  auto place = [&](const attn::View& view) -> const void* {
    const uintptr_t at = reinterpret_cast<uintptr_t>(view.p);
    const size_t i = at / kStep - 1;
    if (at < kStep || i >= data.size()) throw OpError("internal: a q/k/v view outside its inputs");
    const uintptr_t elems = (at - (i + 1) * kStep) / sizeof(float);
    return static_cast<const char*>(data[i]->data_ptr) + elems * dtype_bytes(data[i]->dtype);
  };
  *q = place(g.q);
  *k = place(g.k);
  *v = place(g.v);
}

// The kernel's arguments for the op's tensors: data inputs `d` (q/k/v per the layout), output
// `o`, the mask tensor (or null).  Lengths (valid_length) are left for the caller to place.
struct AttnCall {
  attn::Params p;
  attn::Geom g;
  mxf_attention_args k{};
  std::vector<int32_t> lengths;  // valid_length: the (b*H + h, row) table, on the host
};

AttnCall attention_call(const Attrs& a, const std::vector<const MXTensor*>& data, const MXTensor* out,
                        const MXTensor* mask, cudaStream_t stream) {
  using namespace attn;
  AttnCall c;
  c.p = parse(a);
  const Params& p = c.p;
  std::vector<std::vector<int64_t>> s;
  std::vector<float*> d;
  // the data inputs' one dtype; an output or a mask of another is converted by the caller (OneDtype)
  c.k.dtype = common_dtype(data, "fused_attention (gpu)");
  for (const MXTensor* t : data) {
    s.push_back(t->shape);
    d.push_back(static_cast<float*>(t->data_ptr));  // views are only pointer arithmetic in elements
  }
  c.g = geometry(p, s);
  Geom& g = c.g;
  place_qkv(p, g, data, &c.k.q, &c.k.k, &c.k.v);
  c.k.B = g.B; c.k.H = g.H; c.k.Sq = g.Sq; c.k.Sk = g.Sk; c.k.D = g.D; c.k.Dv = g.Dv;
  c.k.o = out->data_ptr;
  c.k.q_bs = g.q.bs; c.k.q_hs = g.q.hs; c.k.q_rs = g.q.rs;
  c.k.k_bs = g.k.bs; c.k.k_hs = g.k.hs; c.k.k_rs = g.k.rs;
  c.k.v_bs = g.v.bs; c.k.v_hs = g.v.hs; c.k.v_rs = g.v.rs;
  c.k.o_bs = g.o.bs; c.k.o_hs = g.o.hs; c.k.o_rs = g.o.rs;
  if (g.D > 256 || g.Dv > 256)
    throw OpError("head size " + std::to_string(std::max(g.D, g.Dv)) + " is above the GPU kernel's 256");
  c.k.scale = p.scale;
  c.k.mask_value = p.mask_value;
  c.k.causal = !p.causal ? MXF_CAUSAL_NONE
               : p.causal_mode == CausalMode::exclude ? MXF_CAUSAL_EXCLUDE
               : p.causal_mode == CausalMode::add ? MXF_CAUSAL_ADD : MXF_CAUSAL_FILL;
  c.k.mask_kind = MXF_MASK_NONE;
  if (p.mask == MaskKind::additive || p.mask == MaskKind::boolean) {
    MaskView m = mask_view(p, g, mask);  // shapes only: the data stay on the device
    c.k.mask_kind = p.mask == MaskKind::additive ? MXF_MASK_ADDITIVE : MXF_MASK_BOOLEAN;
    c.k.mask = mask->data_ptr;
    c.k.m_sq = m.sq;
    c.k.m_sk = m.sk;
    if (!head_strides(m.noff, g.B, g.H, &c.k.m_sb, &c.k.m_sh))
      throw OpError("a mask of shape " + shape_str(mask->shape) +
                    " broadcasts over the scores' leading dims in a way the GPU kernel "
                    "(one stride per batch and head) cannot address");
  } else if (p.mask == MaskKind::valid_length) {
    // the lengths are tiny (one per head and query row): read them to the host, turn them into
    // the kernel's int32 (b*H + h, row) table with the CPU op's own indexing; the caller
    // copies the table into the workspace
    const size_t bytes = static_cast<size_t>(numel(mask->shape)) * dtype_bytes(mask->dtype);
    std::vector<char> host(bytes);
    if (bytes) {
      check_cuda(cudaMemcpyAsync(host.data(), mask->data_ptr, bytes, cudaMemcpyDeviceToHost, stream),
                 "reading valid_length");
      check_cuda(cudaStreamSynchronize(stream), "reading valid_length");
    }
    MXTensor ht = *mask;
    ht.data_ptr = host.data();
    MaskView m = mask_view(p, g, &ht);
    c.lengths.assign(m.lengths.begin(), m.lengths.end());
    c.k.mask_kind = MXF_MASK_VALID_LENGTH;
    c.k.len_sn = g.Sq;
    c.k.len_sq = 1;
    // what the kernels' cuDNN path may rely on: one length per batch element, none of them 0
    bool per_batch = true, nonzero = g.Sk > 0;
    const int64_t rows_per_b = g.H * g.Sq;
    for (size_t e = 0; e < c.lengths.size(); ++e) {
      per_batch &= c.lengths[e] == c.lengths[(e / rows_per_b) * rows_per_b];
      nonzero &= c.lengths[e] > 0;
    }
    c.k.lengths_hint = (per_batch ? MXF_LEN_PER_BATCH : 0) | (nonzero ? MXF_LEN_NONZERO : 0);
  }
  c.k.allow_tf32 = attr_str(a, "precision", "float32") == "tf32";  // precision="tf32": TF32 products
  return c;
}

// Places the lengths table (if any) at `off` of the workspace and points the args at it.
void place_lengths(AttnCall* c, const Workspace& ws, size_t off, cudaStream_t stream) {
  if (c->k.mask_kind != MXF_MASK_VALID_LENGTH) return;
  int32_t* dev = static_cast<int32_t*>(ws.at(off));
  if (!c->lengths.empty())
    check_cuda(cudaMemcpyAsync(dev, c->lengths.data(), c->lengths.size() * sizeof(int32_t),
                               cudaMemcpyHostToDevice, stream), "copying valid_length");
  c->k.lengths = dev;
}

// ---- fused_dense (stateful: its CPU form keeps a packed weight; the GPU form keeps nothing) ---

int act_code(Act a) {
  switch (a) {
    case Act::none: return MXF_ACT_NONE;
    case Act::relu: return MXF_ACT_RELU;
    case Act::sigmoid: return MXF_ACT_SIGMOID;
    case Act::tanh: return MXF_ACT_TANH;
    case Act::softrelu: return MXF_ACT_SOFTRELU;
    case Act::leaky: return MXF_ACT_LEAKY;
    case Act::gelu_erf: return MXF_ACT_GELU_ERF;
    case Act::gelu_tanh: return MXF_ACT_GELU_TANH;
    case Act::act_relu: return MXF_ACT_ACT_RELU;
    default: throw OpError("this activation form has no GPU kernel");  // oneDNN forms: CPU only
  }
}

class DenseGpu : public CustomStatefulOp {
 public:
  explicit DenseGpu(const Attrs& a)
      : no_bias_(attr_bool(a, "no_bias", false)),
        flatten_(attr_bool(a, "flatten", true)),
        heads_out_(attr_str(a, "out_layout", "plain") == "heads_bhsd"),
        heads_(attr_int(a, "heads", 0)),
        slope_(attr_float(a, "slope", 0.25f)),
        act_(parse_act(a)) {}

  struct Dims {
    int64_t M, N, K, S;
    int act;
  };
  Dims dims(const MXTensor& x, const MXTensor& w) const {
    if (w.shape.size() != 2) throw OpError("weight must be 2-D (num_hidden, K), got " + shape_str(w.shape));
    Dims d;
    d.N = w.shape[0];
    d.K = w.shape[1];
    d.M = d.K ? numel(x.shape) / d.K : 0;
    d.S = heads_out_ ? x.shape[1] : 0;
    // the activation MXNet computes on a GPU (no oneDNN) for FullyConnected's output rank
    d.act = act_code(resolve_act(act_, flatten_ ? 2 : static_cast<int>(x.shape.size()), false));
    return d;
  }

  // inputs: [x, w, (b)]; outputs: [y]
  MXReturnValue Forward(std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                        const OpResource& res) override {
    return guarded("fused_dense (gpu)", [&] {
      require_gpu(*in, "input");
      std::vector<const MXTensor*> ts;
      for (auto& t : *in) ts.push_back(&t);
      // the inputs' one dtype (AMP: float16 data, weight and bias), else float32; an output of
      // another dtype (out_dtype) is converted
      OneDtype od(one_or_float32(ts));
      const int dt = od.dtype();
      const Dims d = dims((*in)[0], (*in)[1]);
      if (d.M == 0 || d.N == 0) return;
      const Kernels& k = kernels();
      const int64_t H = heads_out_ ? heads_ : 0;
      Workspace ws;
      for (auto& t : *in) od.add(&ws, &t, false);
      od.add(&ws, &(*out)[0], true);
      const size_t part = ws.add(k.dense_forward_ws(dt, d.M, d.N, d.K, d.act, H));
      ws.allocate(res);
      const cudaStream_t st = stream_of(res);
      od.before(ws, st);
      check(k.dense_forward(dt, od.ptr(ws, &(*in)[0]), od.ptr(ws, &(*in)[1]),
                            no_bias_ ? nullptr : od.ptr(ws, &(*in)[2]), od.ptr(ws, &(*out)[0]), d.M, d.N, d.K,
                            d.act, slope_, H, d.S, ws.at(part), ws.total() - part, st),
            "fused_dense (gpu)");
      od.after(ws, st);
    });
  }

  // inputs: [dy, x, w, (b), y]; outputs: [dx, dw, (db)]
  MXReturnValue Backward(std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                         const OpResource& res) override {
    return guarded("fused_dense backward (gpu)", [&] {
      require_gpu(*in, "input");
      std::vector<const MXTensor*> ts;
      for (auto& t : *in) ts.push_back(&t);
      for (auto& t : *out) ts.push_back(&t);
      OneDtype od(one_or_float32(ts));
      const int dt = od.dtype();
      const MXTensor &x = (*in)[1], &w = (*in)[2];
      const Dims d = dims(x, w);
      if (d.M == 0 || d.N == 0) return;
      const Kernels& k = kernels();
      const int64_t H = heads_out_ ? heads_ : 0;
      Workspace ws;
      for (auto& t : *in) od.add(&ws, &t, false);
      for (auto& t : *out) od.add(&ws, &t, true);
      const size_t part = ws.add(k.dense_backward_ws(dt, d.M, d.N, d.K, d.act, H));
      ws.allocate(res);
      const cudaStream_t st = stream_of(res);
      od.before(ws, st);
      auto P = [&](const MXTensor& t) { return od.ptr(ws, &t); };
      const void* bias = no_bias_ ? nullptr : P((*in)[3]);
      const void* y = P((*in)[no_bias_ ? 3 : 4]);
      check(k.dense_backward(dt, P((*in)[0]), P(x), P(w), bias, y, P((*out)[0]), P((*out)[1]),
                             no_bias_ ? nullptr : P((*out)[2]), MXF_REQ_WRITE, MXF_REQ_WRITE,
                             no_bias_ ? MXF_REQ_NULL : MXF_REQ_WRITE, d.M, d.N, d.K, d.act, slope_, H, d.S,
                             ws.at(part), ws.total() - part, st),
            "fused_dense backward (gpu)");
      od.after(ws, st);
    });
  }

 private:
  bool no_bias_, flatten_, heads_out_;
  int64_t heads_;
  float slope_;
  Act act_;
};

}  // namespace

MXReturnValue add_layer_norm_forward(const Attrs& a, std::vector<MXTensor>* in,
                                     std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_add_layer_norm (gpu)", [&] {
    require_gpu(*in, "input");
    if (attr_bool(a, "bf16_copy", false))
      throw OpError("bf16_copy is CPU only (fuse(..., precision='bf16') targets CPUs with native bfloat16)");
    std::vector<const MXTensor*> ts;
    for (auto& t : *in) ts.push_back(&t);
    for (auto& t : *out) ts.push_back(&t);
    // one dtype: as it is; mixed (AMP: a float16 projection plus a float32 residual, float32
    // gamma, beta and output): in float32, the others converted -- what AMP's graph computes
    OneDtype od(one_or_float32(ts));
    const float eps = attr_float(a, "eps", 1e-5f);
    const bool output_sum = attr_bool(a, "output_sum", false);
    const auto& as = (*in)[0].shape;
    const int64_t C = as.back(), R = numel(as) / std::max<int64_t>(C, 1);
    const int64_t BR = b_rows_of(as, (*in)[1].shape);
    if (R == 0 || C == 0) return;
    Workspace ws;
    for (auto& t : *in) od.add(&ws, &t, false);
    for (auto& t : *out) od.add(&ws, &t, true);
    ws.allocate(res);
    const cudaStream_t st = stream_of(res);
    od.before(ws, st);
    check(kernels().add_layer_norm_forward(od.dtype(), od.ptr(ws, &(*in)[0]), od.ptr(ws, &(*in)[1]),
                                           od.ptr(ws, &(*in)[2]), od.ptr(ws, &(*in)[3]), od.ptr(ws, &(*out)[0]),
                                           output_sum ? od.ptr(ws, &(*out)[1]) : nullptr, nullptr, nullptr,
                                           R, C, BR, eps, st),
          "fused_add_layer_norm (gpu)");
    od.after(ws, st);
  });
}

// inputs: [dy, (dsum), a, b, gamma, beta, y, (sum)]; outputs: [da, db, dgamma, dbeta]
MXReturnValue add_layer_norm_backward(const Attrs& a, std::vector<MXTensor>* in,
                                      std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_add_layer_norm backward (gpu)", [&] {
    require_gpu(*in, "input");
    std::vector<const MXTensor*> ts;
    for (auto& t : *in) ts.push_back(&t);
    for (auto& t : *out) ts.push_back(&t);
    OneDtype od(one_or_float32(ts));
    const int dt = od.dtype();
    const float eps = attr_float(a, "eps", 1e-5f);
    const bool output_sum = attr_bool(a, "output_sum", false);
    const int k = output_sum ? 2 : 1;
    const MXTensor &A = (*in)[k], &B = (*in)[k + 1], &G = (*in)[k + 2];
    const int64_t C = A.shape.back(), R = numel(A.shape) / std::max<int64_t>(C, 1);
    const int64_t BR = b_rows_of(A.shape, B.shape);
    if (R == 0 || C == 0) return;
    const Kernels& kn = kernels();
    Workspace ws;
    for (auto& t : *in) od.add(&ws, &t, false);
    for (auto& t : *out) od.add(&ws, &t, true);
    const size_t part = ws.add(kn.add_layer_norm_backward_ws(dt, R, C, BR));
    ws.allocate(res);
    const cudaStream_t st = stream_of(res);
    od.before(ws, st);
    auto P = [&](const MXTensor& t) { return od.ptr(ws, &t); };
    check(kn.add_layer_norm_backward(dt, P((*in)[0]), output_sum ? P((*in)[1]) : nullptr, P(A), P(B), P(G),
                                     nullptr, nullptr, P((*out)[0]), P((*out)[1]), P((*out)[2]), P((*out)[3]),
                                     MXF_REQ_WRITE, MXF_REQ_WRITE, MXF_REQ_WRITE, MXF_REQ_WRITE, R, C, BR, eps,
                                     ws.at(part), ws.total() - part, st),
          "fused_add_layer_norm backward (gpu)");
    od.after(ws, st);
  });
}

MXReturnValue attention_forward(const Attrs& a, std::vector<MXTensor>* in,
                                std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_attention (gpu)", [&] {
    require_gpu(*in, "input");
    const attn::Params p = attn::parse(a);
    const int nd = attn::num_data_inputs(p.layout);
    if (p.length_fill) throw OpError("length_fill has no GPU implementation (CPU inference only)");
    std::vector<const MXTensor*> data;
    for (int i = 0; i < nd; ++i) data.push_back(&(*in)[i]);
    const MXTensor* mask = p.mask == attn::MaskKind::none ? nullptr : &(*in)[nd];
    cudaStream_t stream = stream_of(res);
    AttnCall c = attention_call(a, data, &(*out)[0], mask, stream);
    if (c.g.B * c.g.H * c.g.Sq == 0) return;
    const Kernels& k = kernels();
    Workspace ws;
    // AMP's float16 attention has a float32 output (its softmax runs in float32); a float32 mask
    // over float16 data is converted, saturating
    OneDtype od(c.k.dtype);
    od.add(&ws, &(*out)[0], true);
    const bool mask_data = p.mask == attn::MaskKind::additive || p.mask == attn::MaskKind::boolean;
    if (mask_data) od.add(&ws, mask, false, true);
    const size_t len_off = ws.add(c.lengths.size() * sizeof(int32_t));
    const size_t fwd_off = ws.add(k.attention_forward_ws(&c.k));
    ws.allocate(res);
    place_lengths(&c, ws, len_off, stream);
    od.before(ws, stream);
    c.k.o = od.ptr(ws, &(*out)[0]);
    if (mask_data) c.k.mask = od.ptr(ws, mask);
    check(k.attention_forward(&c.k, ws.at(fwd_off), ws.total() - fwd_off, stream), "fused_attention (gpu)");
    od.after(ws, stream);
  });
}

// inputs: [d_out, <forward inputs>, out]; outputs: the forward inputs' gradients.  The kernel's
// backward recomputes from the log-sum-exp of the forward, which MXNet does not keep: a forward
// into the workspace gives it first.
MXReturnValue attention_backward(const Attrs& a, std::vector<MXTensor>* in,
                                 std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_attention backward (gpu)", [&] {
    require_gpu(*in, "input");
    const attn::Params p = attn::parse(a);
    const int nd = attn::num_data_inputs(p.layout);
    if (p.length_fill) throw OpError("length_fill has no GPU implementation (CPU inference only)");
    const bool has_mask = p.mask != attn::MaskKind::none;
    std::vector<const MXTensor*> data;
    for (int i = 0; i < nd; ++i) data.push_back(&(*in)[1 + i]);
    const MXTensor* mask = has_mask ? &(*in)[1 + nd] : nullptr;
    const MXTensor& o = (*in)[1 + nd + (has_mask ? 1 : 0)];
    cudaStream_t stream = stream_of(res);
    AttnCall c = attention_call(a, data, &o, mask, stream);
    // gradients: one per data input (q/k/v views bound to them as the inputs are), then the mask's
    std::vector<const MXTensor*> gdata, typed(data);
    for (int i = 0; i < nd; ++i) {
      gdata.push_back(&(*out)[i]);
      typed.push_back(&(*out)[i]);
    }
    common_dtype(typed, "fused_attention backward (gpu)");  // inputs and their gradients
    const void *dq, *dk, *dv;   // the gradients share their inputs' layout
    place_qkv(p, c.g, gdata, &dq, &dk, &dv);
    if (has_mask && p.mask != attn::MaskKind::additive) {  // where() and lengths get no gradient
      MXTensor& gm = (*out)[nd];
      check_cuda(cudaMemsetAsync(gm.data_ptr, 0, static_cast<size_t>(numel(gm.shape)) * dtype_bytes(gm.dtype),
                                 stream), "zeroing the mask gradient");
    }
    if (c.g.B * c.g.H * c.g.Sq == 0) return;
    const Kernels& k = kernels();
    const int64_t rows = c.g.B * c.g.H * c.g.Sq;
    const size_t eb = c.k.dtype == MXF_F32 ? 4 : 2;  // the recomputed output, in the data's dtype
    mxf_attention_args fwd = c.k;                 // the recomputation: its own output, and lse
    fwd.o_bs = c.g.H * c.g.Sq * c.g.Dv;
    fwd.o_hs = c.g.Sq * c.g.Dv;
    fwd.o_rs = c.g.Dv;
    mxf_attention_grads gr{};
    gr.dout = (*in)[0].data_ptr;                  // d_out has the output's layout
    gr.dq = const_cast<void*>(dq);
    gr.dk = const_cast<void*>(dk);
    gr.dv = const_cast<void*>(dv);
    gr.req_dq = gr.req_dk = gr.req_dv = MXF_REQ_WRITE;
    if (p.mask == attn::MaskKind::additive) {
      gr.dmask = (*out)[nd].data_ptr;
      gr.dmask_numel = numel((*out)[nd].shape);
      gr.req_dmask = MXF_REQ_WRITE;
    } else {
      gr.req_dmask = MXF_REQ_NULL;
    }
    Workspace ws;
    // d_out and the output in another dtype than the data (AMP: float32), the mask's gradient too
    OneDtype od(c.k.dtype);
    od.add(&ws, &(*in)[0], false);
    od.add(&ws, &o, false);
    const bool mask_data = p.mask == attn::MaskKind::additive || p.mask == attn::MaskKind::boolean;
    if (mask_data) od.add(&ws, mask, false, true);
    if (p.mask == attn::MaskKind::additive) od.add(&ws, &(*out)[nd], true);
    const size_t len_off = ws.add(c.lengths.size() * sizeof(int32_t));
    const size_t lse_off = ws.add(static_cast<size_t>(rows) * sizeof(float));
    const size_t o_off = ws.add(static_cast<size_t>(rows) * c.g.Dv * eb);
    const size_t fwd_off = ws.add(k.attention_forward_ws(&fwd));
    const size_t bwd_off = ws.add(k.attention_backward_ws(&c.k, &gr));
    ws.allocate(res);
    place_lengths(&c, ws, len_off, stream);
    od.before(ws, stream);
    c.k.o = od.ptr(ws, &o);
    gr.dout = od.ptr(ws, &(*in)[0]);
    if (mask_data) c.k.mask = fwd.mask = od.ptr(ws, mask);
    if (p.mask == attn::MaskKind::additive) gr.dmask = od.ptr(ws, &(*out)[nd]);
    fwd.lengths = c.k.lengths;
    fwd.o = ws.at(o_off);
    fwd.lse = static_cast<float*>(ws.at(lse_off));
    check(k.attention_forward(&fwd, ws.at(fwd_off), bwd_off - fwd_off, stream),
          "fused_attention backward (gpu), recomputing the forward");
    c.k.lse = fwd.lse;
    check(k.attention_backward(&c.k, &gr, ws.at(bwd_off), ws.total() - bwd_off, stream),
          "fused_attention backward (gpu)");
    od.after(ws, stream);
  });
}

// The kernels' dtype codes of tensors (each its own: the elementwise kernels take any mix).
std::vector<int> kernel_dtypes(const std::vector<const MXTensor*>& ts, const char* op) {
  std::vector<int> d;
  for (const MXTensor* t : ts) {
    d.push_back(kernel_dtype(t->dtype));
    if (d.back() < 0)
      throw OpError(std::string(op) + ": the GPU kernels take float32, float16 or bfloat16, got " +
                    dtype_name(t->dtype));
  }
  return d;
}

MXReturnValue elemwise_forward(const Attrs& a, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_elemwise (gpu)", [&] {
    require_gpu(*in, "input");
    std::vector<const MXTensor*> ts;
    std::vector<const void*> ptrs;
    std::vector<const int64_t*> shapes;
    std::vector<int> ndims;
    for (auto& t : *in) {
      ts.push_back(&t);
      ptrs.push_back(t.data_ptr);
      shapes.push_back(t.shape.data());
      ndims.push_back(static_cast<int>(t.shape.size()));
    }
    const std::vector<int> dts = kernel_dtypes(ts, "fused_elemwise (gpu)");
    const int odt = kernel_dtypes({&(*out)[0]}, "fused_elemwise (gpu)")[0];
    if ((*out)[0].size() == 0) return;
    char err[512] = {0};
    const std::string expr = attr_str(a, "expr", "");
    const int n = static_cast<int>(attr_int(a, "num_args", -1));
    const int rc = kernels().elemwise_forward(expr.c_str(), n, dts.data(), ptrs.data(), shapes.data(), ndims.data(),
                                              odt, (*out)[0].data_ptr, err, sizeof(err), stream_of(res));
    if (rc < 0 && err[0]) throw OpError(err);
    check(rc, "fused_elemwise (gpu)");
  });
}

// inputs: [dy, x0..x{n-1}, y]; outputs: [dx0..dx{n-1}].  The generated backward kernel (NVRTC):
// the gradient of the expression from the same program as the CPU op's backward.
MXReturnValue elemwise_backward(const Attrs& a, std::vector<MXTensor>* in,
                                std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_elemwise backward (gpu)", [&] {
    require_gpu(*in, "input");
    const size_t n = out->size();
    std::vector<const MXTensor*> xs, gs;
    std::vector<const void*> ptrs;
    std::vector<void*> grads;
    std::vector<const int64_t*> shapes;
    std::vector<int> ndims, reqs(n, MXF_REQ_WRITE);
    for (size_t k = 0; k < n; ++k) {
      const MXTensor& x = (*in)[1 + k];
      xs.push_back(&x);
      gs.push_back(&(*out)[k]);
      ptrs.push_back(x.data_ptr);
      grads.push_back((*out)[k].data_ptr);
      shapes.push_back(x.shape.data());
      ndims.push_back(static_cast<int>(x.shape.size()));
    }
    const std::vector<int> dts = kernel_dtypes(xs, "fused_elemwise backward (gpu)");
    const std::vector<int> gdts = kernel_dtypes(gs, "fused_elemwise backward (gpu)");
    const int dydt = kernel_dtypes({&(*in)[0]}, "fused_elemwise backward (gpu)")[0];
    const std::string expr = attr_str(a, "expr", "");
    const int na = static_cast<int>(attr_int(a, "num_args", -1));
    const Kernels& k = kernels();
    Workspace ws;
    const size_t part = ws.add(k.elemwise_backward_ws(expr.c_str(), na, shapes.data(), ndims.data()));
    ws.allocate(res);
    char err[512] = {0};
    const int rc = k.elemwise_backward(expr.c_str(), na, dydt, (*in)[0].data_ptr, dts.data(), ptrs.data(),
                                       shapes.data(), ndims.data(), gdts.data(), grads.data(), reqs.data(),
                                       ws.at(part), ws.total() - part, err, sizeof(err), stream_of(res));
    if (rc < 0 && err[0]) throw OpError(err);
    check(rc, "fused_elemwise backward (gpu)");
  });
}

MXReturnValue dense_create_state(const Attrs& a, const MXContext&, const std::vector<Shape>&,
                                 const std::vector<int>, CustomStatefulOp** op) {
  return guarded("fused_dense (gpu)", [&] { *op = CustomStatefulOp::create<DenseGpu>(a); });
}

bool stateful_backward(const std::string& op) { return op == "fused_dense"; }

}  // namespace gpu
}  // namespace mxf
