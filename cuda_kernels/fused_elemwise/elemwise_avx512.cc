// AVX-512 loops for fused_elemwise's unary ops, on the vector math of
// common/vmath_avx512.h.  Each also applies the forward plan's pre-scale a * s + t of its
// operand in the same pass (Program::fwd), and so does `affine` alone, so scalar
// arithmetic feeding them costs no pass of its own.
#include "elemwise_avx512.h"

#include "expr_program.h"
#include "vmath_avx512.h"

namespace mxf {
namespace expr {

#ifdef MXF_HAVE_AVX512_PATH
using namespace mxf::vmath;
namespace {

// o = f((a * s) + t) over n floats; PRE: 0 none, 1 a * s, 2 (a * s) + t.  The product and
// the sum round separately, as MXNet's two scalar ops do (the explicit-rounding forms keep
// the compiler from contracting them into one fused multiply-add).
template <int PRE, class F>
MXF_AVX512 inline void map16s(const float* a, float s, float t, float* o, int64_t n, F f) {
  const __m512 vs = _mm512_set1_ps(s), vt = _mm512_set1_ps(t);
  map16(a, o, n, [&](__m512 v) MXF_AVX512 {
    if (PRE == 0) return f(v);
    const __m512 p = _mm512_mul_round_ps(v, vs, _MM_FROUND_CUR_DIRECTION);
    return f(PRE == 1 ? p : _mm512_add_round_ps(p, vt, _MM_FROUND_CUR_DIRECTION));
  });
}

template <class F>
MXF_AVX512 inline void map16s(const float* a, float s, float t, float* o, int64_t n, F f) {
  if (s == 1.f && neutral_addend(t)) map16s<0>(a, s, t, o, n, f);
  else if (neutral_addend(t)) map16s<1>(a, s, t, o, n, f);
  else map16s<2>(a, s, t, o, n, f);
}

}  // namespace

MXF_AVX512 bool eval_unary_avx512(int op, const float* a, float s, float t, float* o, int64_t n) {
  switch (op) {
    case AFFINE: map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return v; }); return true;
    case EXP: map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return exp16(v); }); return true;
    case SIGMOID:  // sigmoid(a s + t) = 1 / (1 + exp(a (-s) + (-t))): the negation is free
      map16s(a, -s, -t, o, n, [](__m512 v) MXF_AVX512 { return sigmoid_neg16(v); });
      return true;
    case TANH: map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return tanh16(v); }); return true;
    case ERF: map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return erf16(v); }); return true;
    case RELU:  // MXNet's relu: v <= 0 ? +0 : v, so NaN stays NaN
      map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 {
        return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LE_OQ),
                                  _mm512_setzero_ps());
      });
      return true;
    case RELU_DNNL:  // oneDNN's relu: v > 0 ? v : +0, so NaN gives 0
      map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 {
        return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ), v);
      });
      return true;
    case GELU: map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 { return gelu_erf16(v); }); return true;
    case GELU_DNNL:  // oneDNN gives +0 where the result is zero
      map16s(a, s, t, o, n, [](__m512 v) MXF_AVX512 {
        return _mm512_add_ps(gelu_erf16(v), _mm512_setzero_ps());
      });
      return true;
    default: return false;
  }
}

#else  // not x86-64 GCC: the portable loops only
bool eval_unary_avx512(int, const float*, float, float, float*, int64_t) { return false; }
#endif

}  // namespace expr
}  // namespace mxf
