// The C interface of fused_attention.h: one backend per call, chosen by an explicit capability
// check whose reasons the caller can read (mxf_attention_backend).
//  fp16 / bf16: cuDNN's fused flash attention where it computes the op's exact semantics and
//               cuDNN is loadable and builds the graph; else the own tensor-core kernels.
//  fp32:        cuBLASLt products around a masked-softmax kernel, forward and backward (the S x S
//               scores in the workspace); the own kernels where the products cannot run.
// The workspace-size query and the call take the same decision (cuDNN's graph build is cached
// per graph key, its failure included).
#include <cstdlib>
#include <cstring>
#include <string>

#include "attention_backends.h"
#include "cuda_common.cuh"

namespace {

using namespace mxf_attn;

int env_backend() {
  static const int v = [] {
    const char* e = std::getenv("MXFUSION_ATTN_BACKEND");
    if (!e) return static_cast<int>(MXF_ATTN_AUTO);
    if (!std::strcmp(e, "own")) return static_cast<int>(MXF_ATTN_OWN);
    if (!std::strcmp(e, "cudnn")) return static_cast<int>(MXF_ATTN_CUDNN);
    if (!std::strcmp(e, "gemm")) return static_cast<int>(MXF_ATTN_GEMM);
    return static_cast<int>(MXF_ATTN_AUTO);
  }();
  return v;
}

struct Choice {
  int backend;      // MXF_ATTN_* or a negative MXF_ERR_*
  std::string why;  // why the faster backends were not taken
  size_t ws = 0;    // the chosen backend's workspace
};

Choice choose(const mxf_attention_args* a, const mxf_attention_grads* g, bool backward) {
  Choice c{MXF_ATTN_OWN, ""};
  if (!args_valid(a)) return {MXF_ERR_BAD_ARGS, "invalid arguments"};
  const int want = a->backend != MXF_ATTN_AUTO ? a->backend : env_backend();
  if (want < MXF_ATTN_AUTO || want > MXF_ATTN_GEMM) return {MXF_ERR_BAD_ARGS, "unknown backend code"};
  auto note = [&](const char* name, const std::string& r) {
    c.why += (c.why.empty() ? "" : "; ") + std::string(name) + ": " + r;
  };
  const bool half = a->dtype != MXF_F32;
  if (want == MXF_ATTN_AUTO || want == MXF_ATTN_CUDNN) {
    std::string r;
    bool ok = cudnn_expressible(a, g, backward, &r) && cudnn_available(&r);
    if (ok) {
      c.ws = backward ? cudnn_backward_ws(a, g, &r) : cudnn_forward_ws(a, &r);
      ok = c.ws != static_cast<size_t>(-1);
    }
    if (ok) {
      c.backend = MXF_ATTN_CUDNN;
      return c;
    }
    if (half || want == MXF_ATTN_CUDNN) note("cudnn", r);
    if (want == MXF_ATTN_CUDNN) return {MXF_ERR_UNSUPPORTED, c.why};
  }
  if (want == MXF_ATTN_AUTO || want == MXF_ATTN_GEMM) {
    std::string r;
    if (gemm_expressible(a, backward, &r)) {
      c.backend = MXF_ATTN_GEMM;
      c.ws = backward ? gemm_backward_ws(a, g) : gemm_forward_ws(a);
      return c;
    }
    if (!half || want == MXF_ATTN_GEMM) note("gemm", r);
    if (want == MXF_ATTN_GEMM) return {MXF_ERR_UNSUPPORTED, c.why};
  }
  c.backend = MXF_ATTN_OWN;
  c.ws = backward ? own_backward_ws(a, g) : own_forward_ws(a);
  return c;
}

}  // namespace

extern "C" int mxf_attention_backend(const mxf_attention_args* args, int backward, char* why, size_t why_size) {
  const Choice c = choose(args, nullptr, backward != 0);  // the gradients' own checks come with the call
  if (why && why_size > 0) {
    const size_t n = c.why.size() < why_size - 1 ? c.why.size() : why_size - 1;
    std::memcpy(why, c.why.data(), n);
    why[n] = '\0';
  }
  return c.backend;
}

extern "C" size_t mxf_attention_forward_workspace_size(const mxf_attention_args* args) {
  const Choice c = choose(args, nullptr, false);
  return c.backend > 0 ? c.ws : 0;
}

extern "C" int mxf_attention_forward(const mxf_attention_args* args, void* workspace, size_t workspace_size,
                                     void* stream) {
  const Choice c = choose(args, nullptr, false);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (c.backend) {
    case MXF_ATTN_CUDNN: return cudnn_forward(args, workspace, workspace_size, st);
    case MXF_ATTN_GEMM: return gemm_forward(args, workspace, workspace_size, st);
    case MXF_ATTN_OWN: return own_forward(args, workspace, workspace_size, st);
  }
  return c.backend;
}

extern "C" size_t mxf_attention_backward_workspace_size(const mxf_attention_args* args,
                                                        const mxf_attention_grads* grads) {
  const Choice c = choose(args, grads, true);
  return c.backend > 0 ? c.ws : 0;
}

extern "C" int mxf_attention_backward(const mxf_attention_args* args, const mxf_attention_grads* grads,
                                      void* workspace, size_t workspace_size, void* stream) {
  if (!args || !grads || !args->lse || !grads->dout) return MXF_ERR_BAD_ARGS;
  const Choice c = choose(args, grads, true);
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (c.backend) {
    case MXF_ATTN_CUDNN: return cudnn_backward(args, grads, workspace, workspace_size, st);
    case MXF_ATTN_GEMM: return gemm_backward(args, grads, workspace, workspace_size, st);
    case MXF_ATTN_OWN: return own_backward(args, grads, workspace, workspace_size, st, nullptr);
  }
  return c.backend;
}

extern "C" size_t mxf_cudnn_version(void) { return cudnn_version(); }
