// Block evaluation of an expression program on the CPU (shared by forward/backward).
#pragma once
#include <cmath>
#include <cstring>

#include "act.h"
#include "expr_program.h"

namespace mxf {
namespace expr {

// Elements per block.  Every instruction is one vector loop over a block, so a block's
// live values (a few buffers after slot reuse, see Program::slot) must stay in L1: 256
// floats is 1 KiB per value.  Threads take kChunk blocks at a time.
constexpr int64_t kBlock = 256;
constexpr int kChunk = 64;
constexpr int64_t kSlot = kBlock + 48;

// The vector loops are compiled twice and picked at load time: AVX-512 where the CPU
// has it, the library's baseline (x86-64-v3) elsewhere.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define MXF_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define MXF_CLONES
#endif

#include "no_contract.h"

// MXNet's softrelu: x > 20 ? x : log1p(exp(x))
inline float softrelu(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// MXNet's gelu (mshadow_op::gelu): 0.5 x (1 + erf(x / sqrt 2)), in float
constexpr float kSqrt2f = 1.41421356237309504880f;
inline float gelu(float x) { return 0.5f * x * (1.f + fast_erf(x / kSqrt2f)); }

// o = (a * s) + t, product and sum rounded separately as MXNet's two scalar ops round
// them; t = -0 is the neutral addend (a plain product), see Instr::t
MXF_CLONES MXF_NO_CONTRACT void eval_affine(const float* a, float s, float t, float* o, int64_t n) {
  if (neutral_addend(t)) for (int64_t i = 0; i < n; ++i) o[i] = a[i] * s;
  else if (s == 1.f) for (int64_t i = 0; i < n; ++i) o[i] = a[i] + t;
  else for (int64_t i = 0; i < n; ++i) o[i] = a[i] * s + t;
}

MXF_CLONES void eval_unary(int op, const float* a, float* o, int64_t n) {
  switch (op) {
    case NEG: for (int64_t i = 0; i < n; ++i) o[i] = -a[i]; break;
    case ABS: for (int64_t i = 0; i < n; ++i) o[i] = std::fabs(a[i]); break;
    case EXP: for (int64_t i = 0; i < n; ++i) o[i] = exp_full(a[i]); break;
    case LOG: for (int64_t i = 0; i < n; ++i) o[i] = std::log(a[i]); break;
    case SQRT: for (int64_t i = 0; i < n; ++i) o[i] = std::sqrt(a[i]); break;
    case RSQRT: for (int64_t i = 0; i < n; ++i) o[i] = 1.f / std::sqrt(a[i]); break;
    case TANH: for (int64_t i = 0; i < n; ++i) o[i] = fast_tanh(a[i]); break;
    case SIGMOID: for (int64_t i = 0; i < n; ++i) o[i] = fast_sigmoid(a[i]); break;
    // MXNet's relu keeps NaN (IsNan(a) || a > 0 ? a : 0); -0 gives +0
    case RELU: for (int64_t i = 0; i < n; ++i) o[i] = !(a[i] <= 0.f) ? a[i] : 0.f; break;
    // oneDNN's relu (Activation at rank 1-5): max(x, 0), NaN gives 0
    case RELU_DNNL: for (int64_t i = 0; i < n; ++i) o[i] = a[i] > 0.f ? a[i] : 0.f; break;
    case ERF: for (int64_t i = 0; i < n; ++i) o[i] = fast_erf(a[i]); break;
    case SQUARE: for (int64_t i = 0; i < n; ++i) o[i] = a[i] * a[i]; break;
    case SOFTRELU: for (int64_t i = 0; i < n; ++i) o[i] = softrelu(a[i]); break;
    case SOFTSIGN: for (int64_t i = 0; i < n; ++i) o[i] = a[i] / (1.f + std::fabs(a[i])); break;
    case LOG_SIGMOID: for (int64_t i = 0; i < n; ++i) o[i] = -softrelu(-a[i]); break;
    case MISH: for (int64_t i = 0; i < n; ++i) o[i] = a[i] * fast_tanh(softrelu(a[i])); break;
    case LOG1P: for (int64_t i = 0; i < n; ++i) o[i] = std::log1p(a[i]); break;
    case EXPM1: for (int64_t i = 0; i < n; ++i) o[i] = std::expm1(a[i]); break;
    case GELU: for (int64_t i = 0; i < n; ++i) o[i] = gelu(a[i]); break;
    // oneDNN's gelu gives +0 where the result is zero (-0 in, or an underflow for x << 0)
    case GELU_DNNL: for (int64_t i = 0; i < n; ++i) o[i] = gelu(a[i]) + 0.f; break;
  }
}

// Binary ops; `sa` / `sb` say that operand a / b is a scalar (a constant), read once
// instead of from a block array, which keeps the working set in L1.
template <bool SA, bool SB>
inline void binary_loop(int op, const float* a, const float* b, float* o, int64_t n) {
#define MXF_BIN(CODE, EXPR)                                        \
  case CODE:                                                       \
    for (int64_t i = 0; i < n; ++i) {                              \
      const float x = SA ? a[0] : a[i], y = SB ? b[0] : b[i];      \
      o[i] = (EXPR);                                               \
    }                                                              \
    break;
  switch (op) {
    MXF_BIN(ADD, x + y)
    MXF_BIN(SUB, x - y)
    MXF_BIN(MUL, x * y)
    MXF_BIN(DIV, x / y)
    MXF_BIN(POW, std::pow(x, y))
    // MXNet's maximum / minimum: a NaN left operand wins, else a > b ? a : b (so a NaN
    // right operand, and the right one of a tie such as max(+0, -0), is the result)
    MXF_BIN(MAX, (x != x || x > y) ? x : y)
    MXF_BIN(MIN, (x != x || x < y) ? x : y)
    MXF_BIN(LT, x < y ? 1.f : 0.f)
    MXF_BIN(LE, x <= y ? 1.f : 0.f)
    MXF_BIN(GT, x > y ? 1.f : 0.f)
    MXF_BIN(GE, x >= y ? 1.f : 0.f)
    MXF_BIN(EQ, x == y ? 1.f : 0.f)
    MXF_BIN(NE, x != y ? 1.f : 0.f)
    // LeakyReLU(leaky): x > 0 ? x : x * slope; oneDNN computes slope 0 as max(x, 0)
    // (NaN, -inf and -0 give +0 there)
    MXF_BIN(LEAKY, x > 0.f ? x : x * y)
    MXF_BIN(LEAKY_DNNL, x > 0.f ? x : (y == 0.f ? 0.f : x * y))
  }
#undef MXF_BIN
}

MXF_CLONES void eval_binary(int op, const float* a, bool sa, const float* b, bool sb, float* o,
                            int64_t n) {
  if (sa && !sb) binary_loop<true, false>(op, a, b, o, n);
  else if (!sa && sb) binary_loop<false, true>(op, a, b, o, n);
  else if (sa && sb) binary_loop<true, true>(op, a, b, o, n);
  else binary_loop<false, false>(op, a, b, o, n);
}

// Ternary ops over block arrays (constants are arrays filled once, see fill_consts).
MXF_CLONES MXF_NO_CONTRACT void eval_ternary(int op, const float* c, const float* a,
                                             const float* b, float* o, int64_t n) {
  switch (op) {
    case WHERE: for (int64_t i = 0; i < n; ++i) o[i] = c[i] != 0.f ? a[i] : b[i]; break;
    case CLIP:  // MXNet's clip: x > hi ? hi : x < lo ? lo : x (NaN stays NaN)
      for (int64_t i = 0; i < n; ++i) {
        const float x = c[i];
        o[i] = x > b[i] ? b[i] : (x < a[i] ? a[i] : x);
      }
      break;
    case HARD_SIGMOID:  // MXNet: r = alpha x + beta (two roundings); 1 < r ? 1 : r; 0 > r ? 0 : r
      for (int64_t i = 0; i < n; ++i) {
        float r = a[i] * c[i] + b[i];
        r = 1.f < r ? 1.f : r;
        o[i] = 0.f > r ? 0.f : r;
      }
      break;
  }
}

}  // namespace expr
}  // namespace mxf
