// fused_dense: y = act(x W^T + b), optionally written head-split as (B, H, S, D).
//
// Stateful op: on the second call that sees the same weight version (an executor or
// CachedOp; refreshed when MXNet reports a new version of the weight array,
// MXTensor::verID, or a new buffer) the weight is prepared once:
// - plain output: packed by oneDNN's matmul primitive into its blocked layout
//   (dnnl_matmul.h), which then also adds the bias; the activation runs over rows after;
// - head-split output, or no matmul API: kept transposed to (K, N) for dnnl_sgemm
//   (~1.05-2x faster than B as (N, K) here).
// First calls (and states that live for one call: mx.nd, a CachedOp without static_alloc):
// oneDNN's matmul reading W in place.  Fallback when oneDNN's matmul API is missing or
// fails: one multi-threaded sgemm, then bias + activation over rows in parallel.
// Head-split output: one OpenMP task per (batch, head) tile, a single-threaded sgemm
// writing straight into (B, H, S, D), epilogue applied while the tile is in cache.
//
// bfloat16 weight (fuse(..., precision="bf16") casts it once): x is read as bfloat16 (a
// float32 x is rounded to nearest even per call; a bfloat16 x, written so by the op before,
// is read as it is), the product runs through oneDNN's bf16 matmul (float32 accumulation,
// weight packed once as above, bias added in float32) and the activation runs in float32;
// GELU runs inside oneDNN's matmul (an eltwise post-op on the float32 result) where bounds on
// x, W and the bias show no pre-activation can be infinite or NaN (oneDNN's GELU gives NaN for
// +inf, MXNet's +inf), the other activations, and GELU elsewhere, over rows after it; the output is float32, or bfloat16 with
// out_dtype='bfloat16' (the float32 result rounded to nearest even: what a reader that rounds
// its input to bfloat16 would see, written once; oneDNN writes it directly after no
// activation or GELU, flushing subnormal results to zero).  A head-split output is written
// through a (M, N) buffer.  Inference only (no backward).  Without oneDNN's matmul the
// operands are widened to float32 for sgemm.
//
// float16 weight (AMP's GPU graphs: FullyConnected runs in float16 there, its data, weight and
// bias cast to float16): data and bias float16 or float32, output float16 (or out_dtype=
// 'float32').  The CPU runs it in float32 -- the weight widened once per weight version (and then
// packed as above), data and bias per call -- and rounds the result once (half.h); the backward
// likewise.  Correct, not fast: float16 graphs are GPU graphs.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "act.h"
#include "dnnl_matmul.h"
#include "half.h"
#include "mxf_common.h"
#include "gpu_glue.h"  // the "gpu" implementations (a build with nvcc)

using namespace mxf;

namespace {

// The largest magnitude among n values as float32 bits (ordered as the magnitudes are; at or
// above 0x7f800000 one of them is infinite or NaN).
uint32_t max_abs_bits(const float* x, int64_t n) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    u &= 0x7fffffffu;
    m = u > m ? u : m;
  }
  return m;
}

uint32_t max_abs_bits(const uint16_t* x, int64_t n) {
  uint32_t m = 0;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(x[i] & 0x7fffu);
    m = u > m ? u : m;
  }
  return m << 16;
}

float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct DenseParams {
  bool no_bias, flatten, heads_out, out_bf16;
  int out_dtype;  // -1: the default (float16 for a float16 weight, else float32)
  int64_t heads, num_hidden;
  Act act;
  float slope;
};

DenseParams parse(const Attrs& a) {
  DenseParams p;
  p.no_bias = attr_bool(a, "no_bias", false);
  p.flatten = attr_bool(a, "flatten", true);
  p.act = parse_act(a);
  p.slope = attr_float(a, "slope", 0.25f);
  p.num_hidden = attr_int(a, "num_hidden", -1);
  p.heads_out = attr_choice(a, "out_layout", "plain", {"plain", "heads_bhsd"}) == "heads_bhsd";
  p.heads = attr_int(a, "heads", 0);
  p.out_dtype = attr_dtype(a, "out_dtype", {kF32, kBF16, kF16});
  p.out_bf16 = p.out_dtype == kBF16;
  if (p.out_bf16 && p.heads_out) throw OpError("out_dtype='bfloat16' needs out_layout='plain'");
  if (p.heads_out) {
    if (p.heads <= 0) throw OpError("out_layout='heads_bhsd' needs a positive attribute 'heads'");
    if (p.flatten) throw OpError("out_layout='heads_bhsd' needs flatten=False");
  }
  return p;
}

struct Dims {
  int64_t M, K, N;
  std::vector<int64_t> out;
};

Dims dims(const DenseParams& p, const std::vector<int64_t>& xs, const std::vector<int64_t>& ws) {
  if (ws.size() != 2) throw OpError("weight must be 2-D (num_hidden, K), got " + shape_str(ws));
  if (xs.empty()) throw OpError("data must have rank >= 1");
  Dims d;
  d.N = ws[0];
  if (p.num_hidden >= 0 && p.num_hidden != d.N)
    throw OpError("num_hidden=" + std::to_string(p.num_hidden) + " but weight has " +
                  std::to_string(d.N) + " rows");
  if (p.flatten) {
    d.M = xs[0];
    d.K = 1;
    for (size_t i = 1; i < xs.size(); ++i) d.K *= xs[i];
    d.out = {xs[0], d.N};
  } else {
    d.K = xs.back();
    d.M = numel(xs) / std::max<int64_t>(d.K, 1);
    d.out.assign(xs.begin(), xs.end() - 1);
    d.out.push_back(d.N);
  }
  if (d.K != ws[1])
    throw OpError("data has K=" + std::to_string(d.K) + " input features but weight is " +
                  shape_str(ws));
  if (p.heads_out) {
    if (xs.size() != 3) throw OpError("out_layout='heads_bhsd' needs data (B, S, K)");
    if (d.N % p.heads)
      throw OpError("num_hidden " + std::to_string(d.N) + " not divisible by heads " +
                    std::to_string(p.heads));
    d.out = {xs[0], p.heads, xs[1], d.N / p.heads};
  }
  return d;
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_dense", [&] {
    DenseParams p = parse(a);
    *nin = p.no_bias ? 2 : 3;
    *nout = 1;
  });
}

constexpr int kBfloat16 = kBF16;

MXReturnValue infer_type(const Attrs& a, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_dense", [&] {
    const DenseParams p = parse(a);
    const int w = (*in)[1];
    if (w == kF16) {  // AMP's float16 FullyConnected; data or bias may still be float32
      for (size_t i = 0; i < in->size(); ++i)
        if (i != 1 && (*in)[i] != kF16 && (*in)[i] != kF32)
          throw OpError("input " + std::to_string(i) + " must be float16 or float32 with a float16 weight, got " +
                        dtype_name((*in)[i]));
      if (p.out_dtype == kBF16) throw OpError("out_dtype='bfloat16' needs a bfloat16 weight (input 1)");
      (*out)[0] = p.out_dtype >= 0 ? p.out_dtype : kF16;
      return;
    }
    const bool bf16_weight = w == kBfloat16;
    for (size_t i = 0; i < in->size(); ++i) {
      const int t = (*in)[i];
      if (i == 1 && t == kBfloat16) continue;  // reduced precision: the weight
      if (i == 0 && t == kBfloat16 && bf16_weight) continue;  // and data it rounds anyway
      if (t != mxnet::ext::kFloat32)
        throw OpError(i == 1 ? "input 1 (weight) must be float32, float16 or bfloat16, got " + dtype_name(t)
                      : i == 0 ? "input 0 (data) must be float32 (or bfloat16 with a bfloat16 weight, "
                                 "float16 with a float16 weight), got " + dtype_name(t)
                               : "input " + std::to_string(i) + " must be float32 (or float16 with a float16 "
                                 "weight), got " + dtype_name(t));
    }
    if (p.out_bf16 && !bf16_weight)
      throw OpError("out_dtype='bfloat16' needs a bfloat16 weight (input 1)");
    if (p.out_dtype == kF16) throw OpError("out_dtype='float16' needs a float16 weight (input 1)");
    (*out)[0] = p.out_bf16 ? kBfloat16 : mxnet::ext::kFloat32;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_dense", [&] {
    DenseParams p = parse(a);
    // the weight (N, K) and bias (N,) from the data and num_hidden, as FullyConnected infers them
    require_known_input(*in, 0, "data");
    const Shape& x = (*in)[0];
    unsigned int K = 1;
    if (p.flatten)
      for (size_t i = 1; i < x.size(); ++i) K *= x[i];
    else
      K = x.back();
    int64_t N = p.num_hidden;
    if (N < 0 && !shape_unknown((*in)[1])) N = (*in)[1][0];
    if (N < 0 && !p.no_bias && !shape_unknown((*in)[2])) N = (*in)[2][0];
    if (N >= 0) {
      fill_input(in, 1, Shape{static_cast<unsigned int>(N), K}, "weight");
      if (!p.no_bias) fill_input(in, 2, Shape{static_cast<unsigned int>(N)}, "bias");
    }
    require_known_shapes(*in);
    std::vector<int64_t> xs((*in)[0].begin(), (*in)[0].end()), ws((*in)[1].begin(), (*in)[1].end());
    Dims d = dims(p, xs, ws);
    if (!p.no_bias && !((*in)[2].size() == 1 && (*in)[2][0] == d.N))
      throw OpError("bias must have shape (" + std::to_string(d.N) + ",), got " +
                    shape_str((*in)[2]));
    (*out)[0] = Shape(d.out.begin(), d.out.end());
  });
}

class DenseOp : public mxnet::ext::CustomStatefulOp {
 public:
  explicit DenseOp(Attrs attrs) : attrs_(std::move(attrs)), p_(parse(attrs_)) {}

  // The weight as the GEMM's B operand.  Packing (W^T, (K, N) row-major) pays off only
  // when the same weight version is used again, so it happens on the second call that
  // sees it (an executor / CachedOp); a one-off call (mx.nd) multiplies by W directly.
  struct WeightView {
    const float* p;
    char trans;   // 'N': p is W^T (K, N);  'T': p is W (N, K)
    int64_t ld;
    PackedMatmul* mm = nullptr;  // set: the weight is prepacked for oneDNN's matmul
    const float* cols(int64_t n0, int64_t K) const { return trans == 'N' ? p + n0 : p + n0 * K; }
  };

  WeightView weight(MXTensor& w, int64_t N, int64_t K, bool has_bias) {
    std::lock_guard<std::mutex> lk(mu_);
    const bool same = !w_version_.changed(w);
    if (same && mm_) return {w.data<float>(), 'T', K, mm_.get()};
    if (same && packed_) return {wt_.data(), 'N', N};
    if (same && !p_.heads_out && !mm_failed_) {
      // second use, plain output: oneDNN's matmul packs W itself (on its first run)
      std::string why;
      mm_ = PackedMatmul::create(N, K, has_bias, &why);
      if (mm_) return {w.data<float>(), 'T', K, mm_.get()};
      mm_failed_ = true;  // no matmul API: pack for dnnl_sgemm below
    }
    if (same) {  // second use of this weight version: pack it
      wt_.resize(N * K);
      const float* W = w.data<float>();
#pragma omp parallel for schedule(dynamic, 4)
      for (int64_t kb = 0; kb < K; kb += 64)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t k = kb; k < std::min(K, kb + 64); ++k) wt_[k * N + n] = W[n * K + k];
      packed_ = true;
      return {wt_.data(), 'N', N};
    }
    packed_ = false;
    mm_.reset();
    return {w.data<float>(), 'T', K};
  }

  // A float16 weight as float32, widened once per weight version into a buffer of this state:
  // its own version counter (not the weight's) names each widening, so that weight() packs it
  // again whenever the buffer's contents change, however the float16 weight's identity changes.
  MXTensor widened_weight(const MXTensor& w) {
    std::lock_guard<std::mutex> lk(mu_);
    if (w16_version_.changed(w) || wf_.size() != static_cast<size_t>(w.size())) {
      wf_.resize(w.size());
      from_f16(static_cast<const uint16_t*>(w.data_ptr), wf_.data(), w.size());
      ++wf_ver_;
    }
    MXTensor t = w;
    t.data_ptr = wf_.data();
    t.dtype = mxnet::ext::kFloat32;
    t.verID = wf_ver_;
    return t;
  }

  MXReturnValue Forward(std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                        const OpResource&) override {
    return guarded("fused_dense", [&] {
      if ((*in)[1].dtype == kF16) {  // float32 on widened copies, rounded once
        std::vector<MXTensor> rest(*in);
        rest[1].dtype = mxnet::ext::kFloat32;  // widened below, not by Float32Call
        Float32Call c(rest, *out);
        c.in[1] = widened_weight((*in)[1]);
        forward_f32(&c.in, &c.out);
        c.finish();
        return;
      }
      if ((*in)[1].dtype == kBfloat16) {
        if ((*in)[0].dtype != kBfloat16) require_f32((*in)[0], "fused_dense data");
        if (!p_.no_bias) require_f32((*in)[2], "fused_dense bias");
        if ((*out)[0].dtype != (p_.out_bf16 ? kBfloat16 : mxnet::ext::kFloat32))
          throw OpError("output dtype does not match out_dtype");
        Dims d = dims(p_, (*in)[0].shape, (*in)[1].shape);
        forward_bf16(d, (*in)[0], (*in)[1], p_.no_bias ? nullptr : (*in)[2].data<float>(),
                     (*out)[0].data_ptr);
        return;
      }
      forward_f32(in, out);
    });
  }

  void forward_f32(std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
    for (auto& t : *in) require_f32(t, "fused_dense input");
    require_f32((*out)[0], "fused_dense output");
    Dims d = dims(p_, (*in)[0].shape, (*in)[1].shape);
    const float* X = (*in)[0].data<float>();
    const WeightView W = weight((*in)[1], d.N, d.K, !p_.no_bias);
    const float* bias = p_.no_bias ? nullptr : (*in)[2].data<float>();
    float* Y = (*out)[0].data<float>();
    run(d, X, W, bias, Y, (*in)[0].shape);
  }

  void run(const Dims& d, const float* X, const WeightView& W, const float* bias, float* Y,
           const std::vector<int64_t>& xs) {
    const int64_t M = d.M, N = d.N, K = d.K;
    if (M == 0 || N == 0) return;
    const Act act = this->act(xs);
    if (!p_.heads_out) {
      // oneDNN's matmul adds the bias; the activation then runs over rows
      auto activate = [&] {
        if (act == Act::none) return;
#pragma omp parallel for schedule(dynamic, 4)
        for (int64_t i = 0; i < M; ++i) act_forward(act, p_.slope, Y + i * N, N);
      };
      // reused weight: prepacked; a state that lives for one call (mx.nd, CachedOp
      // without static_alloc) or a first call: W read in place
      if ((W.mm && W.mm->run(X, M, W.p, bias, Y)) ||
          (W.trans == 'T' && matmul_unpacked(X, M, W.p, N, K, bias, Y))) {
        activate();
        return;
      }
      // one multi-threaded sgemm, then bias + activation by rows (measured 3-14% faster
      // than per-tile single-threaded sgemm calls on the BERT shapes)
      sgemm('N', W.trans, M, N, K, 1.f, X, K, W.p, W.ld, 0.f, Y, N);
#pragma omp parallel for schedule(dynamic, 4)
      for (int64_t i = 0; i < M; ++i) {
        float* row = Y + i * N;
        if (bias)
          for (int64_t j = 0; j < N; ++j) row[j] += bias[j];
        act_forward(act, p_.slope, row, N);
      }
      return;
    }
    // (batch, head) tiles written straight into (B, H, S, D)
    const int64_t B = xs[0], S = xs[1], H = p_.heads, D = N / H;
    std::string err;
#pragma omp parallel for schedule(dynamic, 1) collapse(2)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        float* C = Y + (b * H + h) * S * D;
        try {
          sgemm('N', W.trans, S, D, K, 1.f, X + b * S * K, K, W.cols(h * D, K), W.ld, 0.f, C, D);
        } catch (const std::exception& e) {
#pragma omp critical
          err = e.what();
          continue;
        }
        for (int64_t i = 0; i < S; ++i) {
          float* row = C + i * D;
          if (bias)
            for (int64_t j = 0; j < D; ++j) row[j] += bias[h * D + j];
          act_forward(act, p_.slope, row, D);
        }
      }
    if (!err.empty()) throw OpError(err);
  }

  // The activation as a oneDNN post-op of the bf16 matmul (applied to the float32 result
  // before it is stored): GELU, the transformers' FFN activation; none for the others,
  // which the rows pass applies (their NaN and signed-zero semantics are MXNet's, act.h).
  static MatmulEltwise eltwise_of(Act act) {
    MatmulEltwise e;
    if (act == Act::gelu_erf || act == Act::gelu_erf_dnnl) e.alg = dnnl_eltwise_gelu_erf;
    if (act == Act::gelu_tanh) e.alg = dnnl_eltwise_gelu_tanh;
    return e;
  }

  // The bfloat16 weight's packed form (second call with the same weight version, as for
  // float32); null on a first call or without oneDNN's matmul.
  PackedMatmul* weight_bf16(MXTensor& w, int64_t N, int64_t K, bool has_bias, bool dst_bf16,
                            MatmulEltwise post) {
    std::lock_guard<std::mutex> lk(mu_);
    const bool same = !w_version_.changed(w);
    if (same && mm_) return mm_.get();
    if (same && !mm_failed_) {
      std::string why;
      mm_ = PackedMatmul::create(N, K, has_bias, &why, /*bf16=*/true, dst_bf16, post);
      if (!mm_) mm_failed_ = true;
      return mm_.get();
    }
    if (!same) mm_.reset();
    return nullptr;
  }

  // Whether every pre-activation x·Wᵀ + b is finite, by bounds: x, W (its bound kept per weight
  // version) and the bias finite, and K * max|x| * max|W| + max|b| within float32's range.
  bool finite_products(MXTensor& xT, int64_t M, int64_t K, MXTensor& wT, int64_t N, const float* bias) {
    const uint32_t xb = xT.dtype == kBfloat16 ? max_abs_bits(static_cast<const uint16_t*>(xT.data_ptr), M * K)
                                              : max_abs_bits(xT.data<float>(), M * K);
    uint32_t wb;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (wmax_version_.changed(wT)) wmax_ = max_abs_bits(static_cast<const uint16_t*>(wT.data_ptr), N * K);
      wb = wmax_;
    }
    const uint32_t bb = bias ? max_abs_bits(bias, N) : 0;
    const uint32_t inf = 0x7f800000u;
    if (xb >= inf || wb >= inf || bb >= inf) return false;
    const double bound = static_cast<double>(K) * bits_float(xb) * bits_float(wb) + bits_float(bb);
    return bound < 1e38;  // float32's largest value is 3.4e38
  }

  void forward_bf16(const Dims& d, MXTensor& xT, MXTensor& wT, const float* bias, void* out) {
    const int64_t M = d.M, N = d.N, K = d.K;
    if (M == 0 || N == 0) return;
    const Act act = this->act(xT.shape);
    const uint16_t* W = static_cast<const uint16_t*>(wT.data_ptr);
    // Small passes run on the calling thread: an OpenMP region costs more than they do (and,
    // on a busy machine, a whole time slice whenever a team member is descheduled).
    constexpr int64_t kParallelMin = int64_t(1) << 18;
    // per-thread buffers kept between calls (no allocation, no page faults per call)
    thread_local std::vector<uint16_t> xbuf;
    thread_local std::vector<float> zbuf;
    const uint16_t* xb;
    if (xT.dtype == kBfloat16) {
      xb = static_cast<const uint16_t*>(xT.data_ptr);
    } else {
      const float* X = xT.data<float>();
      if (xbuf.size() < static_cast<size_t>(M * K)) xbuf.resize(M * K);
      uint16_t* xw = xbuf.data();
      const int64_t chunk = 4096;  // rounding is memory-bound: split by elements, not rows
#pragma omp parallel for schedule(static) if (M * K >= kParallelMin)
      for (int64_t i = 0; i < M * K; i += chunk) to_bf16(X + i, xw + i, std::min(chunk, M * K - i));
      xb = xw;
    }
    // oneDNN applies GELU after the bias (a post-op) and writes bfloat16 itself when nothing
    // else follows; otherwise the float32 product goes to Z (the output, or a buffer) and the
    // pass below finishes it
    MatmulEltwise post = eltwise_of(act);
    // oneDNN's GELU gives NaN for an infinite input, MXNet's gives +inf for +inf: the post-op is
    // taken only where no pre-activation can be infinite or NaN (x, W and the bias finite, and
    // K * max|x| * max|W| + max|b| below float32's range); elsewhere the rows pass applies
    // MXNet's GELU to the float32 product
    const bool post_kept = post.alg == dnnl_alg_kind_undef || finite_products(xT, M, K, wT, N, bias);
    if (!post_kept) post = MatmulEltwise{};
    const bool act_in_mm = post.alg != dnnl_alg_kind_undef;
    const bool direct_bf16 = p_.out_bf16 && (act == Act::none || act_in_mm);
    float* Z = static_cast<float*>(out);
    if (p_.heads_out || (p_.out_bf16 && !direct_bf16)) {
      if (zbuf.size() < static_cast<size_t>(M * N)) zbuf.resize(M * N);
      Z = zbuf.data();
    }
    void* dst = direct_bf16 ? out : static_cast<void*>(Z);
    PackedMatmul* mm = post_kept ? weight_bf16(wT, N, K, bias != nullptr, direct_bf16, post) : nullptr;
    bool bias_added = true;  // and the post-op applied
    if (!(mm && mm->run(xb, M, W, bias, dst)) &&
        !matmul_unpacked_bf16(xb, M, W, N, K, bias, dst, direct_bf16, post)) {
      // no oneDNN matmul: widen, then sgemm (into Z, a float32 buffer when out is bfloat16)
      std::vector<float> wf(N * K), xf(M * K), zf;
      from_bf16(W, wf.data(), N * K);
      from_bf16(xb, xf.data(), M * K);
      if (direct_bf16) {
        zf.resize(M * N);
        Z = zf.data();
      }
      sgemm('N', 'T', M, N, K, 1.f, xf.data(), K, wf.data(), K, 0.f, Z, N);
      bias_added = false;
    } else if (direct_bf16) {
      return;
    }
    const float* extra = bias_added ? nullptr : bias;
    const Act rest = bias_added && act_in_mm ? Act::none : act;  // what the rows pass applies
    if (!p_.heads_out) {
      if (!extra && rest == Act::none && !p_.out_bf16) return;
      uint16_t* Yb = static_cast<uint16_t*>(out);
#pragma omp parallel for schedule(dynamic, 4) if (M * N >= kParallelMin)
      for (int64_t i = 0; i < M; ++i) {
        float* row = Z + i * N;
        if (extra)
          for (int64_t j = 0; j < N; ++j) row[j] += extra[j];
        act_forward(rest, p_.slope, row, N);
        if (p_.out_bf16) to_bf16(row, Yb + i * N, N);
      }
      return;
    }
    float* Y = static_cast<float*>(out);
    const auto& xs = xT.shape;
    const int64_t B = xs[0], S = xs[1], H = p_.heads, D = N / H;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) if (M * N >= kParallelMin)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t s = 0; s < S; ++s) {
          float* row = Y + ((b * H + h) * S + s) * D;
          const float* src = Z + (b * S + s) * N + h * D;
          for (int64_t j = 0; j < D; ++j) row[j] = src[j] + (extra ? extra[h * D + j] : 0.f);
          act_forward(rest, p_.slope, row, D);
        }
  }

  // inputs: [dy, x, w, (b), y]; outputs: [dx, dw, (db)]
  MXReturnValue Backward(std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                         const OpResource&) override {
    return guarded("fused_dense backward", [&] {
      if (!any_f16(*in, *out)) return backward_f32(in, out);
      Float32Call c(*in, *out);
      backward_f32(&c.in, &c.out);
      c.finish();
    });
  }

  void backward_f32(std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
    {
      MXTensor& xT = (*in)[1];
      MXTensor& wT = (*in)[2];
      if (wT.dtype == kBfloat16)
        throw OpError("a bfloat16 weight has no backward (reduced precision is for inference)");
      Dims d = dims(p_, xT.shape, wT.shape);
      const int64_t M = d.M, N = d.N, K = d.K;
      const float* X = xT.data<float>();
      const float* W = wT.data<float>();
      const float* bias = p_.no_bias ? nullptr : (*in)[3].data<float>();
      const float* dY = (*in)[0].data<float>();
      const float* Yv = (*in)[p_.no_bias ? 3 : 4].data<float>();
      std::vector<float> dz(M * N), ybuf, zbuf;
      if (p_.heads_out) {  // bring (B,H,S,D) back to (B*S, H*D)
        const int64_t B = xT.shape[0], S = xT.shape[1], H = p_.heads, D = N / H;
        ybuf.resize(M * N);
        std::vector<float> dyb(M * N);
#pragma omp parallel for collapse(2)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t s = 0; s < S; ++s)
            for (int64_t h = 0; h < H; ++h)
              for (int64_t j = 0; j < D; ++j) {
                const int64_t src = ((b * H + h) * S + s) * D + j, dst = (b * S + s) * N + h * D + j;
                ybuf[dst] = Yv[src];
                dyb[dst] = dY[src];
              }
        Yv = ybuf.data();
        dz.swap(dyb);
        dY = dz.data();
      }
      const float* Z = nullptr;
      const Act act = this->act(xT.shape);
      if (act_needs_preactivation(act, p_.slope)) {
        zbuf.resize(M * N);
        sgemm('N', 'T', M, N, K, 1.f, X, K, W, K, 0.f, zbuf.data(), N);
        if (bias) {
#pragma omp parallel for
          for (int64_t i = 0; i < M; ++i)
            for (int64_t j = 0; j < N; ++j) zbuf[i * N + j] += bias[j];
        }
        Z = zbuf.data();
      }
      std::vector<float> dzz(M * N);
#pragma omp parallel for
      for (int64_t i = 0; i < M; ++i)
        act_backward(act, p_.slope, Z ? Z + i * N : nullptr, Yv + i * N, dY + i * N,
                     dzz.data() + i * N, N);
      sgemm('N', 'N', M, K, N, 1.f, dzz.data(), N, W, K, 0.f, (*out)[0].data<float>(), K);
      sgemm('T', 'N', N, K, M, 1.f, dzz.data(), N, X, K, 0.f, (*out)[1].data<float>(), K);
      if (!p_.no_bias) {
        float* db = (*out)[2].data<float>();
        std::fill(db, db + N, 0.f);
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < N; ++j) db[j] += dzz[i * N + j];
      }
    }
  }

 private:
  // The activation MXNet computes after FullyConnected: its output has rank 2
  // (flatten=True) or the rank of x, which decides oneDNN's forms (see resolve_act).
  Act act(const std::vector<int64_t>& xs) const {
    return resolve_act(p_.act, p_.flatten ? 2 : static_cast<int>(xs.size()), dnnl_enabled());
  }

  Attrs attrs_;
  DenseParams p_;
  std::mutex mu_;
  std::vector<float> wt_;
  ParamVersion w_version_;    // the weight the packed forms below were made from
  bool packed_ = false;
  std::unique_ptr<PackedMatmul> mm_;  // plain output, weight used again: oneDNN matmul
  bool mm_failed_ = false;
  ParamVersion wmax_version_;  // the bfloat16 weight whose largest magnitude wmax_ holds
  uint32_t wmax_ = 0;
  std::vector<float> wf_;          // a float16 weight widened (widened_weight)
  ParamVersion w16_version_;       // the float16 weight wf_ holds widened
  size_t wf_ver_ = 0;
};

MXReturnValue create_state(const Attrs& a, const mxnet::ext::MXContext&,
                           const std::vector<Shape>&, const std::vector<int>,
                           mxnet::ext::CustomStatefulOp** op) {
  return guarded("fused_dense", [&] {
    *op = mxnet::ext::CustomStatefulOp::create<DenseOp>(a);
  });
}

}  // namespace

REGISTER_OP(fused_dense)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setCreateOpState(create_state, "cpu")
#if MXF_WITH_CUDA
    .setCreateOpState(mxf::gpu::dense_create_state, "gpu")
#endif
    ;
