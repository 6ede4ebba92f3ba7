/* C interface of the CUDA fused dense layer (libmxfusion_cuda.so).
 *
 * y = act(x W^T + bias), x (M, K), W (N, K), bias (N) or NULL, all row-major float32
 * device pointers.  act: 0 none, 1 relu, 2 sigmoid, 3 tanh, 4 softrelu, 5 leaky (slope),
 * 6 gelu_erf, 7 gelu_tanh, 8 act_relu (the op's `act` attribute values).  NaN and inf
 * as MXNet computes them on the GPU: relu and act_relu keep NaN.
 * heads > 0 writes y as (B, heads, S, N/heads) with M = B*S rows (out_layout=heads_bhsd);
 * heads == 0 writes y as (M, N).  Returns 0 or a cudaError_t (-1: bad arguments).
 */
#ifndef MXF_FUSED_DENSE_H_
#define MXF_FUSED_DENSE_H_
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

int mxf_dense_forward(const float* x, const float* w, const float* bias, float* y, int64_t M,
                      int64_t N, int64_t K, int act, float slope, int64_t heads, int64_t S,
                      void* stream);

#ifdef __cplusplus
}
#endif
#endif
