// AVX-512 forms of fused_elemwise's transcendental unary ops (see elemwise_avx512.cc).
#pragma once
#include <cstdint>

#include "vmath_avx512.h"  // cpu_has_avx512()

namespace mxf {
namespace expr {

// o[0, n) = op((a[0, n) * s) + t) for the ops it has a kernel for (affine, exp, sigmoid,
// tanh, erf, relu and gelu in both forms); returns false, touching nothing, for any other
// op.  The product and the sum round separately; t = -0 is the neutral addend (a plain
// product; see Instr::t).  Call only when cpu_has_avx512().
bool eval_unary_avx512(int op, const float* a, float s, float t, float* o, int64_t n);

}  // namespace expr
}  // namespace mxf
