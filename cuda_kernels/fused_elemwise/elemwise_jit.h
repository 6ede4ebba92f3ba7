// Internal to the CUDA kernel library: the two ways fused_elemwise runs on a GPU.
//  - elemwise_jit.cu: a kernel per (expression, dtypes, broadcast pattern, vector width),
//    generated (elemwise_codegen.h), compiled by NVRTC, cached in memory and on disk, loaded
//    with the CUDA runtime's library API; forward and backward; the C entry points;
//  - fused_elemwise.cu: the interpreter, the forward's fallback where NVRTC is unavailable.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "expr_program.h"

namespace mxf_ew {

// The interpreter's forward: every input and the output in its own dtype (MXF_F32/F16/BF16).
// 0, a cudaError_t, or MXF_ERR_BAD_ARGS / MXF_ERR_UNSUPPORTED with the reason in err.
int interpret(const mxf::expr::Program& prog, const int* in_dtypes, const void* const* inputs,
              const int64_t* const* shapes, const int* ndims, int out_dtype, void* out, std::string* err,
              cudaStream_t stream);

}  // namespace mxf_ew
