/* C interface of the CUDA fused elementwise op (libmxfusion_cuda.so); conventions (dtype,
 * stream, req, return codes) in common/mxf_cuda_types.h.
 *
 * Evaluates `expr` (the fused_elemwise expression language, see README.md) over num_args
 * device inputs with NumPy broadcasting; out (device) must hold the broadcast shape.  The
 * program runs in float32; each input, the output and each gradient has its own storage dtype.
 *
 * Where NVRTC can be loaded (nvrtc_compile.h) every call runs a kernel generated for its
 * expression, dtypes, broadcast pattern and vector width (elemwise_codegen.h), compiled once and
 * cached in memory and on disk (${MXFUSION_NVRTC_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/
 * mxnet-fusion/nvrtc}; "off" turns the disk cache off): each input element read once, the output
 * written once, 16-byte vector loads and stores where the innermost dim is contiguous and
 * aligned.  Elsewhere the forward falls back to an interpreter kernel (<= 64 instructions,
 * <= 8 inputs, rank <= 6); mxf_elemwise_jit_status() says which runs and why.  The backward
 * needs NVRTC.
 * Returns 0, a cudaError_t, or MXF_ERR_* with a message in err (parse, broadcast, NVRTC).
 */
#ifndef MXF_FUSED_ELEMWISE_H_
#define MXF_FUSED_ELEMWISE_H_
#include <stddef.h>
#include <stdint.h>

#include "mxf_cuda_types.h"
#ifdef __cplusplus
extern "C" {
#endif

/* Every input and the output of dtype `dtype`. */
int mxf_elemwise_forward(int dtype, const char* expr, int num_args, const void* const* inputs,
                         const int64_t* const* shapes, const int* ndims, void* out, char* err,
                         int errlen, void* stream);

/* Input k of dtype in_dtypes[k], the output of out_dtype. */
int mxf_elemwise_forward_ex(const char* expr, int num_args, const int* in_dtypes, const void* const* inputs,
                            const int64_t* const* shapes, const int* ndims, int out_dtype, void* out,
                            char* err, int errlen, void* stream);

/* Backward: dy (the output's shape, dy_dtype) -> the gradient of every input (its shape,
 * grad_dtypes[k], reqs[k]; summed over the axes the input broadcasts along), the expression's
 * derivative generated from the same program as the CPU op's backward computes it.  Inputs that
 * broadcast need workspace (float32 buffers of the output's size, then a deterministic sum). */
size_t mxf_elemwise_backward_workspace_size(const char* expr, int num_args, const int64_t* const* shapes,
                                            const int* ndims);
int mxf_elemwise_backward(const char* expr, int num_args, int dy_dtype, const void* dy, const int* in_dtypes,
                          const void* const* inputs, const int64_t* const* shapes, const int* ndims,
                          const int* grad_dtypes, void* const* grads, const int* reqs, void* workspace,
                          size_t workspace_size, char* err, int errlen, void* stream);

/* "nvrtc: NVRTC 13.0 (<path>)" when generated kernels run, else "interpreter: <why>"; a later
 * line names the last kernel that could not be built, if any. */
const char* mxf_elemwise_jit_status(void);
/* 1: generated kernels where NVRTC is (the default; MXFUSION_ELEMWISE_JIT=0 starts with 0),
 * 0: the interpreter always (benchmarks).  Returns the previous setting. */
int mxf_elemwise_set_jit(int enabled);

#ifdef __cplusplus
}
#endif
#endif
