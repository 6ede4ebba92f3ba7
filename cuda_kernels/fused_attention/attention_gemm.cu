// fp32 fused_attention on cuBLASLt, forward and backward.  Forward: S = scale Q K^T as strided-batched products (fp32,
// no TF32 unless the call allows it: the op's precision="tf32"), one masked-softmax kernel over the
// S x S scores in place (every mask kind and causal mode, the op's semantics for empty and
// non-finite rows, the log-sum-exp), then O = P V.  This is the unfused graph's own arithmetic
// (batch_dot -> softmax -> batch_dot) in three kernels without its copies, so it is never slower
// than that graph, where the SIMT flash kernel was 5-16x slower (fp32 has no tensor cores without
// TF32).  The scores take N_chunk * Sq * Sk floats of workspace: heads are processed in chunks
// that keep it under MXFUSION_ATTN_GEMM_WS_MB (default 1024 MiB).  Layouts whose heads cannot be
// addressed with one batch stride (bshd, packed, interleaved: rows of all heads interleaved) are
// first gathered into contiguous (B*H, S, D) copies in the workspace.
// Backward (two S x S buffers a chunk): P recomputed (products + softmax), dP = dO V^T, the
// softmax's backward dS = P (dP - rowsum(P dP)) over the keys each row sees (the unfused softmax's
// own arithmetic), dV = P^T dO, dQ = scale dS K, dK = scale dS^T Q (beta 1 for req ADD), and an
// additive mask's gradient dS summed where the mask broadcasts.
//
// Exact semantics fall out of the unfused products: a key a row skips has probability 0, and the
// P V product makes 0 * inf = NaN where its v is not finite, as the unfused graph does; a row whose
// scores hold a NaN or +inf, or are all -inf, gets every probability NaN (a NaN output row); a row
// with no visible key gets probabilities 0 (an output of 0).
// Compiled, not yet run on a GPU.
#include "attention_backends.h"
#include "cuda_common.cuh"

#include <cstdlib>
#include <string>

namespace {

// One block per score row (n, i): scale already applied by the product.
__global__ void __launch_bounds__(256) masked_softmax_kernel(const mxf_attention_args a, float* __restrict__ S,
                                                             int64_t n0, int64_t rows) {
  __shared__ float red[32];
  __shared__ int s_bad;
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  const int64_t n = n0 + r / a.Sq, i = r % a.Sq, b = n / a.H, h = n % a.H;
  float* s = S + r * a.Sk;
  const float* M = static_cast<const float*>(a.mask);
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;
  int64_t L = a.Sk;
  if (a.mask_kind == MXF_MASK_VALID_LENGTH) {
    const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
    L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
  }
  int64_t band = L;
  if (a.causal != MXF_CAUSAL_NONE) {
    const int64_t c = i + (a.Sk - a.Sq) + 1;
    band = c < L ? (c < 0 ? 0 : c) : L;
  }
  const int64_t lim = transform ? L : band;  // keys the row sees
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  // pass 1: the masked scores, their max, NaN / +inf
  float mx = -INFINITY;
  bool bad = false;
  const float* mrow = M ? M + b * a.m_sb + h * a.m_sh + i * a.m_sq : nullptr;
  for (int64_t j = threadIdx.x; j < lim; j += blockDim.x) {
    float x = s[j];
    if (a.mask_kind == MXF_MASK_ADDITIVE) x += mrow[j * a.m_sk];
    else if (a.mask_kind == MXF_MASK_BOOLEAN && mrow[j * a.m_sk] == 0.f) x = a.mask_value;
    if (transform && j >= band) x = a.causal == MXF_CAUSAL_ADD ? x + a.mask_value : a.mask_value;
    s[j] = x;
    bad |= isnan(x) || x == INFINITY;
    mx = fmaxf(mx, x);
  }
  if (bad) s_bad = 1;
  mx = mxf_cuda::warp_max(mx);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  mx = lane < nw ? red[lane] : -INFINITY;
  mx = mxf_cuda::warp_max(mx);
  const bool nan_row = s_bad || (lim > 0 && mx == -INFINITY);
  __syncthreads();  // red is reused
  if (nan_row || lim == 0) {  // NaN at every key the row sees (MXNet's GPU softmax), 0 after them
    for (int64_t j = threadIdx.x; j < a.Sk; j += blockDim.x) s[j] = j < lim ? nanf("") : 0.f;
    if (a.lse && threadIdx.x == 0) a.lse[n * a.Sq + i] = nan_row ? nanf("") : INFINITY;
    return;
  }
  // pass 2: the sum; pass 3: the probabilities (keys after lim: 0)
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < lim; j += blockDim.x) sum += expf(s[j] - mx);
  sum = mxf_cuda::block_sum(sum, red);
  for (int64_t j = threadIdx.x; j < a.Sk; j += blockDim.x) s[j] = j < lim ? expf(s[j] - mx) / sum : 0.f;
  if (a.lse && threadIdx.x == 0) a.lse[n * a.Sq + i] = mx + logf(sum);
}

// dst (N, S, C) contiguous <-> the (B, H, S, C) view at src with strides bs, hs, rs
__global__ void gather_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t B, int64_t H,
                              int64_t S, int64_t C, int64_t bs, int64_t hs, int64_t rs, bool scatter) {
  const int64_t total = B * H * S * C;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % C, r = (e / C) % S, n = e / (C * S), b = n / H, h = n % H;
    const int64_t off = b * bs + h * hs + r * rs + c;
    if (scatter) const_cast<float*>(src)[off] = dst[e];
    else dst[e] = src[off];
  }
}

// Backward, one block per score row: P (recomputed, in P) and dP = dO V^T (in G) -> the scores'
// gradient in G, as the unfused softmax's backward computes it: dS_j = P_j (dP_j - sum_k P_k dP_k)
// over the keys the row sees, 0 after them; where a boolean mask or a `fill` band replaced the
// score, nothing reaches q k^T (the additive mask, its own gradient, gets dS there too).
__global__ void __launch_bounds__(256) softmax_grad_kernel(const mxf_attention_args a, const float* __restrict__ P,
                                                           float* __restrict__ G, int64_t n0, int64_t rows) {
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  if (r >= rows) return;
  const int64_t n = n0 + r / a.Sq, i = r % a.Sq, b = n / a.H, h = n % a.H;
  const float* p = P + r * a.Sk;
  float* g = G + r * a.Sk;
  const float* M = static_cast<const float*>(a.mask);
  const float* mrow = M ? M + b * a.m_sb + h * a.m_sh + i * a.m_sq : nullptr;
  const bool transform = a.causal == MXF_CAUSAL_ADD || a.causal == MXF_CAUSAL_FILL;
  int64_t L = a.Sk;
  if (a.mask_kind == MXF_MASK_VALID_LENGTH) {
    const int64_t len = a.lengths[n * a.len_sn + i * a.len_sq];
    L = len < 0 ? 0 : (len > a.Sk ? a.Sk : len);
  }
  int64_t band = L;
  if (a.causal != MXF_CAUSAL_NONE) {
    const int64_t c = i + (a.Sk - a.Sq) + 1;
    band = c < L ? (c < 0 ? 0 : c) : L;
  }
  const int64_t lim = transform ? L : band;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < lim; j += blockDim.x) dot += p[j] * g[j];
  dot = mxf_cuda::block_sum(dot, red);
  for (int64_t j = threadIdx.x; j < a.Sk; j += blockDim.x) {
    float ds = 0.f;
    if (j < lim) {
      ds = p[j] * (g[j] - dot);
      const bool replaced = (a.mask_kind == MXF_MASK_BOOLEAN && mrow[j * a.m_sk] == 0.f) ||
                            (a.causal == MXF_CAUSAL_FILL && j >= band);
      if (replaced) ds = 0.f;
    }
    g[j] = ds;
  }
}

// The additive mask's gradient: dS summed where the mask broadcasts, into acc (float32, the mask's
// elements).  m_sq == 0 (one mask row for all query rows): a thread per key sums the head's rows.
__global__ void dmask_accum_kernel(const mxf_attention_args a, const float* __restrict__ G, float* __restrict__ acc,
                                   int64_t n0, int64_t cn) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nl = blockIdx.y, n = n0 + nl, b = n / a.H, h = n % a.H;
  if (j >= a.Sk || nl >= cn) return;
  const float* g = G + nl * a.Sq * a.Sk + j;
  const int64_t base = b * a.m_sb + h * a.m_sh + j * a.m_sk;
  if (a.m_sq == 0) {
    float t = 0.f;
    for (int64_t i = 0; i < a.Sq; ++i) t += g[i * a.Sk];
    atomicAdd(acc + base, t);
  } else {
    for (int64_t i = 0; i < a.Sq; ++i) atomicAdd(acc + base + i * a.m_sq, g[i * a.Sk]);
  }
}

__global__ void finish_kernel(const float* __restrict__ acc, float* __restrict__ out, int64_t n, int req) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[e] = req == MXF_REQ_ADD ? out[e] + acc[e] : acc[e];
}

// the (B, H, S, C) view at dst (+)= the contiguous (N, S, C) src
__global__ void scatter_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t B, int64_t H,
                               int64_t S, int64_t C, int64_t bs, int64_t hs, int64_t rs, bool add) {
  const int64_t total = B * H * S * C;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % C, r = (e / C) % S, n = e / (C * S), b = n / H, h = n % H;
    float* d = dst + b * bs + h * hs + r * rs + c;
    *d = add ? *d + src[e] : src[e];
  }
}

unsigned blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

// The head batch stride of a view, or -1 when its heads are not equally spaced.
int64_t head_stride(int64_t B, int64_t H, int64_t bs, int64_t hs) {
  if (H == 1) return bs;
  if (B == 1 || bs == H * hs) return hs;
  return -1;
}

size_t ws_cap() {
  static const size_t cap = [] {
    const char* e = std::getenv("MXFUSION_ATTN_GEMM_WS_MB");
    const long mb = e ? std::atol(e) : 1024;
    return static_cast<size_t>(mb > 16 ? mb : 16) << 20;
  }();
  return cap;
}

struct Layout {
  int64_t heads_per_chunk, q_st, k_st, v_st, o_st;  // -1: gathered
  size_t scores, pack_q, pack_k, pack_v, pack_o, lt, total;
};

Layout layout(const mxf_attention_args* a) {
  using mxf_cuda::align256;
  Layout L{};
  const int64_t N = a->B * a->H;
  const size_t row = static_cast<size_t>(a->Sq) * a->Sk * sizeof(float);
  const size_t fit = ws_cap() / (row ? row : 1);
  L.heads_per_chunk = static_cast<int64_t>(fit < 1 ? 1 : (fit > static_cast<size_t>(N) ? N : fit));
  L.q_st = head_stride(a->B, a->H, a->q_bs, a->q_hs);
  L.k_st = head_stride(a->B, a->H, a->k_bs, a->k_hs);
  L.v_st = head_stride(a->B, a->H, a->v_bs, a->v_hs);
  L.o_st = head_stride(a->B, a->H, a->o_bs, a->o_hs);
  size_t off = 0;
  L.scores = off; off += align256(row * L.heads_per_chunk);
  L.pack_q = off; if (L.q_st < 0) off += align256(static_cast<size_t>(N) * a->Sq * a->D * 4);
  L.pack_k = off; if (L.k_st < 0) off += align256(static_cast<size_t>(N) * a->Sk * a->D * 4);
  L.pack_v = off; if (L.v_st < 0) off += align256(static_cast<size_t>(N) * a->Sk * a->Dv * 4);
  L.pack_o = off; if (L.o_st < 0) off += align256(static_cast<size_t>(N) * a->Sq * a->Dv * 4);
  L.lt = off; off += 4u << 20;  // cuBLASLt's own workspace
  L.total = off;
  return L;
}

}  // namespace

#if !__has_include(<cublasLt.h>)
namespace mxf_attn {
bool gemm_expressible(const mxf_attention_args*, bool, std::string* why) {
  if (why) *why = "this build has no cuBLASLt (its headers were not found when it was compiled)";
  return false;
}
size_t gemm_forward_ws(const mxf_attention_args*) { return 0; }
int gemm_forward(const mxf_attention_args*, void*, size_t, cudaStream_t) { return MXF_ERR_UNSUPPORTED; }
size_t gemm_backward_ws(const mxf_attention_args*, const mxf_attention_grads*) { return 0; }
int gemm_backward(const mxf_attention_args*, const mxf_attention_grads*, void*, size_t, cudaStream_t) {
  return MXF_ERR_UNSUPPORTED;
}
}  // namespace mxf_attn
#else
#include <cublasLt.h>

#include <map>
#include <mutex>
#include <vector>

namespace {

int lt(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS ? 0 : MXF_ERR_CUBLAS - static_cast<int>(s); }

int handle(cublasLtHandle_t* out) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> hs;
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = hs.find(dev);
  if (it == hs.end()) {
    cublasLtHandle_t h = nullptr;
    MXF_TRY(lt(cublasLtCreate(&h)));
    it = hs.emplace(dev, h).first;
  }
  *out = it->second;
  return 0;
}

// Column-major C (m x n, ldc) = alpha op(A) op(B), fp32, `batch` products by strides.
struct Prod {
  bool ta;
  int64_t m, n, k;
  const float* A; int64_t lda, sA;
  const float* B; int64_t ldb, sB;
  float* C; int64_t ldc, sC;
  int64_t batch;
  float alpha;
  bool tf32;
  bool tb = false;    // op(B) = B^T
  float beta = 0.f;   // C = alpha op(A) op(B) + beta C (req ADD: 1)
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
};

int layout_of(cublasLtMatrixLayout_t* l, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
  MXF_TRY(lt(cublasLtMatrixLayoutCreate(l, CUDA_R_32F, rows, cols, ld)));
  const int32_t bc = static_cast<int32_t>(batch);
  MXF_TRY(lt(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc, sizeof(bc))));
  MXF_TRY(lt(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                              sizeof(stride))));
  return 0;
}

uint32_t align_of(const void* p, int64_t stride_elems) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(stride_elems * 4);
  uint32_t al = 256;
  while (al > 4 && v % al) al >>= 1;
  return al;
}

int run(const Prod& g, void* ws, size_t ws_size, cudaStream_t st) {
  static std::mutex mu;
  static std::map<std::vector<int64_t>, Plan*> plans;
  cublasLtHandle_t h;
  MXF_TRY(handle(&h));
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  const uint32_t aa = align_of(g.A, g.sA), ab = align_of(g.B, g.sB), ac = align_of(g.C, g.sC);
  const std::vector<int64_t> key = {dev, g.ta, g.tb, g.m, g.n, g.k, g.lda, g.sA, g.ldb, g.sB, g.ldc, g.sC,
                                    g.batch, g.tf32, aa, ab, ac, static_cast<int64_t>(ws_size)};
  Plan* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = plans.find(key);
    if (it != plans.end()) p = it->second;
  }
  if (!p) {
    p = new Plan();
    const cublasComputeType_t ct = g.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    MXF_TRY(lt(cublasLtMatmulDescCreate(&p->op, ct, CUDA_R_32F)));
    const cublasOperation_t ta = g.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    MXF_TRY(lt(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta))));
    MXF_TRY(lt(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb))));
    MXF_TRY(layout_of(&p->a, g.ta ? g.k : g.m, g.ta ? g.m : g.k, g.lda, g.batch, g.sA));
    MXF_TRY(layout_of(&p->b, g.tb ? g.n : g.k, g.tb ? g.k : g.n, g.ldb, g.batch, g.sB));
    MXF_TRY(layout_of(&p->c, g.m, g.n, g.ldc, g.batch, g.sC));
    cublasLtMatmulPreference_t pref = nullptr;
    MXF_TRY(lt(cublasLtMatmulPreferenceCreate(&pref)));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_size, sizeof(ws_size));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    const int rc = lt(cublasLtMatmulAlgoGetHeuristic(h, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found));
    cublasLtMatmulPreferenceDestroy(pref);
    MXF_TRY(rc);
    p->found = found > 0;
    if (p->found) p->algo = res.algo;
    std::lock_guard<std::mutex> lock(mu);
    auto ins = plans.emplace(key, p);
    if (!ins.second) p = ins.first->second;  // another thread's plan (this one is leaked, once)
  }
  if (!p->found) return MXF_ERR_CUBLAS - static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED);
  return lt(cublasLtMatmul(h, p->op, &g.alpha, g.A, p->a, g.B, p->b, &g.beta, g.C, p->c, g.C, p->c, &p->algo, ws,
                           ws_size, st));
}

}  // namespace

namespace mxf_attn {

bool gemm_expressible(const mxf_attention_args* a, bool backward, std::string* why) {
  auto no = [&](const char* r) {
    if (why) *why = r;
    return false;
  };
  if (a->dtype != MXF_F32) return no("fp32 only");
  if (a->Sq < 1 || a->Sk < 1 || a->B * a->H < 1) return no("an empty tensor");
  const int64_t big = int64_t{1} << 31;
  if (a->Sk >= big || a->Sq >= big || a->q_rs >= big || a->k_rs >= big || a->v_rs >= big || a->o_rs >= big)
    return no("a dimension or row stride beyond 32 bits");
  return true;
}

size_t gemm_forward_ws(const mxf_attention_args* a) { return layout(a).total; }

int gemm_forward(const mxf_attention_args* a, void* ws, size_t ws_size, cudaStream_t st) {
  const Layout L = layout(a);
  if (!ws || ws_size < L.total) return MXF_ERR_WORKSPACE;
  char* w = static_cast<char*>(ws);
  const int64_t N = a->B * a->H;
  // heads equally spaced (one batch stride), else gathered into (N, S, C) copies
  auto view = [&](const void* p, int64_t st_, size_t off, int64_t S, int64_t C, int64_t bs, int64_t hs, int64_t rs,
                  const float** base, int64_t* stride, int64_t* ld) {
    if (st_ >= 0) {
      *base = static_cast<const float*>(p);
      *stride = st_;
      *ld = rs;
      return;
    }
    float* dst = reinterpret_cast<float*>(w + off);
    gather_kernel<<<blocks(N * S * C), 256, 0, st>>>(static_cast<const float*>(p), dst, a->B, a->H, S, C, bs, hs,
                                                     rs, false);
    *base = dst;
    *stride = S * C;
    *ld = C;
  };
  const float *Q, *K, *V;
  int64_t qs, ks, vs, os, ldq, ldk, ldv, ldo;
  view(a->q, L.q_st, L.pack_q, a->Sq, a->D, a->q_bs, a->q_hs, a->q_rs, &Q, &qs, &ldq);
  view(a->k, L.k_st, L.pack_k, a->Sk, a->D, a->k_bs, a->k_hs, a->k_rs, &K, &ks, &ldk);
  view(a->v, L.v_st, L.pack_v, a->Sk, a->Dv, a->v_bs, a->v_hs, a->v_rs, &V, &vs, &ldv);
  MXF_CUDA_TRY(cudaGetLastError());
  float* Out;
  if (L.o_st >= 0) {
    Out = static_cast<float*>(a->o);
    os = L.o_st;
    ldo = a->o_rs;
  } else {
    Out = reinterpret_cast<float*>(w + L.pack_o);
    os = a->Sq * a->Dv;
    ldo = a->Dv;
  }
  float* S = reinterpret_cast<float*>(w + L.scores);
  void* ltws = w + L.lt;
  const size_t ltsz = ws_size - L.lt;
  for (int64_t n0 = 0; n0 < N; n0 += L.heads_per_chunk) {
    const int64_t cn = N - n0 < L.heads_per_chunk ? N - n0 : L.heads_per_chunk;
    // S^T (Sk x Sq column-major) = scale * K Q^T: A = K^T (D x Sk, ld ldk), B = Q^T (D x Sq, ld ldq)
    Prod s1{true, a->Sk, a->Sq, a->D, K + n0 * ks, ldk, ks, Q + n0 * qs, ldq, qs, S, a->Sk, a->Sq * a->Sk, cn,
            a->scale, a->allow_tf32 != 0};
    MXF_TRY(run(s1, ltws, ltsz, st));
    masked_softmax_kernel<<<static_cast<unsigned>(cn * a->Sq), 256, 0, st>>>(*a, S, n0, cn * a->Sq);
    MXF_CUDA_TRY(cudaGetLastError());
    // O^T (Dv x Sq) = V^T (Dv x Sk, ld ldv) P^T (Sk x Sq, ld Sk)
    Prod s2{false, a->Dv, a->Sq, a->Sk, V + n0 * vs, ldv, vs, S, a->Sk, a->Sq * a->Sk, Out + n0 * os, ldo, os, cn,
            1.f, a->allow_tf32 != 0};
    MXF_TRY(run(s2, ltws, ltsz, st));
  }
  if (L.o_st < 0) {
    gather_kernel<<<blocks(N * a->Sq * a->Dv), 256, 0, st>>>(static_cast<const float*>(a->o), Out, a->B, a->H, a->Sq,
                                                             a->Dv, a->o_bs, a->o_hs, a->o_rs, true);
  }
  MXF_CUDA_RETURN_LAST();
}

}  // namespace mxf_attn

// ---- backward ----------------------------------------------------------------------------------
namespace {

struct BwdLayout {
  int64_t heads_per_chunk, q_st, k_st, v_st, o_st;
  size_t P, G, q, k, v, o, gq, gk, gv, dm, lt, total;
};

bool wanted(int req) { return req != MXF_REQ_NULL; }

BwdLayout bwd_layout(const mxf_attention_args* a, const mxf_attention_grads* g) {
  using mxf_cuda::align256;
  BwdLayout L{};
  const int64_t N = a->B * a->H;
  const size_t row = static_cast<size_t>(a->Sq) * a->Sk * sizeof(float);
  const size_t fit = ws_cap() / (2 * (row ? row : 1));
  L.heads_per_chunk = static_cast<int64_t>(fit < 1 ? 1 : (fit > static_cast<size_t>(N) ? N : fit));
  L.q_st = head_stride(a->B, a->H, a->q_bs, a->q_hs);
  L.k_st = head_stride(a->B, a->H, a->k_bs, a->k_hs);
  L.v_st = head_stride(a->B, a->H, a->v_bs, a->v_hs);
  L.o_st = head_stride(a->B, a->H, a->o_bs, a->o_hs);
  const size_t nq = static_cast<size_t>(N) * a->Sq, nk = static_cast<size_t>(N) * a->Sk;
  size_t off = 0;
  L.P = off; off += align256(row * L.heads_per_chunk);
  L.G = off; off += align256(row * L.heads_per_chunk);
  // gathered inputs (heads not one batch stride apart), and the gradients of such tensors
  L.q = off; if (L.q_st < 0) off += 2 * align256(nq * a->D * 4);   // q, then dq
  L.k = off; if (L.k_st < 0) off += 2 * align256(nk * a->D * 4);   // k, then dk
  L.v = off; if (L.v_st < 0) off += 2 * align256(nk * a->Dv * 4);  // v, then dv
  L.o = off; if (L.o_st < 0) off += align256(nq * a->Dv * 4);      // dO
  L.gq = L.q + align256(nq * a->D * 4);
  L.gk = L.k + align256(nk * a->D * 4);
  L.gv = L.v + align256(nk * a->Dv * 4);
  L.dm = off;
  if (g && g->dmask && wanted(g->req_dmask) && a->mask_kind == MXF_MASK_ADDITIVE)
    off += align256(static_cast<size_t>(g->dmask_numel) * 4);
  L.lt = off; off += 4u << 20;
  L.total = off;
  return L;
}

}  // namespace

namespace mxf_attn {

size_t gemm_backward_ws(const mxf_attention_args* a, const mxf_attention_grads* g) { return bwd_layout(a, g).total; }

int gemm_backward(const mxf_attention_args* a, const mxf_attention_grads* g, void* ws, size_t ws_size,
                  cudaStream_t st) {
  const BwdLayout L = bwd_layout(a, g);
  if (!ws || ws_size < L.total) return MXF_ERR_WORKSPACE;
  for (int r : {g->req_dq, g->req_dk, g->req_dv, g->req_dmask})
    if (r < MXF_REQ_NULL || r > MXF_REQ_ADD) return MXF_ERR_BAD_ARGS;
  char* w = static_cast<char*>(ws);
  const int64_t N = a->B * a->H;
  struct V { const float* p; int64_t st, ld; };
  auto in = [&](const void* p, int64_t hst, size_t off, int64_t S, int64_t C, int64_t bs, int64_t hs, int64_t rs) {
    if (hst >= 0) return V{static_cast<const float*>(p), hst, rs};
    float* dst = reinterpret_cast<float*>(w + off);
    gather_kernel<<<blocks(N * S * C), 256, 0, st>>>(static_cast<const float*>(p), dst, a->B, a->H, S, C, bs, hs, rs,
                                                     false);
    return V{dst, S * C, C};
  };
  const V Q = in(a->q, L.q_st, L.q, a->Sq, a->D, a->q_bs, a->q_hs, a->q_rs);
  const V K = in(a->k, L.k_st, L.k, a->Sk, a->D, a->k_bs, a->k_hs, a->k_rs);
  const V Vv = in(a->v, L.v_st, L.v, a->Sk, a->Dv, a->v_bs, a->v_hs, a->v_rs);
  const V dO = in(g->dout, L.o_st, L.o, a->Sq, a->Dv, a->o_bs, a->o_hs, a->o_rs);
  MXF_CUDA_TRY(cudaGetLastError());
  // gradient destinations: in place (beta 1 for req ADD) or contiguous scratch scattered after
  struct Out { float* p; int64_t st, ld; float beta; bool scatter; };
  auto out = [&](void* p, int req, int64_t hst, size_t off, int64_t S, int64_t C, int64_t rs) {
    if (hst >= 0) return Out{static_cast<float*>(p), hst, rs, req == MXF_REQ_ADD ? 1.f : 0.f, false};
    return Out{reinterpret_cast<float*>(w + off), S * C, C, 0.f, true};
  };
  const Out dQ = out(g->dq, g->req_dq, L.q_st, L.gq, a->Sq, a->D, a->q_rs);
  const Out dK = out(g->dk, g->req_dk, L.k_st, L.gk, a->Sk, a->D, a->k_rs);
  const Out dV = out(g->dv, g->req_dv, L.v_st, L.gv, a->Sk, a->Dv, a->v_rs);
  float* dm = L.lt > L.dm ? reinterpret_cast<float*>(w + L.dm) : nullptr;
  if (dm) MXF_CUDA_TRY(cudaMemsetAsync(dm, 0, static_cast<size_t>(g->dmask_numel) * 4, st));
  float* P = reinterpret_cast<float*>(w + L.P);
  float* G = reinterpret_cast<float*>(w + L.G);
  void* ltws = w + L.lt;
  const size_t ltsz = ws_size - L.lt;
  mxf_attention_args nolse = *a;
  nolse.lse = nullptr;  // the recomputed softmax leaves the forward's lse alone
  const bool tf = a->allow_tf32 != 0;
  const int64_t SS = a->Sq * a->Sk;
  for (int64_t n0 = 0; n0 < N; n0 += L.heads_per_chunk) {
    const int64_t cn = N - n0 < L.heads_per_chunk ? N - n0 : L.heads_per_chunk;
    Prod s1{true, a->Sk, a->Sq, a->D, K.p + n0 * K.st, K.ld, K.st, Q.p + n0 * Q.st, Q.ld, Q.st, P, a->Sk, SS, cn,
            a->scale, tf};
    MXF_TRY(run(s1, ltws, ltsz, st));
    masked_softmax_kernel<<<static_cast<unsigned>(cn * a->Sq), 256, 0, st>>>(nolse, P, n0, cn * a->Sq);
    // dP^T (Sk x Sq) = V dO^T: A = V^T (Dv x Sk) transposed, B = dO^T (Dv x Sq)
    Prod s2{true, a->Sk, a->Sq, a->Dv, Vv.p + n0 * Vv.st, Vv.ld, Vv.st, dO.p + n0 * dO.st, dO.ld, dO.st, G, a->Sk, SS,
            cn, 1.f, tf};
    MXF_TRY(run(s2, ltws, ltsz, st));
    softmax_grad_kernel<<<static_cast<unsigned>(cn * a->Sq), 256, 0, st>>>(*a, P, G, n0, cn * a->Sq);
    if (dm) {
      dim3 grid(static_cast<unsigned>((a->Sk + 255) / 256), static_cast<unsigned>(cn));
      dmask_accum_kernel<<<grid, 256, 0, st>>>(*a, G, dm, n0, cn);
    }
    MXF_CUDA_TRY(cudaGetLastError());
    if (wanted(g->req_dv)) {  // dV^T (Dv x Sk) = dO^T (Dv x Sq) P (Sq x Sk)
      Prod p{false, a->Dv, a->Sk, a->Sq, dO.p + n0 * dO.st, dO.ld, dO.st, P, a->Sk, SS, dV.p + n0 * dV.st, dV.ld,
             dV.st, cn, 1.f, tf, true, dV.beta};
      MXF_TRY(run(p, ltws, ltsz, st));
    }
    if (wanted(g->req_dq)) {  // dQ^T (D x Sq) = scale K^T (D x Sk) dS^T (Sk x Sq)
      Prod p{false, a->D, a->Sq, a->Sk, K.p + n0 * K.st, K.ld, K.st, G, a->Sk, SS, dQ.p + n0 * dQ.st, dQ.ld, dQ.st,
             cn, a->scale, tf, false, dQ.beta};
      MXF_TRY(run(p, ltws, ltsz, st));
    }
    if (wanted(g->req_dk)) {  // dK^T (D x Sk) = scale Q^T (D x Sq) dS (Sq x Sk)
      Prod p{false, a->D, a->Sk, a->Sq, Q.p + n0 * Q.st, Q.ld, Q.st, G, a->Sk, SS, dK.p + n0 * dK.st, dK.ld, dK.st,
             cn, a->scale, tf, true, dK.beta};
      MXF_TRY(run(p, ltws, ltsz, st));
    }
  }
  auto scatter = [&](const Out& o, void* dst, int req, int64_t S, int64_t C, int64_t bs, int64_t hs, int64_t rs) {
    if (!o.scatter || !wanted(req)) return;
    scatter_kernel<<<blocks(N * S * C), 256, 0, st>>>(o.p, static_cast<float*>(dst), a->B, a->H, S, C, bs, hs, rs,
                                                      req == MXF_REQ_ADD);
  };
  scatter(dQ, g->dq, g->req_dq, a->Sq, a->D, a->q_bs, a->q_hs, a->q_rs);
  scatter(dK, g->dk, g->req_dk, a->Sk, a->D, a->k_bs, a->k_hs, a->k_rs);
  scatter(dV, g->dv, g->req_dv, a->Sk, a->Dv, a->v_bs, a->v_hs, a->v_rs);
  if (dm) finish_kernel<<<blocks(g->dmask_numel), 256, 0, st>>>(dm, static_cast<float*>(g->dmask), g->dmask_numel,
                                                                 g->req_dmask);
  MXF_CUDA_RETURN_LAST();
}

}  // namespace mxf_attn
#endif
