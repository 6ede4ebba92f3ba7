// The backends behind the C interface of fused_attention.h (private to libmxfusion_cuda.so).
// attention_dispatch.cu chooses one per call; each answers for itself whether it can run a call
// with the op's exact semantics, and why not.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "fused_attention.h"

namespace mxf_attn {

// ---- the project's own kernels (fused_attention.cu): every dtype, every mode ----
size_t own_forward_ws(const mxf_attention_args* a);
int own_forward(const mxf_attention_args* a, void* ws, size_t ws_size, cudaStream_t st);
size_t own_backward_ws(const mxf_attention_args* a, const mxf_attention_grads* g);
// gate (device int, may be null): when given, every kernel of the backward returns at once unless
// *gate != 0 -- the cuDNN backward runs first and this one only where its guard found non-finite
// inputs (attention_cudnn.cu).
int own_backward(const mxf_attention_args* a, const mxf_attention_grads* g, void* ws, size_t ws_size,
                 cudaStream_t st, const int* gate = nullptr);
bool args_valid(const mxf_attention_args* a);  // the checks every backend shares

// ---- cuDNN's fused flash attention (attention_cudnn.cu), fp16 / bf16 ----
// Whether the op's semantics for these arguments are what cuDNN computes (no GPU needed); why not.
bool cudnn_expressible(const mxf_attention_args* a, const mxf_attention_grads* g, bool backward,
                       std::string* why);
// Whether cuDNN can be loaded and the current device can run it; why not.  Opens libcudnn once.
bool cudnn_available(std::string* why);
// Workspace of the call, or (size_t)-1 when cuDNN's graph for it cannot be built (why says so;
// the answer is cached per graph key, so the call itself takes the same decision).
size_t cudnn_forward_ws(const mxf_attention_args* a, std::string* why);
int cudnn_forward(const mxf_attention_args* a, void* ws, size_t ws_size, cudaStream_t st);
size_t cudnn_backward_ws(const mxf_attention_args* a, const mxf_attention_grads* g, std::string* why);
int cudnn_backward(const mxf_attention_args* a, const mxf_attention_grads* g, void* ws, size_t ws_size,
                   cudaStream_t st);
size_t cudnn_version();  // cudnnGetVersion() of the library loaded, 0 when none
// the kernels around cuDNN's (attention_cudnn.cu), for attention_cudnn_graph.cpp
int cudnn_launch_seqlen(const mxf_attention_args* a, int* seq, cudaStream_t st);
int cudnn_launch_fixups(const mxf_attention_args* a, float* stats, int* lastbad, const int* seq_kv, cudaStream_t st);
int cudnn_launch_guard(const mxf_attention_args* a, const mxf_attention_grads* g, int* flag, cudaStream_t st);

// ---- fp32: cuBLASLt products around a masked softmax, forward and backward (attention_gemm.cu) ----
bool gemm_expressible(const mxf_attention_args* a, bool backward, std::string* why);
size_t gemm_forward_ws(const mxf_attention_args* a);
int gemm_forward(const mxf_attention_args* a, void* ws, size_t ws_size, cudaStream_t st);
size_t gemm_backward_ws(const mxf_attention_args* a, const mxf_attention_grads* g);  // g may be null (a query)
int gemm_backward(const mxf_attention_args* a, const mxf_attention_grads* g, void* ws, size_t ws_size,
                  cudaStream_t st);

}  // namespace mxf_attn
