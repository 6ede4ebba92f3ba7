// MXNet "gpu" implementations of the fused ops that have a CUDA kernel.
//
// Compiled by nvcc into the op library (libmxfusion_ops.so) when the build finds nvcc: under
// nvcc, MXNet's lib_api.h types OpResource::get_cuda_stream() as cudaStream_t.  Each function
// reads the op's attributes and shapes with the same code as the CPU op (attribute parsing,
// attention geometry), then calls the kernel's C interface (*/<op>.h) on MXNet's stream.
//
// The kernels themselves live in libmxfusion_cuda.so (beside this library, or the file
// MXFUSION_CUDA_LIB names), opened on the first GPU call: loading the op library needs no
// CUDA library (no libcuda, no cuBLASLt), so the same build loads in MXNet's CPU-only wheel,
// where no GPU context exists and these functions are never called.
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "act.h"
#include "gpu_glue.h"
#include "mxf_common.h"
#include "fused_add_layer_norm/fused_add_layer_norm.h"
#include "fused_attention/attention_geom.h"
#include "fused_attention/fused_attention.h"
#include "fused_dense/fused_dense.h"
#include "fused_elemwise/fused_elemwise.h"

namespace mxf {
namespace gpu {
namespace {

// ---- the kernel library, opened once ------------------------------------------------------

struct Kernels {
  decltype(&mxf_dense_forward) dense_forward = nullptr;
  decltype(&mxf_attention_forward) attention_forward = nullptr;
  decltype(&mxf_add_layer_norm_forward) add_layer_norm_forward = nullptr;
  decltype(&mxf_elemwise_forward) elemwise_forward = nullptr;
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
  if (!*fn && err->empty()) *err = std::string("symbol ") + name + " missing";
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
    bind(h, "mxf_dense_forward", &k.dense_forward, &k.error);
    bind(h, "mxf_attention_forward", &k.attention_forward, &k.error);
    bind(h, "mxf_add_layer_norm_forward", &k.add_layer_norm_forward, &k.error);
    bind(h, "mxf_elemwise_forward", &k.elemwise_forward, &k.error);
    if (!k.error.empty()) k.error = "the CUDA kernel library " + path + ": " + k.error;
  });
  if (!k.error.empty()) throw OpError(k.error);
  return k;
}

// ---- checks shared by the ops ----------------------------------------------------------------

void require_gpu(const std::vector<MXTensor>& ts, const char* what) {
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i].ctx.dev_type != "gpu")
      throw OpError(std::string(what) + " " + std::to_string(i) + " is on " + ts[i].ctx.dev_type +
                    ", not on the GPU");
}

void check(int status, const char* what) {
  if (status == 0) return;
  if (status == -1) throw OpError(std::string(what) + ": the kernel refused its arguments");
  throw OpError(std::string(what) + " failed: " +
                cudaGetErrorString(static_cast<cudaError_t>(status)));
}

void* stream_of(const OpResource& res) {
  cudaStream_t s = res.get_cuda_stream();  // MXNet's stream for this op (cudaStream_t under nvcc)
  return static_cast<void*>(s);
}

// ---- fused_add_layer_norm --------------------------------------------------------------------

// as the CPU op: b's rows pair with a's rows modulo b_rows (b broadcasts over leading dims)
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

// ---- fused_dense (stateful: its CPU form keeps a packed weight; the GPU form keeps nothing) ---

int act_code(Act a) {
  switch (a) {
    case Act::none: return 0;
    case Act::relu: return 1;
    case Act::sigmoid: return 2;
    case Act::tanh: return 3;
    case Act::softrelu: return 4;
    case Act::leaky: return 5;
    case Act::gelu_erf: return 6;
    case Act::gelu_tanh: return 7;
    case Act::act_relu: return 8;
    default: throw OpError("activation form has no GPU kernel");  // oneDNN forms: never on GPU
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

  MXReturnValue Forward(std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                        const OpResource& res) override {
    return guarded("fused_dense (gpu)", [&] {
      require_gpu(*in, "input");
      for (auto& t : *in) require_f32(t, "fused_dense (gpu) input");
      const auto& xs = (*in)[0].shape;
      const auto& ws = (*in)[1].shape;
      const int64_t N = ws[0], K = ws[1];
      const int64_t M = K ? numel(xs) / K : 0;
      // the activation MXNet computes on a GPU (no oneDNN) for FullyConnected's output rank
      const Act act = resolve_act(act_, flatten_ ? 2 : static_cast<int>(xs.size()), false);
      const int64_t S = heads_out_ ? xs[1] : 0;
      if (M == 0 || N == 0) return;
      check(kernels().dense_forward((*in)[0].data<float>(), (*in)[1].data<float>(),
                                    no_bias_ ? nullptr : (*in)[2].data<float>(),
                                    (*out)[0].data<float>(), M, N, K, act_code(act), slope_,
                                    heads_out_ ? heads_ : 0, S, stream_of(res)),
            "fused_dense (gpu)");
    });
  }

  MXReturnValue Backward(std::vector<MXTensor>*, std::vector<MXTensor>*,
                         const OpResource&) override {
    return guarded("fused_dense backward (gpu)", [&] {
      throw OpError("no GPU backward in this build");
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
    for (auto& t : *in) require_f32(t, "fused_add_layer_norm (gpu) input");
    const float eps = attr_float(a, "eps", 1e-5f);
    const bool output_sum = attr_bool(a, "output_sum", false);
    const auto& as = (*in)[0].shape;
    const int64_t C = as.back(), R = numel(as) / std::max<int64_t>(C, 1);
    const int64_t BR = b_rows_of(as, (*in)[1].shape);
    if (R == 0 || C == 0) return;
    check(kernels().add_layer_norm_forward(
              (*in)[0].data<float>(), (*in)[1].data<float>(), (*in)[2].data<float>(),
              (*in)[3].data<float>(), (*out)[0].data<float>(),
              output_sum ? (*out)[1].data<float>() : nullptr, R, C, BR, eps, stream_of(res)),
          "fused_add_layer_norm (gpu)");
  });
}

MXReturnValue attention_forward(const Attrs& a, std::vector<MXTensor>* in,
                                std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_attention (gpu)", [&] {
    using namespace attn;
    require_gpu(*in, "input");
    Params p = parse(a);
    const int nd = num_data_inputs(p.layout);
    std::vector<std::vector<int64_t>> s;
    std::vector<float*> d;
    for (int i = 0; i < nd; ++i) {
      require_f32((*in)[i], "fused_attention (gpu) input");
      s.push_back((*in)[i].shape);
      d.push_back((*in)[i].data<float>());
    }
    Geom g = geometry(p, s);
    bind_views(p, &g, d, (*out)[0].data<float>());
    if (g.D > 256 || g.Dv > 256)
      throw OpError("head size " + std::to_string(std::max(g.D, g.Dv)) +
                    " is above the GPU kernel's 256");
    mxf_attention_args k{};
    k.B = g.B; k.H = g.H; k.Sq = g.Sq; k.Sk = g.Sk; k.D = g.D; k.Dv = g.Dv;
    k.q = g.q.p; k.k = g.k.p; k.v = g.v.p; k.o = g.o.p;
    k.q_bs = g.q.bs; k.q_hs = g.q.hs; k.q_rs = g.q.rs;
    k.k_bs = g.k.bs; k.k_hs = g.k.hs; k.k_rs = g.k.rs;
    k.v_bs = g.v.bs; k.v_hs = g.v.hs; k.v_rs = g.v.rs;
    k.o_bs = g.o.bs; k.o_hs = g.o.hs; k.o_rs = g.o.rs;
    k.scale = p.scale;
    k.mask_value = p.mask_value;
    k.causal = !p.causal ? MXF_CAUSAL_NONE
               : p.causal_mode == CausalMode::exclude ? MXF_CAUSAL_EXCLUDE
               : p.causal_mode == CausalMode::add ? MXF_CAUSAL_ADD : MXF_CAUSAL_FILL;
    void* stream = stream_of(res);
    std::vector<int32_t> host_len;
    if (p.mask == MaskKind::additive || p.mask == MaskKind::boolean) {
      const MXTensor& mt = (*in)[nd];
      MaskView m = mask_view(p, g, &mt);  // shapes only: the data stay on the device
      k.mask_kind = p.mask == MaskKind::additive ? MXF_MASK_ADDITIVE : MXF_MASK_BOOLEAN;
      k.mask = m.p;
      k.m_sq = m.sq;
      k.m_sk = m.sk;
      if (!head_strides(m.noff, g.B, g.H, &k.m_sb, &k.m_sh))
        throw OpError("a mask of shape " + shape_str(mt.shape) +
                      " broadcasts over the scores' leading dims in a way the GPU kernel "
                      "(one stride per batch and head) cannot address");
    } else if (p.mask == MaskKind::valid_length) {
      // the lengths are tiny (one per head and query row): read them to the host, turn them
      // into the kernel's int32 (b*H + h, row) table with the CPU op's own indexing, and copy
      // that into MXNet's workspace
      const MXTensor& mt = (*in)[nd];
      size_t bytes = static_cast<size_t>(numel(mt.shape)) *
                     (mt.dtype == mxnet::ext::kFloat64 || mt.dtype == mxnet::ext::kInt64 ? 8
                      : mt.dtype == mxnet::ext::kUint8 ? 1 : 4);
      std::vector<char> host(bytes);
      cudaStream_t cs = static_cast<cudaStream_t>(stream);
      check(static_cast<int>(cudaMemcpyAsync(host.data(), mt.data_ptr, bytes,
                                             cudaMemcpyDeviceToHost, cs)), "valid_length read");
      check(static_cast<int>(cudaStreamSynchronize(cs)), "valid_length read");
      MXTensor ht = mt;
      ht.data_ptr = host.data();
      MaskView m = mask_view(p, g, &ht);
      host_len.assign(m.lengths.begin(), m.lengths.end());
      int32_t* dev = static_cast<int32_t*>(res.alloc_gpu(
          static_cast<int>(host_len.size() * sizeof(int32_t))));
      check(static_cast<int>(cudaMemcpyAsync(dev, host_len.data(), host_len.size() * sizeof(int32_t),
                                             cudaMemcpyHostToDevice, cs)), "valid_length copy");
      k.mask_kind = MXF_MASK_VALID_LENGTH;
      k.lengths = dev;
      k.len_sn = g.Sq;
      k.len_sq = 1;
    } else {
      k.mask_kind = MXF_MASK_NONE;
    }
    if (g.B * g.H * g.Sq == 0) return;
    check(kernels().attention_forward(&k, stream), "fused_attention (gpu)");
  });
}

MXReturnValue elemwise_forward(const Attrs& a, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource& res) {
  return guarded("fused_elemwise (gpu)", [&] {
    require_gpu(*in, "input");
    std::vector<const float*> ptrs;
    std::vector<const int64_t*> shapes;
    std::vector<int> ndims;
    for (auto& t : *in) {
      require_f32(t, "fused_elemwise (gpu) input");
      ptrs.push_back(t.data<float>());
      shapes.push_back(t.shape.data());
      ndims.push_back(static_cast<int>(t.shape.size()));
    }
    if ((*out)[0].size() == 0) return;
    char err[512] = {0};
    const std::string expr = attr_str(a, "expr", "");
    const int st = kernels().elemwise_forward(expr.c_str(), static_cast<int>(ptrs.size()), ptrs.data(),
                                              shapes.data(), ndims.data(), (*out)[0].data<float>(),
                                              err, sizeof(err), stream_of(res));
    if (st == -1 && err[0]) throw OpError(err);
    check(st, "fused_elemwise (gpu)");
  });
}

MXReturnValue dense_create_state(const Attrs& a, const MXContext&, const std::vector<Shape>&,
                                 const std::vector<int>, CustomStatefulOp** op) {
  return guarded("fused_dense (gpu)", [&] { *op = CustomStatefulOp::create<DenseGpu>(a); });
}

bool stateful_backward(const std::string& op) {
  (void)op;
  return false;  // fused_dense: no GPU backward in this build
}

}  // namespace gpu
}  // namespace mxf
