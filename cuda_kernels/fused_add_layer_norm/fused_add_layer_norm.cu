// CUDA fused add + LayerNorm, fp32 / fp16 / bf16 storage with float32 math.
// Forward: one block per row; a and b are read once (128-bit loads when C and the pointers
// allow), the sum kept in shared memory as float32, mean and two-pass variance by block
// reductions, y (and s) written once.
// Backward: a row kernel (block per row: the statistics, ds = rstd (g - mean(g) - xhat
// mean(g xhat)) + dsum, g = dy gamma, written to da, or summed over b's broadcast rows in a
// float32 accumulator) and a two-stage column reduction for dgamma / dbeta (per-chunk partial
// sums in the workspace, then one pass over the chunks).
#include "cuda_common.cuh"
#include "fused_add_layer_norm.h"

namespace {

using mxf_cuda::from_f;
using mxf_cuda::to_f;

constexpr int64_t kMaxC = 32768;  // 128 KiB of float32 shared memory per row
constexpr int kChunksMax = 256;   // row chunks of the column reduction

int threads_for(int64_t units) {  // a multiple of 32 in [32, 256] covering `units` if it can
  int64_t t = (units + 31) / 32 * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 256 ? 256 : t));
}

// s[0..C) = a_row + b_row in float32 (shared), written to so_row when given; returns the
// thread's partial sum.
template <typename T, bool kVec>
__device__ __forceinline__ float load_sum(const T* __restrict__ ar, const T* __restrict__ br,
                                          T* __restrict__ so_row, float* s, int64_t C) {
  float part = 0.f;
  if (kVec) {
    using V = mxf_cuda::Vec<T>;
    for (int64_t c = threadIdx.x * V::N; c < C; c += blockDim.x * V::N) {
      const V va = mxf_cuda::load_vec(ar + c), vb = mxf_cuda::load_vec(br + c);
      V vs;
#pragma unroll
      for (int e = 0; e < V::N; ++e) {
        const float v = to_f(va.u.e[e]) + to_f(vb.u.e[e]);
        vs.u.e[e] = from_f<T>(v);
        // the sum as the unfused graph has it: rounded to T before the normalization
        s[c + e] = to_f(vs.u.e[e]);
        part += s[c + e];
      }
      if (so_row) mxf_cuda::store_vec(so_row + c, vs);
    }
  } else {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const T v = from_f<T>(to_f(ar[c]) + to_f(br[c]));
      s[c] = to_f(v);
      part += s[c];
      if (so_row) so_row[c] = v;
    }
  }
  return part;
}

template <typename T, bool kVec>
__global__ void add_ln_fwd_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                  const T* __restrict__ g, const T* __restrict__ be,
                                  T* __restrict__ y, T* __restrict__ so, float* __restrict__ mean_out,
                                  float* __restrict__ rstd_out, int64_t C, int64_t b_rows, float eps) {
  extern __shared__ float s[];
  __shared__ float red[32];
  const int64_t r = blockIdx.x;
  const float part = load_sum<T, kVec>(a + r * C, b + (r % b_rows) * C, so ? so + r * C : nullptr, s, C);
  const float mean = mxf_cuda::block_sum(part, red) / C;
  float sq = 0.f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = s[c] - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(mxf_cuda::block_sum(sq, red) / C + eps);
  if (threadIdx.x == 0) {
    if (mean_out) mean_out[r] = mean;
    if (rstd_out) rstd_out[r] = rstd;
  }
  T* yr = y + r * C;
  if (kVec) {
    using V = mxf_cuda::Vec<T>;
    for (int64_t c = threadIdx.x * V::N; c < C; c += blockDim.x * V::N) {
      const V vg = mxf_cuda::load_vec(g + c), vb = mxf_cuda::load_vec(be + c);
      V vy;
#pragma unroll
      for (int e = 0; e < V::N; ++e)
        vy.u.e[e] = from_f<T>((s[c + e] - mean) * rstd * to_f(vg.u.e[e]) + to_f(vb.u.e[e]));
      mxf_cuda::store_vec(yr + c, vy);
    }
  } else {
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
      yr[c] = from_f<T>((s[c] - mean) * rstd * to_f(g[c]) + to_f(be[c]));
  }
}

// Row part of the backward.  s holds the row's sum, then is reused for g = dy * gamma.
template <typename T>
__global__ void add_ln_bwd_rows(const T* __restrict__ dy, const T* __restrict__ dsum,
                                const T* __restrict__ a, const T* __restrict__ b,
                                const T* __restrict__ gamma, const float* __restrict__ mean_in,
                                const float* __restrict__ rstd_in, float* __restrict__ mean_ws,
                                float* __restrict__ rstd_ws, T* __restrict__ da,
                                T* __restrict__ db, float* __restrict__ db_acc, int req_da,
                                int req_db, int64_t C, int64_t b_rows, float eps) {
  extern __shared__ float s[];  // 2 C floats: xhat, g
  __shared__ float red[32];
  float* xh = s;
  float* gv = s + C;
  const int64_t r = blockIdx.x;
  const T* ar = a + r * C;
  const T* br = b + (r % b_rows) * C;
  float mean, rstd;
  if (mean_in && rstd_in) {
    mean = mean_in[r];
    rstd = rstd_in[r];
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) xh[c] = to_f(from_f<T>(to_f(ar[c]) + to_f(br[c])));
    __syncthreads();
  } else {  // the forward's statistics, recomputed
    float part = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      xh[c] = to_f(from_f<T>(to_f(ar[c]) + to_f(br[c])));
      part += xh[c];
    }
    mean = mxf_cuda::block_sum(part, red) / C;
    float sq = 0.f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float d = xh[c] - mean;
      sq += d * d;
    }
    rstd = rsqrtf(mxf_cuda::block_sum(sq, red) / C + eps);
  }
  if (threadIdx.x == 0) {
    mean_ws[r] = mean;
    rstd_ws[r] = rstd;
  }
  float sg = 0.f, sgx = 0.f;
  const T* dyr = dy + r * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float x = (xh[c] - mean) * rstd, gg = to_f(dyr[c]) * to_f(gamma[c]);
    xh[c] = x;
    gv[c] = gg;
    sg += gg;
    sgx += gg * x;
  }
  const float mg = mxf_cuda::block_sum(sg, red) / C;
  const float mgx = mxf_cuda::block_sum(sgx, red) / C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float ds = rstd * (gv[c] - mg - xh[c] * mgx);
    if (dsum) ds += to_f(dsum[r * C + c]);
    if (req_da != MXF_REQ_NULL) mxf_cuda::store_req(da + r * C + c, ds, req_da);
    if (req_db != MXF_REQ_NULL) {
      if (db_acc) atomicAdd(db_acc + (r % b_rows) * C + c, ds);
      else mxf_cuda::store_req(db + r * C + c, ds, req_db);
    }
  }
}

// Column partial sums over a chunk of rows: part_g[chunk][c] = sum dy * xhat, part_b = sum dy.
template <typename T>
__global__ void add_ln_bwd_cols(const T* __restrict__ dy, const T* __restrict__ a,
                                const T* __restrict__ b, const float* __restrict__ mean,
                                const float* __restrict__ rstd, float* __restrict__ part_g,
                                float* __restrict__ part_b, int64_t R, int64_t C, int64_t b_rows,
                                int64_t rows_per_chunk) {
  __shared__ float sg[8][33], sb[8][33];
  const int lane = threadIdx.x & 31, wy = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * 32 + lane;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < R ? r0 + rows_per_chunk : R;
  float ag = 0.f, ab = 0.f;
  if (c < C)
    for (int64_t r = r0 + wy; r < r1; r += 8) {
      const float x = (to_f(from_f<T>(to_f(a[r * C + c]) + to_f(b[(r % b_rows) * C + c]))) - mean[r]) * rstd[r];
      const float d = to_f(dy[r * C + c]);
      ag += d * x;
      ab += d;
    }
  sg[wy][lane] = ag;
  sb[wy][lane] = ab;
  __syncthreads();
  if (wy == 0 && c < C) {
    float tg = 0.f, tb = 0.f;
    for (int w = 0; w < 8; ++w) {
      tg += sg[w][lane];
      tb += sb[w][lane];
    }
    part_g[blockIdx.y * C + c] = tg;
    part_b[blockIdx.y * C + c] = tb;
  }
}

template <typename T>
__global__ void add_ln_bwd_finish(const float* __restrict__ part_g, const float* __restrict__ part_b,
                                  int nchunks, T* __restrict__ dgamma, T* __restrict__ dbeta,
                                  int req_dg, int req_dbeta, int64_t C) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float tg = 0.f, tb = 0.f;
  for (int k = 0; k < nchunks; ++k) {
    tg += part_g[k * C + c];
    tb += part_b[k * C + c];
  }
  if (req_dg != MXF_REQ_NULL) mxf_cuda::store_req(dgamma + c, tg, req_dg);
  if (req_dbeta != MXF_REQ_NULL) mxf_cuda::store_req(dbeta + c, tb, req_dbeta);
}

template <typename T>
__global__ void finish_acc(const float* __restrict__ acc, T* __restrict__ out, int64_t n, int req) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) mxf_cuda::store_req(out + i, acc[i], req);
}

template <typename K>
int allow_smem(K kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return 0;
  MXF_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return 0;
}

struct BwdPlan {
  int nchunks;
  int64_t rows_per_chunk;
  size_t mean_off, rstd_off, pg_off, pb_off, acc_off, total;
};
BwdPlan bwd_plan(int64_t R, int64_t C, int64_t b_rows) {
  BwdPlan p{};
  const int64_t want = (R + 63) / 64;  // >= 64 rows a chunk
  p.nchunks = static_cast<int>(want < 1 ? 1 : (want > kChunksMax ? kChunksMax : want));
  p.rows_per_chunk = (R + p.nchunks - 1) / p.nchunks;
  if (p.rows_per_chunk < 1) p.rows_per_chunk = 1;
  using mxf_cuda::align256;
  size_t off = 0;
  p.mean_off = off; off += align256(R * sizeof(float));
  p.rstd_off = off; off += align256(R * sizeof(float));
  p.pg_off = off; off += align256(static_cast<size_t>(p.nchunks) * C * sizeof(float));
  p.pb_off = off; off += align256(static_cast<size_t>(p.nchunks) * C * sizeof(float));
  p.acc_off = off;
  if (b_rows < R) off += align256(static_cast<size_t>(b_rows) * C * sizeof(float));
  p.total = off;
  return p;
}

}  // namespace

extern "C" int mxf_add_layer_norm_forward(int dtype, const void* a, const void* b, const void* gamma,
                                          const void* beta, void* y, void* sum_out, float* mean,
                                          float* rstd, int64_t R, int64_t C, int64_t b_rows,
                                          float eps, void* stream) {
  if (mxf_cuda::dtype_bytes(dtype) == 0 || R < 0 || C <= 0 || C > kMaxC || b_rows <= 0 || R % b_rows != 0 ||
      R > 0x7fffffff)
    return MXF_ERR_BAD_ARGS;
  if (R == 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const size_t smem = C * sizeof(float);
  return mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kN = mxf_cuda::Vec<T>::N;
    const bool vec = C % kN == 0 && mxf_cuda::aligned16(a) && mxf_cuda::aligned16(b) &&
                     mxf_cuda::aligned16(gamma) && mxf_cuda::aligned16(beta) && mxf_cuda::aligned16(y) &&
                     (!sum_out || mxf_cuda::aligned16(sum_out));
    auto args = [&](auto kernel, int threads) {
      MXF_TRY(allow_smem(kernel, smem));
      kernel<<<static_cast<unsigned>(R), threads, smem, st>>>(
          static_cast<const T*>(a), static_cast<const T*>(b), static_cast<const T*>(gamma),
          static_cast<const T*>(beta), static_cast<T*>(y), static_cast<T*>(sum_out), mean, rstd, C,
          b_rows, eps);
      MXF_CUDA_RETURN_LAST();
    };
    return vec ? args(add_ln_fwd_kernel<T, true>, threads_for(C / kN))
               : args(add_ln_fwd_kernel<T, false>, threads_for(C));
  });
}

extern "C" size_t mxf_add_layer_norm_backward_workspace_size(int, int64_t R, int64_t C, int64_t b_rows) {
  return bwd_plan(R, C, b_rows).total;
}

extern "C" int mxf_add_layer_norm_backward(int dtype, const void* dy, const void* dsum, const void* a,
                                           const void* b, const void* gamma, const float* mean,
                                           const float* rstd, void* da, void* db, void* dgamma,
                                           void* dbeta, int req_da, int req_db, int req_dgamma,
                                           int req_dbeta, int64_t R, int64_t C, int64_t b_rows, float eps,
                                           void* workspace, size_t workspace_size, void* stream) {
  if (mxf_cuda::dtype_bytes(dtype) == 0 || R < 0 || C <= 0 || C > kMaxC / 2 || b_rows <= 0 ||
      R % b_rows != 0 || R > 0x7fffffff)
    return MXF_ERR_BAD_ARGS;
  for (int q : {req_da, req_db, req_dgamma, req_dbeta})
    if (!mxf_cuda::req_ok(q)) return MXF_ERR_BAD_ARGS;
  const BwdPlan plan = bwd_plan(R, C, b_rows);
  if (!workspace || workspace_size < plan.total) return MXF_ERR_WORKSPACE;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const size_t es = mxf_cuda::dtype_bytes(dtype);
  if (R == 0) {
    if (req_db == MXF_REQ_WRITE || req_db == MXF_REQ_INPLACE) MXF_CUDA_TRY(cudaMemsetAsync(db, 0, b_rows * C * es, st));
    if (req_dgamma == MXF_REQ_WRITE || req_dgamma == MXF_REQ_INPLACE) MXF_CUDA_TRY(cudaMemsetAsync(dgamma, 0, C * es, st));
    if (req_dbeta == MXF_REQ_WRITE || req_dbeta == MXF_REQ_INPLACE) MXF_CUDA_TRY(cudaMemsetAsync(dbeta, 0, C * es, st));
    return 0;
  }
  char* ws = static_cast<char*>(workspace);
  float* mean_ws = reinterpret_cast<float*>(ws + plan.mean_off);
  float* rstd_ws = reinterpret_cast<float*>(ws + plan.rstd_off);
  float* pg = reinterpret_cast<float*>(ws + plan.pg_off);
  float* pb = reinterpret_cast<float*>(ws + plan.pb_off);
  float* acc = (b_rows < R && req_db != MXF_REQ_NULL) ? reinterpret_cast<float*>(ws + plan.acc_off) : nullptr;
  if (acc) MXF_CUDA_TRY(cudaMemsetAsync(acc, 0, b_rows * C * sizeof(float), st));
  const size_t smem = 2 * C * sizeof(float);
  return mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    MXF_TRY(allow_smem(add_ln_bwd_rows<T>, smem));
    add_ln_bwd_rows<T><<<static_cast<unsigned>(R), threads_for(C), smem, st>>>(
        static_cast<const T*>(dy), static_cast<const T*>(dsum), static_cast<const T*>(a),
        static_cast<const T*>(b), static_cast<const T*>(gamma), mean, rstd, mean_ws, rstd_ws,
        static_cast<T*>(da), static_cast<T*>(db), acc, req_da, req_db, C, b_rows, eps);
    MXF_CUDA_TRY(cudaGetLastError());
    if (acc)
      finish_acc<T><<<static_cast<unsigned>((b_rows * C + 255) / 256), 256, 0, st>>>(acc, static_cast<T*>(db),
                                                                                    b_rows * C, req_db);
    if (req_dgamma != MXF_REQ_NULL || req_dbeta != MXF_REQ_NULL) {
      dim3 grid(static_cast<unsigned>((C + 31) / 32), static_cast<unsigned>(plan.nchunks));
      add_ln_bwd_cols<T><<<grid, 256, 0, st>>>(static_cast<const T*>(dy), static_cast<const T*>(a),
                                               static_cast<const T*>(b), mean_ws, rstd_ws, pg, pb, R, C,
                                               b_rows, plan.rows_per_chunk);
      add_ln_bwd_finish<T><<<static_cast<unsigned>((C + 255) / 256), 256, 0, st>>>(
          pg, pb, plan.nchunks, static_cast<T*>(dgamma), static_cast<T*>(dbeta), req_dgamma, req_dbeta, C);
    }
    MXF_CUDA_RETURN_LAST();
  });
}
