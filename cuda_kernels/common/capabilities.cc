// mxf_capabilities(): which devices each op of this library runs on, read from the library's
// own registrations (lib_api's op registry), for fusion._native.capabilities().
//
// JSON text: {"fused_dense": {"forward": ["cpu", "gpu"], "backward": ["cpu"]}, ...}.
// forward: the devices an op has a forward for (setForward, or setCreateOpState for a
// stateful op); backward: setBackward's devices (not mxf::inference_only_backward's, which
// only refuses), and for a stateful op the devices whose
// state implements Backward (MXNet registers a stateful backward for every device).
#include <algorithm>
#include <mutex>
#include <set>
#include <string>

#include "gpu_glue.h"
#include "mxf_common.h"

namespace {

// Stateful ops' backward: the CPU states of this library have one (fused_dense) except
// fused_inverted_residual's, fused_dense_block's and fused_region's, which only refuse;
// a GPU state says so itself (mxnet_gpu/gpu_glue.cu).
bool stateful_backward(const std::string& op, const std::string& dev) {
  if (op == "fused_inverted_residual") return false;  // its state's Backward only refuses (inference only)
  if (op == "fused_dense_block") return false;        // likewise
  if (op == "fused_region") return false;             // likewise
  if (dev == "cpu") return true;
#if MXF_WITH_CUDA
  if (dev == "gpu") return mxf::gpu::stateful_backward(op);
#endif
  (void)op;
  return false;
}

std::string json_list(const std::set<std::string>& s) {
  std::string out = "[";
  for (const auto& d : s) out += (out.size() > 1 ? ", \"" : "\"") + d + "\"";
  return out + "]";
}

}  // namespace

extern "C" const char* mxf_capabilities() {
  static std::string text;
  static std::once_flag once;
  std::call_once(once, [] {
    auto* reg = mxnet::ext::Registry<mxnet::ext::CustomOp>::get();
    text = "{";
    for (int i = 0; i < reg->size(); ++i) {
      // a copy: mapToVector() appends to the vectors MXNet reads through _opRegGet
      mxnet::ext::CustomOp op = reg->get(i);
      op.forward_ctx_cstr.clear();
      op.backward_ctx_cstr.clear();
      op.create_op_ctx_cstr.clear();
      op.forward_fp.clear();
      op.backward_fp.clear();
      op.create_op_fp.clear();
      op.mapToVector();
      std::set<std::string> fwd, bwd;
      for (const char* c : op.forward_ctx_cstr) fwd.insert(c);
      for (size_t k = 0; k < op.backward_ctx_cstr.size(); ++k)   // a refusal is no backward
        if (op.backward_fp[k] != &mxf::inference_only_backward)
          bwd.insert(op.backward_ctx_cstr[k]);
      for (const char* c : op.create_op_ctx_cstr) {
        fwd.insert(c);
        if (stateful_backward(op.name, c)) bwd.insert(c);
      }
      if (i) text += ", ";
      text += "\"" + std::string(op.name) + "\": {\"forward\": " + json_list(fwd) +
              ", \"backward\": " + json_list(bwd) + "}";
    }
    text += "}";
  });
  return text.c_str();
}

// Whether this build registered the GPU implementations (nvcc found at build time).
extern "C" int mxf_built_with_cuda() {
#if MXF_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}
