// Early returns of the CUDA launchers and host entry points: 0 on success, else a cudaError_t value
// (or a negative MXF_ERR_*).  Plain C++ (the cuDNN frontend part includes it) and CUDA alike.
#pragma once
#include <cuda_runtime.h>

#define MXF_CUDA_TRY(expr)                                      \
  do {                                                          \
    const cudaError_t mxf_e_ = (expr);                          \
    if (mxf_e_ != cudaSuccess) return static_cast<int>(mxf_e_); \
  } while (0)
#define MXF_TRY(expr)                 \
  do {                                \
    const int mxf_rc_ = (expr);       \
    if (mxf_rc_ != 0) return mxf_rc_; \
  } while (0)
