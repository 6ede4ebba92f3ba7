/* Types shared by the C interfaces of the CUDA kernels (libmxfusion_cuda.so).
 *
 * Conventions of every entry point:
 *  - `dtype` (MXF_F32 / MXF_F16 / MXF_BF16) is the element type of every floating-point
 *    tensor argument of the call (inputs, outputs and the gradients); math and accumulation
 *    are float32 whatever the dtype.  Float side outputs the interface names as `float*`
 *    (log-sum-exp, mean, rstd) are float32 always; lengths are int32.
 *  - `stream` is a cudaStream_t (NULL: the legacy default stream).  Kernels are enqueued on it
 *    and nothing is synchronized; nothing is allocated: scratch memory comes from the caller as
 *    `workspace` (device memory, 256-byte aligned, at least `*_workspace_size(...)` bytes,
 *    uninitialized, owned by the call until the stream reaches its end).
 *  - `req_*` says what to do with an output, with MXNet's OpReqType codes: MXF_REQ_NULL (not
 *    wanted, the pointer may be NULL), MXF_REQ_WRITE / MXF_REQ_INPLACE (overwrite),
 *    MXF_REQ_ADD (add to what is there).
 *  - Return: 0 on success; a positive cudaError_t; or a negative MXF_ERR_* code.
 *    mxf_cuda_error_string() names any of them.
 */
#ifndef MXF_CUDA_TYPES_H_
#define MXF_CUDA_TYPES_H_
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

enum { MXF_F32 = 0, MXF_F16 = 1, MXF_BF16 = 2 };
enum { MXF_REQ_NULL = 0, MXF_REQ_WRITE = 1, MXF_REQ_INPLACE = 2, MXF_REQ_ADD = 3 };
enum {
  MXF_OK = 0,
  MXF_ERR_BAD_ARGS = -1,         /* shapes / codes / pointers the kernel does not accept */
  MXF_ERR_WORKSPACE = -2,        /* workspace NULL or smaller than *_workspace_size() */
  MXF_ERR_UNSUPPORTED = -3,      /* a valid combination this build does not implement */
  MXF_ERR_CUBLAS = -1000,        /* -1000 - cublasStatus_t: cuBLASLt failed */
  MXF_ERR_CUDNN = -2000          /* cuDNN (fused attention) failed to run a graph it had built */
};

/* Bytes per element of a dtype code (0 for an unknown code). */
int mxf_dtype_size(int dtype);
/* A static string naming a return code of any entry point. */
const char* mxf_cuda_error_string(int rc);
/* The version of the cuBLASLt library loaded (cublasLtGetVersion()), e.g. 131000. */
size_t mxf_cublaslt_version(void);

#ifdef __cplusplus
}
#endif
#endif
