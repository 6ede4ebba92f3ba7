// AVX-512 vector math shared by the CPU kernels: exp, reciprocal, sigmoid, tanh, erf on
// 16 floats.  Each function carries its own target attribute, so this header may be
// included from files built for the library's baseline (x86-64-v3); call the functions
// only when cpu_has_avx512() says the CPU has the instructions.
//
// GCC vectorizes the portable scalar forms (act.h, mxf_common.h) well, but each still
// ends in a true division (vdivps), the slowest vector instruction on the CPUs we
// measured, and building 2^n for exp takes integer shifts plus range selects.  Here exp
// scales with vscalefps (which also yields inf/0 at the range ends) and every reciprocal
// is vrcp14ps refined by one Newton step (relative error ~2^-28, below float rounding).
// Same accuracy contract as the scalar forms:
//   exp     ~1 ulp, subnormal results included; inf -> inf, -inf -> 0, NaN -> NaN
//   sigmoid 1 / (1 + exp(-x)) as MXNet computes it: 0 once exp(-x) overflows (x < -88.72),
//           subnormal just above, relative error < 2.5e-7
//   tanh    as fast_tanh (act.h): ~2 ulp
//   erf     as fast_erf (act.h): ~2 ulp
#pragma once
#include <cstdint>

#include "act.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>

#define MXF_HAVE_AVX512_PATH 1
#define MXF_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

namespace mxf {
namespace vmath {

// exp of x already clamped to [-104, 89] (a NaN passes through the arithmetic)
MXF_AVX512 inline __m512 exp16_clamped(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  // e^r = 1 + r + r^2 (1/2 + r (1/6 + ...)), Horner all the way down
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);  // p * 2^n: overflows to inf, underflows to 0
}

MXF_AVX512 inline __m512 exp16(__m512 x) {
  // clamp (NaN passes: max/min return their second operand when one is NaN)
  return exp16_clamped(
      _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x)));
}

MXF_AVX512 inline __m512 recip16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

// The largest float whose exp is finite (ln FLT_MAX rounds up to the next float, whose
// exp overflows).
constexpr float kExpMaxArg = 88.72283172607421875f;

// 1 / (1 + exp(u)), i.e. sigmoid(-u): callers that scale their input anyway pass -x
// for free.  As MXNet's 1 / (1 + expf(u)): 0 where exp(u) overflows (u > kExpMaxArg), and
// a subnormal just below, divided exactly (the reciprocal estimate flushes those to 0).
// exp(u) is kept finite so that the Newton step never sees inf * 0.  NaN stays NaN.
MXF_AVX512 inline __m512 sigmoid_neg16(__m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 uc = _mm512_min_ps(_mm512_set1_ps(kExpMaxArg), _mm512_max_ps(_mm512_set1_ps(-104.0f), u));
  const __m512 d = _mm512_add_ps(one, exp16_clamped(uc));
  __m512 r = recip16(d);
  const __mmask16 sub = _mm512_cmp_ps_mask(d, _mm512_set1_ps(8.5070592e37f), _CMP_GT_OQ);  // 1/d < 2^-126
  if (sub) r = _mm512_mask_div_ps(r, sub, one, d);
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(u, _mm512_set1_ps(kExpMaxArg), _CMP_GT_OQ),
                            _mm512_setzero_ps());
}

MXF_AVX512 inline __m512 sigmoid16(__m512 x) {
  return sigmoid_neg16(_mm512_sub_ps(_mm512_setzero_ps(), x));
}

// tanh as fast_tanh (act.h): x + x s P(s) below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) above
MXF_AVX512 inline __m512 tanh16(__m512 x) {
  const __m512 sign = _mm512_and_ps(x, _mm512_set1_ps(-0.0f));
  const __m512 ax = _mm512_andnot_ps(_mm512_set1_ps(-0.0f), x);
  const __m512 s = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(kTanhP[4]);
  for (int k = 3; k >= 0; --k) p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kTanhP[k]));
  const __m512 small = _mm512_or_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, s), x, x), sign);  // keeps -0
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(kTanhClip), ax);  // NaN passes (second operand)
  const __m512 e = exp16_clamped(_mm512_add_ps(a, a));              // finite: 2|x| <= 20
  const __m512 big = _mm512_fnmadd_ps(_mm512_set1_ps(2.0f), recip16(_mm512_add_ps(e, _mm512_set1_ps(1.0f))),
                                      _mm512_set1_ps(1.0f));
  const __mmask16 lo = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(kTanhSplit), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(lo, _mm512_or_ps(big, sign), small);
}

// erf as fast_erf (act.h): x P(x^2) below |x| = 0.921875, 1 - exp(R(|x|)) above
MXF_AVX512 inline __m512 erf16(__m512 x) {
  const __m512 sign = _mm512_and_ps(x, _mm512_set1_ps(-0.0f));
  const __m512 ax = _mm512_andnot_ps(_mm512_set1_ps(-0.0f), x);
  const __m512 s = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(kErfSmallP[5]);
  for (int k = 4; k >= 0; --k) p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kErfSmallP[k]));
  const __m512 a = _mm512_min_ps(_mm512_set1_ps(kErfCap), ax);  // NaN passes (second operand)
  __m512 r = _mm512_set1_ps(kErfLargeR[8]);
  for (int k = 7; k >= 0; --k) r = _mm512_fmadd_ps(r, a, _mm512_set1_ps(kErfLargeR[k]));
  const __m512 big = _mm512_sub_ps(_mm512_set1_ps(1.0f), exp16_clamped(r));  // r in [-17, -0.9]
  const __mmask16 lo = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(kErfSplit), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(lo, _mm512_or_ps(big, sign), _mm512_mul_ps(x, p));
}

// MXNet's gelu, 0.5 x (1 + erf(x / sqrt 2)) (erf's argument as a product by 1/sqrt 2)
MXF_AVX512 inline __m512 gelu_erf16(__m512 v) {
  const __m512 e = erf16(_mm512_mul_ps(v, _mm512_set1_ps(0.70710678118654752f)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), v), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// The first min(max(n, 0), 16) lanes.
inline __mmask16 tail_mask16(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1u);
}

// float32 bits (16 lanes) -> their bfloat16 bits in each lane's low half: rounded to nearest even,
// a NaN kept quiet with its payload's top bits (the scalar to_bf16's arithmetic, dnnl_matmul.cc)
MXF_AVX512 inline __m512i bf16_bits16(__m512i u) {
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}

// o = f(a) over n floats, a masked tail included (o may equal a)
template <class F>
MXF_AVX512 inline void map16(const float* a, float* o, int64_t n, F f) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, f(_mm512_loadu_ps(a + i)));
  if (i < n) {
    const __mmask16 m = tail_mask16(n - i);
    _mm512_mask_storeu_ps(o + i, m, f(_mm512_maskz_loadu_ps(m, a + i)));
  }
}

}  // namespace vmath
}  // namespace mxf
#endif

namespace mxf {
// True when the CPU has AVX-512 F/DQ and MXFUSION_DISABLE_AVX512 is not set (then the
// portable loops run everywhere; the tests compare both).
bool cpu_has_avx512();
// x = act(x) in place for sigmoid, tanh, gelu_erf (both forms), gelu_tanh; false (x
// untouched) for the other activations.  Call only when cpu_has_avx512().
bool act_forward_avx512(Act a, float* x, int64_t n);
// Softmax pieces for the attention kernel (call only when cpu_has_avx512()):
// the maximum of s[0, n) (-inf when n == 0; NaN is ignored as by a > b ? a : b) ...
float row_max_avx512(const float* s, int64_t n);
// ... and s[c] = exp(s[c] - m) in place, returning the sum of the new values.
float exp_shift_sum_avx512(float* s, int64_t n, float m);
// to_bf16 / from_bf16 (dnnl_matmul.h) on 16 lanes, the same bits (call only when cpu_has_avx512())
void to_bf16_avx512(const float* x, uint16_t* y, int64_t n);
void from_bf16_avx512(const uint16_t* x, float* y, int64_t n);
}  // namespace mxf
