/* C interface of the CUDA fused add + LayerNorm (libmxfusion_cuda.so).
 *
 * s = a + b (b row r%b_rows, i.e. broadcast over leading dims), y = LN(s) * gamma + beta
 * over rows of C elements; R rows.  sum_out (may be NULL) receives s.
 * Float32 device pointers; returns 0 or a cudaError_t.
 */
#ifndef MXF_FUSED_ADD_LAYER_NORM_H_
#define MXF_FUSED_ADD_LAYER_NORM_H_
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

int mxf_add_layer_norm_forward(const float* a, const float* b, const float* gamma,
                               const float* beta, float* y, float* sum_out, int64_t R, int64_t C,
                               int64_t b_rows, float eps, void* stream);

#ifdef __cplusplus
}
#endif
#endif
