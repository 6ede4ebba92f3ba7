// Y = X * W^T + bias with the weight packed once into oneDNN's preferred blocked layout,
// through oneDNN's matmul primitive (its C API, bound at run time from the same library
// as dnnl_sgemm: see dnnl_api.h).
//
// MXFUSION_NO_DNNL_MATMUL=1 turns it off (everything then goes through dnnl_sgemm).
//
// bfloat16 (`bf16` set): X and W are bfloat16 (raw uint16_t bits), the product is
// accumulated in float32 by oneDNN and the bias stays float32; Y is float32, or bfloat16
// (rounded to nearest even by oneDNN, which flushes subnormal results to zero) with
// `dst_bf16`.  An elementwise step (MatmulEltwise: a oneDNN post-op) may follow the bias.  oneDNN runs it with
// vdpbf16ps/AMX where the CPU has them and emulates it (slower than float32) elsewhere.
//
// Why: dnnl_sgemm re-packs its B operand on every call.  For the weights of an inference
// model that is wasted work; on BERT's shapes (M = 128/512) the prepacked matmul measured
// up to 10% faster than dnnl_sgemm (768 -> 3072: 189-192 against 171-174 GFLOP/s at
// M = 128), and it adds the bias in the same pass.
#pragma once
#include <oneapi/dnnl/dnnl_types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace mxf {

// An elementwise function oneDNN applies to the product (+ bias) before writing it (a post-op
// of the matmul primitive): none when alg is dnnl_alg_kind_undef.
struct MatmulEltwise {
  dnnl_alg_kind_t alg = dnnl_alg_kind_undef;
  float alpha = 0.f, beta = 0.f;
};

class PackedMatmul {
 public:
  // N x K weight (row-major, MXNet FullyConnected layout); `bias` says whether run()
  // gets one.  Returns null (with the reason in *why) when oneDNN's matmul API is not
  // available; callers then use sgemm().
  static std::unique_ptr<PackedMatmul> create(int64_t N, int64_t K, bool bias, std::string* why,
                                              bool bf16 = false, bool dst_bf16 = false,
                                              MatmulEltwise post = {});
  ~PackedMatmul();

  // Y (M, N) = X (M, K) * W^T (+ bias).  W is packed on first use for each weight layout
  // oneDNN picks (the layout may depend on M; primitives are cached per M, up to
  // kMaxShapes of them).  Returns false, writing nothing, when this M cannot be served
  // (too many shapes, or a oneDNN error): the caller falls back to sgemm.
  // With bf16, X and W point to bfloat16 values; Y is float32, or bfloat16 with dst_bf16.
  bool run(const void* X, int64_t M, const void* W, const float* bias, void* Y);

  static constexpr size_t kMaxShapes = 8;

 private:
  PackedMatmul(int64_t N, int64_t K, bool bias, bool bf16, bool dst_bf16, MatmulEltwise post);
  struct Shape;
  struct Packed;
  Packed* packed_for(const void* wmd, const void* W);

  int64_t N_, K_;
  bool bias_;
  bool bf16_;
  bool dst_bf16_;
  MatmulEltwise post_;
  std::mutex mu_;
  std::map<int64_t, std::unique_ptr<Shape>> shapes_;
  std::vector<std::unique_ptr<Packed>> packed_;
};

// Y (M, N) = X (M, K) * W^T (+ bias) with W read in place (no packing kept): for calls
// whose op state does not outlive the call (mx.nd, a CachedOp without static_alloc),
// where dnnl_sgemm with a transposed B measured 90-153 GFLOP/s at M = 128 on BERT's
// shapes and this 166-185 (oneDNN caches the primitive; only the descriptor is rebuilt
// per call).  Returns false, writing nothing, when oneDNN's matmul API is unavailable
// or fails: the caller falls back to sgemm.
bool matmul_unpacked(const float* X, int64_t M, const float* W, int64_t N, int64_t K,
                     const float* bias, float* Y);
// The same with bfloat16 X and W (float32 bias; Y float32, or bfloat16 with dst_bf16), and
// the elementwise `post` after the bias.
bool matmul_unpacked_bf16(const uint16_t* X, int64_t M, const uint16_t* W, int64_t N, int64_t K,
                          const float* bias, void* Y, bool dst_bf16 = false, MatmulEltwise post = {});

// float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN), and back.
void to_bf16(const float* x, uint16_t* y, int64_t n);
void from_bf16(const uint16_t* x, float* y, int64_t n);

}  // namespace mxf
