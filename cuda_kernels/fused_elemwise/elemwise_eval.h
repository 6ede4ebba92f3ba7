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

// MXNet's softrelu: x > 20 ? x : log1p(exp(x))
inline float softrelu(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

// o = a * s + t; t = -0 is the neutral addend (a plain product), see Instr::t
MXF_CLONES void eval_affine(const float* a, float s, float t, float* o, int64_t n) {
  if (neutral_addend(t)) for (int64_t i = 0; i < n; ++i) o[i] = a[i] * s;
  else if (s == 1.f) for (int64_t i = 0; i < n; ++i) o[i] = a[i] + t;
  else for (int64_t i = 0; i < n; ++i) o[i] = a[i] * s + t;
}

MXF_CLONES void eval_unary(int op, const float* a, float* o, int64_t n) {
  switch (op) {
    case NEG: for (int64_t i = 0; i < n; ++i) o[i] = -a[i]; break;
    case ABS: for (int64_t i = 0; i < n; ++i) o[i] = std::fabs(a[i]); break;
    case EXP: for (int64_t i = 0; i < n; ++i) o[i] = fast_exp(a[i]); break;
    case LOG: for (int64_t i = 0; i < n; ++i) o[i] = std::log(a[i]); break;
    case SQRT: for (int64_t i = 0; i < n; ++i) o[i] = std::sqrt(a[i]); break;
    case RSQRT: for (int64_t i = 0; i < n; ++i) o[i] = 1.f / std::sqrt(a[i]); break;
    case TANH: for (int64_t i = 0; i < n; ++i) o[i] = fast_tanh(a[i]); break;
    case SIGMOID: for (int64_t i = 0; i < n; ++i) o[i] = fast_sigmoid(a[i]); break;
    case RELU: for (int64_t i = 0; i < n; ++i) o[i] = a[i] > 0.f ? a[i] : 0.f; break;
    case ERF: for (int64_t i = 0; i < n; ++i) o[i] = fast_erf(a[i]); break;
    case SQUARE: for (int64_t i = 0; i < n; ++i) o[i] = a[i] * a[i]; break;
    case SOFTRELU: for (int64_t i = 0; i < n; ++i) o[i] = softrelu(a[i]); break;
    case SOFTSIGN: for (int64_t i = 0; i < n; ++i) o[i] = a[i] / (1.f + std::fabs(a[i])); break;
    case LOG_SIGMOID: for (int64_t i = 0; i < n; ++i) o[i] = -softrelu(-a[i]); break;
    case MISH: for (int64_t i = 0; i < n; ++i) o[i] = a[i] * fast_tanh(softrelu(a[i])); break;
    case LOG1P: for (int64_t i = 0; i < n; ++i) o[i] = std::log1p(a[i]); break;
    case EXPM1: for (int64_t i = 0; i < n; ++i) o[i] = std::expm1(a[i]); break;
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
    MXF_BIN(MAX, x >= y ? x : y)
    MXF_BIN(MIN, x <= y ? x : y)
    MXF_BIN(LT, x < y ? 1.f : 0.f)
    MXF_BIN(LE, x <= y ? 1.f : 0.f)
    MXF_BIN(GT, x > y ? 1.f : 0.f)
    MXF_BIN(GE, x >= y ? 1.f : 0.f)
    MXF_BIN(EQ, x == y ? 1.f : 0.f)
    MXF_BIN(NE, x != y ? 1.f : 0.f)
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

}  // namespace expr
}  // namespace mxf
