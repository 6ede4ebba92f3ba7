/* C interface of the CUDA fused elementwise op (libmxfusion_cuda.so).
 *
 * Evaluates `expr` (the fused_elemwise expression language, see README.md) over
 * num_args float32 device inputs with NumPy broadcasting; out (device) must hold the
 * broadcast shape.  Limits: 64 instructions, 8 inputs, rank 6.
 * Returns 0, a cudaError_t, or -1 with a message in err (parse/broadcast errors).
 */
#ifndef MXF_FUSED_ELEMWISE_H_
#define MXF_FUSED_ELEMWISE_H_
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

int mxf_elemwise_forward(const char* expr, int num_args, const float* const* inputs,
                         const int64_t* const* shapes, const int* ndims, float* out, char* err,
                         int errlen, void* stream);

#ifdef __cplusplus
}
#endif
#endif
