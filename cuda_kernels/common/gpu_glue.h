// The "gpu" implementations of the fused ops that have a CUDA kernel (mxnet_gpu/gpu_glue.cu).
//
// Declared only in a library built with nvcc (MXF_WITH_CUDA=1, see fusion/native/library.py);
// each op's registration adds them under `#if MXF_WITH_CUDA`.  Plain C++: no CUDA type
// appears here, so the op files stay ordinary C++ compiled by g++.
#pragma once
#if MXF_WITH_CUDA
#include <string>
#include <vector>

#include "mxf_common.h"

namespace mxf {
namespace gpu {

using mxnet::ext::MXContext;
using mxnet::ext::CustomStatefulOp;

MXReturnValue add_layer_norm_forward(const Attrs& a, std::vector<MXTensor>* in,
                                     std::vector<MXTensor>* out, const OpResource& res);
MXReturnValue add_layer_norm_backward(const Attrs& a, std::vector<MXTensor>* in,
                                      std::vector<MXTensor>* out, const OpResource& res);
MXReturnValue attention_forward(const Attrs& a, std::vector<MXTensor>* in,
                                std::vector<MXTensor>* out, const OpResource& res);
MXReturnValue attention_backward(const Attrs& a, std::vector<MXTensor>* in,
                                 std::vector<MXTensor>* out, const OpResource& res);
MXReturnValue elemwise_forward(const Attrs& a, std::vector<MXTensor>* in,
                               std::vector<MXTensor>* out, const OpResource& res);
MXReturnValue elemwise_backward(const Attrs& a, std::vector<MXTensor>* in,
                                std::vector<MXTensor>* out, const OpResource& res);
MXReturnValue dense_create_state(const Attrs& a, const MXContext& ctx,
                                 const std::vector<Shape>& in_shapes, const std::vector<int> in_types,
                                 CustomStatefulOp** op);

// Whether a stateful op's "gpu" state has a backward (MXNet registers the backward of a
// stateful op for every device; the capability query reports what the state implements).
bool stateful_backward(const std::string& op);

}  // namespace gpu
}  // namespace mxf
#endif
