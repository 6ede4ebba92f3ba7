// AVX-512 activations for fused_dense's epilogue (see vmath_avx512.h) and the run-time
// CPU check shared with fused_elemwise.
#include "vmath_avx512.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace mxf {

#ifdef MXF_HAVE_AVX512_PATH
bool cpu_has_avx512() {
  static const bool has = [] {
    const char* off = std::getenv("MXFUSION_DISABLE_AVX512");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}

MXF_AVX512 bool act_forward_avx512(Act a, float* x, int64_t n) {
  using namespace vmath;
  switch (a) {
    case Act::sigmoid: map16(x, x, n, [](__m512 v) MXF_AVX512 { return sigmoid16(v); }); return true;
    case Act::tanh: map16(x, x, n, [](__m512 v) MXF_AVX512 { return tanh16(v); }); return true;
    case Act::gelu_erf:  // 0.5 x (1 + erf(x / sqrt 2))
      map16(x, x, n, [](__m512 v) MXF_AVX512 { return gelu_erf16(v); });
      return true;
    case Act::gelu_erf_dnnl:  // oneDNN gives +0 where the result is zero
      map16(x, x, n, [](__m512 v) MXF_AVX512 {
        return _mm512_add_ps(gelu_erf16(v), _mm512_setzero_ps());
      });
      return true;
    case Act::gelu_tanh:  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
      map16(x, x, n, [](__m512 v) MXF_AVX512 {
        const __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(v, v), v);
        const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.79788456080286536f),
                                       _mm512_fmadd_ps(v3, _mm512_set1_ps(0.044715f), v));
        return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v),
                             _mm512_add_ps(_mm512_set1_ps(1.0f), tanh16(u)));
      });
      return true;
    default: return false;
  }
}
// float32 -> bfloat16 bits, rounded to nearest even, a NaN kept quiet with its payload's top
// bits: the scalar to_bf16's arithmetic (dnnl_matmul.cc) on 16 lanes, so the bits are the same
// (vcvtneps2bf16 is not used: it flushes subnormal inputs to zero)
MXF_AVX512 void to_bf16_avx512(const float* x, uint16_t* y, int64_t n) {
  using vmath::bf16_bits16;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        _mm512_cvtepi32_epi16(bf16_bits16(_mm512_loadu_si512(x + i))));
  if (i < n) {
    const __mmask16 m = vmath::tail_mask16(n - i);
    _mm512_mask_cvtepi32_storeu_epi16(y + i, m, bf16_bits16(_mm512_maskz_loadu_epi32(m, x + i)));
  }
}

MXF_AVX512 void from_bf16_avx512(const uint16_t* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_si512(y + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16));
  for (; i < n; ++i) {  // the tail: 16-bit masked loads would need AVX-512 BW
    const uint32_t u = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(y + i, &u, 4);
  }
}

MXF_AVX512 float row_max_avx512(const float* s, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // a > m ? a : m, so a NaN score never becomes the max
    const __m512 a = _mm512_loadu_ps(s + i);
    m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, m, _CMP_GT_OQ), m, a);
  }
  if (i < n) {
    const __mmask16 k = vmath::tail_mask16(n - i);
    const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + i);
    m = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, m, _CMP_GT_OQ), m, a);
  }
  return _mm512_reduce_max_ps(m);
}

MXF_AVX512 float exp_shift_sum_avx512(float* s, int64_t n, float m) {
  using namespace vmath;
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 k = vmath::tail_mask16(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
    _mm512_mask_storeu_ps(s + i, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
}
#else
bool cpu_has_avx512() { return false; }
bool act_forward_avx512(Act, float*, int64_t) { return false; }
void to_bf16_avx512(const float*, uint16_t*, int64_t) {}
void from_bf16_avx512(const uint16_t*, float*, int64_t) {}
float row_max_avx512(const float*, int64_t) { return -INFINITY; }
float exp_shift_sum_avx512(float*, int64_t, float) { return 0.f; }
#endif

}  // namespace mxf
