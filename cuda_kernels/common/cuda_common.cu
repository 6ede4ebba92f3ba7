// The library-wide entry points of common/mxf_cuda_types.h.
#include "cuda_common.cuh"

extern "C" int mxf_dtype_size(int dtype) { return static_cast<int>(mxf_cuda::dtype_bytes(dtype)); }

extern "C" const char* mxf_cuda_error_string(int rc) {
  if (rc == MXF_OK) return "success";
  if (rc == MXF_ERR_BAD_ARGS) return "invalid arguments (shape, dtype, layout or code not accepted)";
  if (rc == MXF_ERR_WORKSPACE) return "workspace missing or smaller than the size query's answer";
  if (rc == MXF_ERR_UNSUPPORTED) return "combination not implemented by the CUDA kernels";
  if (rc == MXF_ERR_CUDNN) return "cuDNN: a fused attention graph failed to run";
  if (rc <= MXF_ERR_CUBLAS && rc > MXF_ERR_CUDNN) {
    switch (MXF_ERR_CUBLAS - rc) {
      case 1: return "cuBLASLt: not initialized";
      case 3: return "cuBLASLt: allocation failed";
      case 7: return "cuBLASLt: invalid value";
      case 8: return "cuBLASLt: architecture mismatch";
      case 13: return "cuBLASLt: execution failed";
      case 14: return "cuBLASLt: internal error";
      case 15: return "cuBLASLt: not supported (no algorithm for this problem)";
    }
    return "cuBLASLt error";
  }
  if (rc > 0) return cudaGetErrorString(static_cast<cudaError_t>(rc));
  return "unknown error";
}
