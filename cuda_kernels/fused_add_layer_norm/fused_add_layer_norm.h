/* C interface of the CUDA fused add + LayerNorm (libmxfusion_cuda.so); conventions (dtype,
 * stream, workspace, req, return codes) in common/mxf_cuda_types.h.
 *
 * Forward: s = a + b (b's row r % b_rows: b broadcast over a's leading dims),
 * y = (s - mean(s)) * rstd * gamma + beta over rows of C elements, R rows (R % b_rows == 0),
 * rstd = 1 / sqrt(var(s) + eps), two-pass variance in float32; one read of a and b, one write
 * of y (128-bit accesses when C and the pointers allow).  sum_out (may be NULL) receives s;
 * mean / rstd (float32, R each; may be NULL) receive the row statistics.  C <= 32768.
 * NaN and inf as the CPU op (README.md): a non-finite row gives NaN, an overflowing variance
 * beta (rstd = 0).
 *
 * Backward: dy (R, C), dsum (R, C) or NULL (the gradient of the sum output, added to ds),
 * a, b, gamma as the forward; mean / rstd from the forward or NULL (recomputed from a + b).
 *   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dsum,  g = dy * gamma
 *   da = ds;  db[r'] = sum over r % b_rows == r' of ds[r];  dgamma = sum_r dy * xhat;
 *   dbeta = sum_r dy   (dgamma / dbeta / a broadcast db: two-stage reductions in float32).
 */
#ifndef MXF_FUSED_ADD_LAYER_NORM_H_
#define MXF_FUSED_ADD_LAYER_NORM_H_
#include <stddef.h>
#include <stdint.h>

#include "mxf_cuda_types.h"
#ifdef __cplusplus
extern "C" {
#endif

int mxf_add_layer_norm_forward(int dtype, const void* a, const void* b, const void* gamma,
                               const void* beta, void* y, void* sum_out, float* mean,
                               float* rstd, int64_t R, int64_t C, int64_t b_rows, float eps,
                               void* stream);

size_t mxf_add_layer_norm_backward_workspace_size(int dtype, int64_t R, int64_t C,
                                                  int64_t b_rows);
int mxf_add_layer_norm_backward(int dtype, const void* dy, const void* dsum, const void* a,
                                const void* b, const void* gamma, const float* mean,
                                const float* rstd, void* da, void* db, void* dgamma,
                                void* dbeta, int req_da, int req_db, int req_dgamma,
                                int req_dbeta, int64_t R, int64_t C, int64_t b_rows, float eps,
                                void* workspace, size_t workspace_size, void* stream);

#ifdef __cplusplus
}
#endif
#endif
