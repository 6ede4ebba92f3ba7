/* C interface of the CUDA fused dense layer (libmxfusion_cuda.so); conventions (dtype,
 * stream, workspace, req, return codes) in common/mxf_cuda_types.h.
 *
 * Forward: y = act(x W^T + bias), x (M, K), W (N, K), bias (N) or NULL, row-major.  The
 * product runs on cuBLASLt (fp32 accumulation; fp32 data without TF32) with the bias and
 * relu / gelu_erf in its epilogue (CUBLASLT_EPILOGUE_*); the other activations in one fused
 * elementwise pass over y.  act: 0 none, 1 relu, 2 sigmoid, 3 tanh, 4 softrelu,
 * 5 leaky (slope), 6 gelu_erf, 7 gelu_tanh, 8 act_relu (the op's `act` attribute values),
 * computed as MXNet computes them on the GPU (relu and act_relu keep NaN).
 * heads > 0 writes y as (B, heads, S, N/heads) with M = B*S rows (out_layout=heads_bhsd);
 * heads == 0 writes y as (M, N).
 *
 * Backward (inputs as MXNet hands them: dy and y in the forward's output layout):
 *   dz = dy * act'(...)   (from y; gelu_erf / gelu_tanh from the pre-activation x W^T + bias,
 *                          recomputed by a cuBLASLt product into the workspace)
 *   dx (M, K) = dz W,  dW (N, K) = dz^T x,  dbias (N) = column sums of dz
 *   (dbias in the dW product's CUBLASLT_EPILOGUE_BGRADB where cuBLASLt offers it, else a
 *   two-stage column reduction).  req_* as mxf_cuda_types.h; bias may be NULL when
 *   req_dbias is MXF_REQ_NULL.
 */
#ifndef MXF_FUSED_DENSE_H_
#define MXF_FUSED_DENSE_H_
#include <stddef.h>
#include <stdint.h>

#include "mxf_cuda_types.h"
#ifdef __cplusplus
extern "C" {
#endif

enum {
  MXF_ACT_NONE = 0, MXF_ACT_RELU = 1, MXF_ACT_SIGMOID = 2, MXF_ACT_TANH = 3, MXF_ACT_SOFTRELU = 4,
  MXF_ACT_LEAKY = 5, MXF_ACT_GELU_ERF = 6, MXF_ACT_GELU_TANH = 7, MXF_ACT_ACT_RELU = 8
};

size_t mxf_dense_forward_workspace_size(int dtype, int64_t M, int64_t N, int64_t K, int act,
                                        int64_t heads);
int mxf_dense_forward(int dtype, const void* x, const void* w, const void* bias, void* y,
                      int64_t M, int64_t N, int64_t K, int act, float slope, int64_t heads,
                      int64_t S, void* workspace, size_t workspace_size, void* stream);

size_t mxf_dense_backward_workspace_size(int dtype, int64_t M, int64_t N, int64_t K, int act,
                                         int64_t heads);
int mxf_dense_backward(int dtype, const void* dy, const void* x, const void* w, const void* bias,
                       const void* y, void* dx, void* dw, void* dbias, int req_dx, int req_dw,
                       int req_dbias, int64_t M, int64_t N, int64_t K, int act, float slope,
                       int64_t heads, int64_t S, void* workspace, size_t workspace_size,
                       void* stream);

#ifdef __cplusplus
}
#endif
#endif
