// Hand-vectorized AVX-512 kernels for the transcendental unary ops of fused_elemwise.
//
// GCC vectorizes the portable scalar forms (act.h, mxf_common.h) well, but each still
// ends in a true division (vdivps), the slowest vector instruction on the CPUs we
// measured; and building 2^n for exp takes integer shifts plus range selects.  Here
// exp scales with vscalefps (which also yields inf/0 at the range ends) and every
// reciprocal is vrcp14ps refined by one Newton step (relative error ~2^-28, below
// float rounding).  Same accuracy contract as the scalar forms:
//   exp     ~2 ulp; inf -> inf, -inf -> 0, NaN -> NaN
//   sigmoid 1 / (1 + exp(-x)), relative error < 2.5e-7
//   tanh    the rational fit of act.h, < 4e-7 relative
// Each also applies the forward plan's pre-scale a * s + t of its operand in the same
// pass (Program::fwd), and so does `affine` alone, so scalar arithmetic feeding them
// costs no pass of its own.
// Picked at run time (cpu_has_avx512) so the library still runs on AVX2-only CPUs;
// MXFUSION_DISABLE_AVX512=1 forces the portable loops (the tests compare both).
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "act.h"
#include "elemwise_avx512.h"
#include "expr_program.h"

namespace mxf {
namespace expr {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define MXF_AVX512 __attribute__((target("avx512f,avx512dq,fma")))

namespace {

MXF_AVX512 inline __m512 exp16(__m512 x) {
  // clamp (NaN passes: max/min return their second operand when one is NaN)
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n: overflows to inf, underflows to 0
}

MXF_AVX512 inline __m512 recip16(__m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
}

MXF_AVX512 inline __m512 sigmoid16(__m512 x) {
  // exp(-x) is kept finite (<= e^88) so that the Newton step never sees inf * 0
  const __m512 nx = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_sub_ps(_mm512_setzero_ps(), x));
  return recip16(_mm512_add_ps(_mm512_set1_ps(1.0f), exp16(nx)));
}

MXF_AVX512 inline __m512 tanh16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(kTanhClip), _mm512_max_ps(_mm512_set1_ps(-kTanhClip), x));
  const __m512 s = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(kTanhP[5]);
  for (int k = 4; k >= 0; --k) p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(kTanhP[k]));
  __m512 q = _mm512_set1_ps(kTanhQ[3]);
  for (int k = 2; k >= 0; --k) q = _mm512_fmadd_ps(q, s, _mm512_set1_ps(kTanhQ[k]));
  const __m512 t = _mm512_mul_ps(_mm512_mul_ps(x, p), recip16(q));
  return _mm512_min_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(_mm512_set1_ps(-1.0f), t));
}

// o = f(a * s + t) over n floats; PRE: 0 none, 1 a * s, 2 a * s + t
template <int PRE, class F>
MXF_AVX512 inline void map16(const float* a, float s, float t, float* o, int64_t n, F f) {
  const __m512 vs = _mm512_set1_ps(s), vt = _mm512_set1_ps(t);
  auto pre = [&](__m512 v) MXF_AVX512 {
    return PRE == 0 ? v : PRE == 1 ? _mm512_mul_ps(v, vs) : _mm512_fmadd_ps(v, vs, vt);
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, f(pre(_mm512_loadu_ps(a + i))));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
    _mm512_mask_storeu_ps(o + i, m, f(pre(_mm512_maskz_loadu_ps(m, a + i))));
  }
}

template <class F>
MXF_AVX512 inline void map16(const float* a, float s, float t, float* o, int64_t n, F f) {
  const bool neutral_t = t == 0.f && std::signbit(t);  // -0: x + t == x, see Instr::t
  if (s == 1.f && neutral_t) map16<0>(a, s, t, o, n, f);
  else if (neutral_t) map16<1>(a, s, t, o, n, f);
  else map16<2>(a, s, t, o, n, f);
}

}  // namespace

bool cpu_has_avx512() {
  static const bool has = [] {
    const char* off = std::getenv("MXFUSION_DISABLE_AVX512");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}

MXF_AVX512 bool eval_unary_avx512(int op, const float* a, float s, float t, float* o, int64_t n) {
  switch (op) {
    case AFFINE: map16(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return v; }); return true;
    case EXP: map16(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return exp16(v); }); return true;
    case SIGMOID: map16(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return sigmoid16(v); }); return true;
    case TANH: map16(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return tanh16(v); }); return true;
    case RELU:  // a > 0 ? a : 0, NaN included, as the portable loop
      map16(a, s, t, o, n, [](__m512 v) MXF_AVX512 {
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ),
                                    _mm512_setzero_ps(), v);
      });
      return true;
    default: return false;
  }
}

#else  // not x86-64 GCC: the portable loops only
bool cpu_has_avx512() { return false; }
bool eval_unary_avx512(int, const float*, float, float, float*, int64_t) { return false; }
#endif

}  // namespace expr
}  // namespace mxf
