/* C interface of the CUDA fused elementwise op (libmxfusion_cuda.so); conventions (dtype,
 * stream, return codes) in common/mxf_cuda_types.h.
 *
 * Evaluates `expr` (the fused_elemwise expression language, see README.md) over num_args
 * device inputs with NumPy broadcasting; out (device) must hold the broadcast shape.  Every
 * input and the output have `dtype`; the program runs in float32.  One pass over memory: each
 * input element read once (128-bit loads where every input is either the output's shape or a
 * single element and the pointers are 16-byte aligned), the output written once.
 * Limits: 64 instructions, 8 inputs, rank 6.  No workspace.
 * Returns 0, a cudaError_t, or MXF_ERR_BAD_ARGS with a message in err (parse / broadcast).
 * Backward: none on the GPU (the op's backward runs on the CPU).
 */
#ifndef MXF_FUSED_ELEMWISE_H_
#define MXF_FUSED_ELEMWISE_H_
#include <stdint.h>

#include "mxf_cuda_types.h"
#ifdef __cplusplus
extern "C" {
#endif

int mxf_elemwise_forward(int dtype, const char* expr, int num_args, const void* const* inputs,
                         const int64_t* const* shapes, const int* ndims, void* out, char* err,
                         int errlen, void* stream);

#ifdef __cplusplus
}
#endif
#endif
