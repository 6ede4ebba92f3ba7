// CUDA fused dense on cuBLASLt: the product (fp32 accumulation; fp32 data in full fp32, no
// TF32) with the bias in cuBLASLt's epilogue (CUBLASLT_EPILOGUE_BIAS), the head-split output
// layout (B, heads, S, D) written by the product itself as strided batches, and the
// activation in one elementwise pass over y in place.  The activations are not taken from
// cuBLASLt's RELU / GELU epilogues: its relu drops NaN (MXNet's keeps it) and its GELU is the
// tanh approximation, not MXNet's erf form.  Backward: dz = dy * act' in one pass (from y,
// or for gelu from the pre-activation recomputed by cuBLASLt), dx = dz W and dW = dz^T x on
// cuBLASLt, dbias in the dW product's CUBLASLT_EPILOGUE_BGRADB (or a column reduction where
// cuBLASLt offers no algorithm for it, or where it is added to).
#include "cuda_common.cuh"
#include "fused_dense.h"

#if !__has_include(<cublasLt.h>)
// Built without cuBLAS headers (pass the nvidia-cublas wheel's include folder, see
// cuda_iface.cublas_flags()): every dense entry point answers MXF_ERR_UNSUPPORTED.
extern "C" size_t mxf_cublaslt_version(void) { return 0; }
extern "C" size_t mxf_dense_forward_workspace_size(int, int64_t, int64_t, int64_t, int, int64_t) { return 0; }
extern "C" int mxf_dense_forward(int, const void*, const void*, const void*, void*, int64_t, int64_t, int64_t,
                                 int, float, int64_t, int64_t, void*, size_t, void*) {
  return MXF_ERR_UNSUPPORTED;
}
extern "C" size_t mxf_dense_backward_workspace_size(int, int64_t, int64_t, int64_t, int, int64_t) { return 0; }
extern "C" int mxf_dense_backward(int, const void*, const void*, const void*, const void*, const void*, void*,
                                  void*, void*, int, int, int, int64_t, int64_t, int64_t, int, float, int64_t,
                                  int64_t, void*, size_t, void*) {
  return MXF_ERR_UNSUPPORTED;
}
#else
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <vector>

namespace {

using mxf_cuda::bf16;
using mxf_cuda::from_f;
using mxf_cuda::half;
using mxf_cuda::to_f;

constexpr size_t kLtWorkspace = 32u << 20;  // cuBLASLt's recommendation for Hopper

// ---- activations, as MXNet computes them on the GPU (codes as fused_dense.h) ----
__device__ __forceinline__ float act_fwd(int act, float x, float slope) {
  switch (act) {
    case MXF_ACT_RELU:
    case MXF_ACT_ACT_RELU: return !(x <= 0.f) ? x : 0.f;
    case MXF_ACT_SIGMOID: return 1.f / (1.f + expf(-x));
    case MXF_ACT_TANH: return tanhf(x);
    case MXF_ACT_SOFTRELU: return x > 20.f ? x : log1pf(expf(x));
    case MXF_ACT_LEAKY: return x > 0.f ? x : __fmul_rn(x, slope);
    case MXF_ACT_GELU_ERF: return 0.5f * x * (1.f + erff(x * 0.70710678118654752440f));
    case MXF_ACT_GELU_TANH:  // the written-out ops: 0.5 x (1 + tanh((x + x^3 0.044715) sqrt(2/pi)))
      return 0.5f * x * (1.f + tanhf((x + x * x * x * 0.044715f) * 0.79788456080286536f));
    default: return x;
  }
}
// d act / d z times dy, from y (and z, the pre-activation, for the gelus)
__device__ __forceinline__ float act_bwd(int act, float dy, float y, float z, float slope) {
  switch (act) {
    case MXF_ACT_RELU:
    case MXF_ACT_ACT_RELU: return dy * (y != y ? y : (y > 0.f ? 1.f : 0.f));
    case MXF_ACT_SIGMOID: return dy * (y * (1.f - y));
    case MXF_ACT_TANH: return dy * (1.f - y * y);
    case MXF_ACT_SOFTRELU: return dy * -expm1f(-y);
    case MXF_ACT_LEAKY: return dy * (y > 0.f ? 1.f : slope);
    case MXF_ACT_GELU_ERF:
      return dy * (0.5f * (1.f + erff(z * 0.70710678118654752440f)) +
                   z * expf(-0.5f * z * z) * 0.39894228040143267794f);
    case MXF_ACT_GELU_TANH: {
      const float u = (z + z * z * z * 0.044715f) * 0.79788456080286536f, t = tanhf(u);
      const float du = 0.79788456080286536f * (1.f + 3.f * 0.044715f * z * z);
      return dy * (0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * du);
    }
    default: return dy;
  }
}

template <typename T, bool kVec>
__global__ void act_inplace_kernel(T* __restrict__ y, int64_t n, int act, float slope) {
  using V = mxf_cuda::Vec<T>;
  const int64_t nv = kVec ? n / V::N : 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (kVec)
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nv; i += stride) {
      V v = mxf_cuda::load_vec(y + i * V::N);
#pragma unroll
      for (int e = 0; e < V::N; ++e) v.u.e[e] = from_f<T>(act_fwd(act, to_f(v.u.e[e]), slope));
      mxf_cuda::store_vec(y + i * V::N, v);
    }
  for (int64_t i = nv * V::N + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    y[i] = from_f<T>(act_fwd(act, to_f(y[i]), slope));
}

// y = act(y + bias) in the output layout: the bias of a product whose per-batch bias pointers
// cuBLASLt's epilogue cannot take (not 16-byte aligned).
template <typename T>
__global__ void bias_act_kernel(T* __restrict__ y, const T* __restrict__ bias, int64_t M, int64_t N, int act,
                                float slope, int64_t heads, int64_t S) {
  const int64_t total = M * N, D = heads > 0 ? N / heads : N;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = heads > 0 ? ((e / (S * D)) % heads) * D + e % D : e % N;
    y[e] = from_f<T>(act_fwd(act, to_f(y[e]) + to_f(bias[n]), slope));
  }
}

// y = act(bias or 0) in the output layout: the product of an empty K.
template <typename T>
__global__ void fill_bias_kernel(const T* __restrict__ bias, T* __restrict__ y, int64_t M, int64_t N,
                                 int act, float slope, int64_t heads, int64_t S) {
  const int64_t total = M * N, D = heads > 0 ? N / heads : N;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t n = e % N;
    if (heads > 0) n = ((e / (S * D)) % heads) * D + e % D;  // (b, h, s, d) -> column h*D + d
    y[e] = from_f<T>(act_fwd(act, bias ? to_f(bias[n]) : 0.f, slope));
  }
}

// dz (M, N) row-major from dy / y in the output layout (heads: (B, heads, S, D)) and z (M, N)
// float32 without the bias (gelus only).
template <typename T>
__global__ void dz_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                          const float* __restrict__ z, const T* __restrict__ bias,
                          T* __restrict__ dz, int64_t M, int64_t N, int act, float slope,
                          int64_t heads, int64_t S) {
  const int64_t total = M * N, D = heads > 0 ? N / heads : N;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = e / N, n = e % N;
    int64_t src = e;
    if (heads > 0) {
      const int64_t bb = m / S, s = m % S, hh = n / D, d = n % D;
      src = ((bb * heads + hh) * S + s) * D + d;
    }
    const float zv = z ? z[e] + (bias ? to_f(bias[n]) : 0.f) : 0.f;
    dz[e] = from_f<T>(act_bwd(act, to_f(dy[src]), to_f(y[src]), zv, slope));
  }
}

// dbias[n] (+)= sum_m dz[m, n]: per-block partial column sums in float32 atomically added to acc.
template <typename T>
__global__ void colsum_kernel(const T* __restrict__ dz, float* __restrict__ acc, int64_t M,
                              int64_t N, int64_t rows_per_block) {
  const int64_t n = blockIdx.x * 32 + (threadIdx.x & 31);
  const int64_t m0 = blockIdx.y * rows_per_block;
  const int64_t m1 = m0 + rows_per_block < M ? m0 + rows_per_block : M;
  __shared__ float part[8][33];
  float s = 0.f;
  if (n < N)
    for (int64_t m = m0 + (threadIdx.x >> 5); m < m1; m += 8) s += to_f(dz[m * N + n]);
  part[threadIdx.x >> 5][threadIdx.x & 31] = s;
  __syncthreads();
  if (threadIdx.x < 32 && n < N) {
    float t = 0.f;
    for (int w = 0; w < 8; ++w) t += part[w][threadIdx.x];
    atomicAdd(acc + n, t);
  }
}
template <typename T>
__global__ void finish_kernel(const float* __restrict__ acc, T* __restrict__ out, int64_t n, int req) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) mxf_cuda::store_req(out + i, acc[i], req);
}

// ---- cuBLASLt ----
int lt_status(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? 0 : MXF_ERR_CUBLAS - static_cast<int>(s); }
#define LT_TRY(expr) MXF_TRY(lt_status(expr))

int lt_handle(cublasLtHandle_t* out) {  // one handle per device, created on first use
  static std::mutex mu;
  static cublasLtHandle_t handles[64] = {};
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return MXF_ERR_UNSUPPORTED;
  std::lock_guard<std::mutex> lock(mu);
  if (!handles[dev]) LT_TRY(cublasLtCreate(&handles[dev]));
  *out = handles[dev];
  return 0;
}

cudaDataType_t lt_type(int dtype) {
  return dtype == MXF_F16 ? CUDA_R_16F : dtype == MXF_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

// The descriptors and chosen algorithm of one product shape, kept for the process (the
// heuristic query costs tens of microseconds of host time a call).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
};

int make_layout(cublasLtMatrixLayout_t* l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                int batch, int64_t stride) {
  LT_TRY(cublasLtMatrixLayoutCreate(l, t, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    LT_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
    LT_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                            sizeof(stride)));
  }
  return 0;
}

// Column-major D (m x n, ld ldc) = alpha op(A) op(B) + beta C (C = D), batched by strides.
struct Gemm {
  int in_dtype;             // A, B
  cudaDataType_t out_type;  // C / D
  bool ta, tb;
  int64_t m, n, k;
  const void* A; int64_t lda, sA;
  const void* B; int64_t ldb, sB;
  void* C; int64_t ldc, sC;
  int batch = 1;
  float beta = 0.f;
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;  // BIAS: input (m); BGRADB: output (n)
  int64_t bias_stride = 0;
};

// Largest power of two <= 256 dividing the address of every batch's matrix.
uint32_t alignment(const void* p, int64_t stride_bytes, int batch) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= static_cast<uintptr_t>(stride_bytes);
  uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a >>= 1;
  return a;
}

int plan_for(cublasLtHandle_t h, const Gemm& g, size_t ws_size, LtPlan** out) {
  static std::mutex mu;  // guards the map; plans are never freed
  static std::map<std::vector<int64_t>, LtPlan*> plans;
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  const int64_t es = static_cast<int64_t>(mxf_cuda::dtype_bytes(g.in_dtype));
  const int64_t os = g.out_type == CUDA_R_32F ? 4 : 2;
  const uint32_t al_a = alignment(g.A, g.sA * es, g.batch), al_b = alignment(g.B, g.sB * es, g.batch),
                 al_c = alignment(g.C, g.sC * os, g.batch);
  const std::vector<int64_t> key = {dev, g.in_dtype, static_cast<int64_t>(g.out_type), g.ta, g.tb, g.m, g.n, g.k,
                                    g.lda, g.sA, g.ldb, g.sB, g.ldc, g.sC, g.batch, g.beta != 0.f,
                                    static_cast<int64_t>(g.epi), g.bias_stride, static_cast<int64_t>(ws_size),
                                    al_a, al_b, al_c};
  std::lock_guard<std::mutex> lock(mu);
  auto it = plans.find(key);
  if (it != plans.end()) {
    *out = it->second;
    return 0;
  }
  LtPlan* p = new LtPlan();
  cublasLtMatmulPreference_t pref = nullptr;
  auto fail = [&](int rc) {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    delete p;
    return rc;
  };
#define PLAN_TRY(expr)                          \
  do {                                          \
    const int rc_ = (expr);                     \
    if (rc_ != 0) return fail(rc_);             \
  } while (0)
  PLAN_TRY(lt_status(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)));
  const cublasOperation_t ta = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  PLAN_TRY(lt_status(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))));
  PLAN_TRY(lt_status(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))));
  if (g.epi != CUBLASLT_EPILOGUE_DEFAULT) {
    PLAN_TRY(lt_status(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epi, sizeof(g.epi))));
    PLAN_TRY(lt_status(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias,
                                                      sizeof(g.bias))));
    if (g.batch > 1)
      PLAN_TRY(lt_status(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE,
                                                        &g.bias_stride, sizeof(g.bias_stride))));
  }
  const cudaDataType_t it_ = lt_type(g.in_dtype);
  PLAN_TRY(make_layout(&p->a, it_, g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda, g.batch, g.sA));
  PLAN_TRY(make_layout(&p->b, it_, g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb, g.batch, g.sB));
  PLAN_TRY(make_layout(&p->c, g.out_type, g.m, g.n, g.ldc, g.batch, g.sC));
  PLAN_TRY(lt_status(cublasLtMatmulPreferenceCreate(&pref)));
  PLAN_TRY(lt_status(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size,
                                                          sizeof(ws_size))));
  // the heuristic assumes 256-byte aligned matrices unless told otherwise
  PLAN_TRY(lt_status(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a,
                                                          sizeof(al_a))));
  PLAN_TRY(lt_status(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b,
                                                          sizeof(al_b))));
  PLAN_TRY(lt_status(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c,
                                                          sizeof(al_c))));
  PLAN_TRY(lt_status(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c,
                                                          sizeof(al_c))));
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  PLAN_TRY(lt_status(cublasLtMatmulAlgoGetHeuristic(h, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found)));
#undef PLAN_TRY
  cublasLtMatmulPreferenceDestroy(pref);
  p->found = found > 0;
  if (p->found) p->algo = res.algo;
  plans[key] = p;
  *out = p;
  return 0;
}

// Runs g; returns MXF_ERR_CUBLAS - CUBLAS_STATUS_NOT_SUPPORTED when cuBLASLt has no algorithm.
int run_gemm(const Gemm& g, void* ws, size_t ws_size, cudaStream_t stream) {
  static std::mutex run_mu;  // a plan's descriptor gets this call's bias pointer
  cublasLtHandle_t h;
  MXF_TRY(lt_handle(&h));
  LtPlan* p = nullptr;
  MXF_TRY(plan_for(h, g, ws_size, &p));
  if (!p->found) return MXF_ERR_CUBLAS - static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED);
  const float alpha = 1.f, beta = g.beta;
  std::lock_guard<std::mutex> lock(run_mu);
  if (g.epi != CUBLASLT_EPILOGUE_DEFAULT)
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  LT_TRY(cublasLtMatmul(h, p->op, &alpha, g.A, p->a, g.B, p->b, &beta, g.C, p->c, g.C, p->c, &p->algo, ws,
                        ws_size, stream));
  return 0;
}

bool dims_ok(int64_t M, int64_t N, int64_t K, int act, int64_t heads, int64_t S) {
  if (M < 0 || N < 0 || K < 0 || act < MXF_ACT_NONE || act > MXF_ACT_ACT_RELU) return false;
  if (heads < 0 || (heads > 0 && (N % heads != 0 || S <= 0 || M % S != 0))) return false;
  // cuBLASLt takes 32-bit-friendly leading dimensions; batch counts are int
  return M < (int64_t{1} << 31) && N < (int64_t{1} << 31) && K < (int64_t{1} << 31);
}

int grid_for(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return static_cast<int>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

// y (row-major (M, N), or heads layout) = x W^T (+ bias) on cuBLASLt.
int forward_product(int dtype, const void* x, const void* w, const void* bias, void* y, int64_t M,
                    int64_t N, int64_t K, int64_t heads, int64_t S, void* ws, size_t ws_size,
                    cudaStream_t st) {
  const size_t es = mxf_cuda::dtype_bytes(dtype);
  Gemm g{};
  g.in_dtype = dtype;
  g.out_type = lt_type(dtype);
  g.ta = true;
  g.tb = false;
  g.k = K;
  g.lda = K;
  g.ldb = K;
  g.epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;  // bias: 16-byte aligned per batch
  if (heads <= 0) {  // D^T (N x M, ld N) = W (K x N)^T x^T (K x M)
    g.m = N; g.n = M; g.A = w; g.B = x; g.C = y; g.ldc = N; g.bias = bias;
    g.sA = g.sB = g.sC = 0;
    return run_gemm(g, ws, ws_size, st);
  }
  const int64_t B = M / S, D = N / heads;
  g.m = D; g.n = S; g.ldc = D;
  const char* xc = static_cast<const char*>(x);
  const char* wc = static_cast<const char*>(w);
  const char* bc = static_cast<const char*>(bias);
  char* yc = static_cast<char*>(y);
  if (B <= heads) {  // per batch b: heads batches of (D x S) = W_h^T x_b
    g.batch = static_cast<int>(heads);
    g.sA = D * K; g.sB = 0; g.sC = S * D; g.bias_stride = D;
    for (int64_t b = 0; b < B; ++b) {
      g.A = wc; g.B = xc + b * S * K * es; g.C = yc + b * heads * S * D * es; g.bias = bias;
      MXF_TRY(run_gemm(g, ws, ws_size, st));
    }
  } else {  // per head h: B batches
    g.batch = static_cast<int>(B);
    g.sA = 0; g.sB = S * K; g.sC = heads * S * D; g.bias_stride = 0;
    for (int64_t h = 0; h < heads; ++h) {
      g.A = wc + h * D * K * es; g.B = xc; g.C = yc + h * S * D * es;
      g.bias = bias ? bc + h * D * es : nullptr;
      MXF_TRY(run_gemm(g, ws, ws_size, st));
    }
  }
  return 0;
}

template <typename T>
int launch_act(void* y, int64_t n, int act, float slope, cudaStream_t st) {
  if (mxf_cuda::aligned16(y))
    act_inplace_kernel<T, true><<<grid_for(n / mxf_cuda::Vec<T>::N + 1, 256), 256, 0, st>>>(
        static_cast<T*>(y), n, act, slope);
  else
    act_inplace_kernel<T, false><<<grid_for(n, 256), 256, 0, st>>>(static_cast<T*>(y), n, act, slope);
  MXF_CUDA_RETURN_LAST();
}

}  // namespace

extern "C" size_t mxf_cublaslt_version(void) { return cublasLtGetVersion(); }

extern "C" size_t mxf_dense_forward_workspace_size(int, int64_t, int64_t, int64_t, int, int64_t) {
  return kLtWorkspace;
}

extern "C" int mxf_dense_forward(int dtype, const void* x, const void* w, const void* bias, void* y,
                                 int64_t M, int64_t N, int64_t K, int act, float slope, int64_t heads,
                                 int64_t S, void* workspace, size_t workspace_size, void* stream) {
  if (mxf_cuda::dtype_bytes(dtype) == 0 || !dims_ok(M, N, K, act, heads, S)) return MXF_ERR_BAD_ARGS;
  if (M == 0 || N == 0) return 0;
  if (!workspace || workspace_size < kLtWorkspace) return MXF_ERR_WORKSPACE;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (K == 0)  // no product: y = act(bias or 0)
    return mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      fill_bias_kernel<T><<<grid_for(M * N, 256), 256, 0, st>>>(static_cast<const T*>(bias),
                                                                 static_cast<T*>(y), M, N, act, slope, heads, S);
      MXF_CUDA_RETURN_LAST();
    });
  // the epilogue's bias pointers (one per head slice in the head-split layout) must be 16-byte aligned
  const size_t es = mxf_cuda::dtype_bytes(dtype);
  const bool epi_bias = bias && mxf_cuda::aligned16(bias) && (heads <= 0 || (N / heads) * es % 16 == 0);
  MXF_TRY(forward_product(dtype, x, w, epi_bias ? bias : nullptr, y, M, N, K, heads, S, workspace,
                          workspace_size, st));
  if (bias && !epi_bias)
    return mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      bias_act_kernel<T><<<grid_for(M * N, 256), 256, 0, st>>>(static_cast<T*>(y), static_cast<const T*>(bias), M,
                                                                N, act, slope, heads, S);
      MXF_CUDA_RETURN_LAST();
    });
  if (act == MXF_ACT_NONE) return 0;
  return mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
    return launch_act<decltype(t)>(y, M * N, act, slope, st);
  });
}

namespace {
struct BwdPlan {
  bool need_dz, need_z;
  size_t dz_off, z_off, acc_off, total;
};
BwdPlan bwd_plan(int dtype, int64_t M, int64_t N, int act, int64_t heads) {
  BwdPlan p{};
  p.need_dz = act != MXF_ACT_NONE || heads > 0;
  p.need_z = act == MXF_ACT_GELU_ERF || act == MXF_ACT_GELU_TANH;
  size_t off = mxf_cuda::align256(kLtWorkspace);
  p.dz_off = off;
  if (p.need_dz) off += mxf_cuda::align256(static_cast<size_t>(M * N) * mxf_cuda::dtype_bytes(dtype));
  p.z_off = off;
  if (p.need_z) off += mxf_cuda::align256(static_cast<size_t>(M * N) * sizeof(float));
  p.acc_off = off;
  off += mxf_cuda::align256(static_cast<size_t>(N) * sizeof(float));
  p.total = off;
  return p;
}
}  // namespace

extern "C" size_t mxf_dense_backward_workspace_size(int dtype, int64_t M, int64_t N, int64_t,
                                                    int act, int64_t heads) {
  return bwd_plan(dtype, M, N, act, heads).total;
}

extern "C" int mxf_dense_backward(int dtype, const void* dy, const void* x, const void* w,
                                  const void* bias, const void* y, void* dx, void* dw, void* dbias,
                                  int req_dx, int req_dw, int req_dbias, int64_t M, int64_t N,
                                  int64_t K, int act, float slope, int64_t heads, int64_t S,
                                  void* workspace, size_t workspace_size, void* stream) {
  if (mxf_cuda::dtype_bytes(dtype) == 0 || !dims_ok(M, N, K, act, heads, S)) return MXF_ERR_BAD_ARGS;
  if (!mxf_cuda::req_ok(req_dx) || !mxf_cuda::req_ok(req_dw) || !mxf_cuda::req_ok(req_dbias))
    return MXF_ERR_BAD_ARGS;
  const BwdPlan plan = bwd_plan(dtype, M, N, act, heads);
  if (!workspace || workspace_size < plan.total) return MXF_ERR_WORKSPACE;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  char* ws = static_cast<char*>(workspace);
  const size_t es = mxf_cuda::dtype_bytes(dtype);
  if (M == 0 || N == 0) {  // dz is empty: the gradients are zeros (untouched when added to)
    if (req_dx == MXF_REQ_WRITE || req_dx == MXF_REQ_INPLACE) MXF_CUDA_TRY(cudaMemsetAsync(dx, 0, M * K * es, st));
    if (req_dw == MXF_REQ_WRITE || req_dw == MXF_REQ_INPLACE) MXF_CUDA_TRY(cudaMemsetAsync(dw, 0, N * K * es, st));
    if (req_dbias == MXF_REQ_WRITE || req_dbias == MXF_REQ_INPLACE) MXF_CUDA_TRY(cudaMemsetAsync(dbias, 0, N * es, st));
    return 0;
  }
  const void* dz = dy;
  if (plan.need_dz) {
    float* z = plan.need_z ? reinterpret_cast<float*>(ws + plan.z_off) : nullptr;
    if (z) {  // z^T (N x M) = W^T x^T in float32, the bias added by dz_kernel
      if (K == 0) {
        MXF_CUDA_TRY(cudaMemsetAsync(z, 0, M * N * sizeof(float), st));
      } else {
        Gemm g{};
        g.in_dtype = dtype; g.out_type = CUDA_R_32F; g.ta = true; g.tb = false;
        g.m = N; g.n = M; g.k = K; g.A = w; g.lda = K; g.B = x; g.ldb = K; g.C = z; g.ldc = N;
        MXF_TRY(run_gemm(g, ws, kLtWorkspace, st));
      }
    }
    void* dzp = ws + plan.dz_off;
    MXF_TRY(mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      dz_kernel<T><<<grid_for(M * N, 256), 256, 0, st>>>(
          static_cast<const T*>(dy), static_cast<const T*>(y), z, static_cast<const T*>(bias),
          static_cast<T*>(dzp), M, N, act, slope, heads, S);
      MXF_CUDA_RETURN_LAST();
    }));
    dz = dzp;
  }
  if (req_dx != MXF_REQ_NULL && K > 0) {  // dx^T (K x M) = W (K x N) dz^T (N x M)
    Gemm g{};
    g.in_dtype = dtype; g.out_type = lt_type(dtype); g.ta = false; g.tb = false;
    g.m = K; g.n = M; g.k = N; g.A = w; g.lda = K; g.B = dz; g.ldb = N; g.C = dx; g.ldc = K;
    g.beta = req_dx == MXF_REQ_ADD ? 1.f : 0.f;
    MXF_TRY(run_gemm(g, ws, kLtWorkspace, st));
  }
  bool dbias_done = req_dbias == MXF_REQ_NULL;
  if (req_dw != MXF_REQ_NULL && K > 0) {  // dW^T (K x N) = x^T (K x M) dz (M x N)
    Gemm g{};
    g.in_dtype = dtype; g.out_type = lt_type(dtype); g.ta = false; g.tb = true;
    g.m = K; g.n = N; g.k = M; g.A = x; g.lda = K; g.B = dz; g.ldb = N; g.C = dw; g.ldc = K;
    g.beta = req_dw == MXF_REQ_ADD ? 1.f : 0.f;
    int rc = -1;
    if (!dbias_done && req_dbias != MXF_REQ_ADD && mxf_cuda::aligned16(dbias)) {  // dbias from the same product
      g.epi = CUBLASLT_EPILOGUE_BGRADB;
      g.bias = dbias;
      rc = run_gemm(g, ws, kLtWorkspace, st);
      if (rc == 0) dbias_done = true;
      else if (rc != MXF_ERR_CUBLAS - static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED)) return rc;
    }
    if (rc != 0) {
      g.epi = CUBLASLT_EPILOGUE_DEFAULT;
      g.bias = nullptr;
      MXF_TRY(run_gemm(g, ws, kLtWorkspace, st));
    }
  }
  if (!dbias_done) {  // column sums of dz, two stages
    float* acc = reinterpret_cast<float*>(ws + plan.acc_off);
    MXF_CUDA_TRY(cudaMemsetAsync(acc, 0, N * sizeof(float), st));
    const int64_t rows = 256;
    dim3 grid(static_cast<unsigned>((N + 31) / 32), static_cast<unsigned>((M + rows - 1) / rows));
    MXF_TRY(mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      if (M > 0) colsum_kernel<T><<<grid, 256, 0, st>>>(static_cast<const T*>(dz), acc, M, N, rows);
      finish_kernel<T><<<static_cast<unsigned>((N + 255) / 256), 256, 0, st>>>(acc, static_cast<T*>(dbias), N, req_dbias);
      MXF_CUDA_RETURN_LAST();
    }));
  }
  return 0;
}
#endif  // __has_include(<cublasLt.h>)
