// The fused_elemwise expression language, parsed once into SSA bytecode.
// Depends only on the C++ standard library so the CUDA library can reuse it.
//
//   expr   := call | input | number
//   input  := 'x' DIGITS                      x0 is the op's first input
//   number := C float literal, or inf / -inf / nan  (e.g. 3, -0.5, 1e-3)
//   call   := NAME '(' expr {',' expr} ')'
//
// Every function computes what the MXNet operator it is named after computes, NaN, inf and
// the sign of zero included (README.md has the table):
// unary : neg abs exp log sqrt rsqrt tanh sigmoid relu erf square log1p expm1
//         act_relu softrelu softsign (Activation act_types)  gelu (LeakyReLU act_type=gelu)
//         log_sigmoid mish
// binary: add sub mul div pow max min lt le gt ge eq ne   (comparisons give 1.0 / 0.0)
//         leaky(x, slope)  (LeakyReLU act_type=leaky)
// ternary: where(c, a, b)  (c != 0 ? a : b),  clip(a, lo, hi)  (MXNet's clip),
//          hard_sigmoid(x, alpha, beta)
#pragma once
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mxf {
namespace expr {

struct ExprError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum Op : int32_t {
  LOAD = 0, CONST,
  // unary
  NEG, ABS, EXP, LOG, SQRT, RSQRT, TANH, SIGMOID, RELU, ERF, SQUARE,
  SOFTRELU, SOFTSIGN, LOG_SIGMOID, MISH, LOG1P, EXPM1,
  ACT_RELU, GELU,          // MXNet runs these through oneDNN at rank 1-5: see resolve()
  RELU_DNNL, GELU_DNNL,    // what resolve() turns them into there (never parsed)
  // binary
  ADD, SUB, MUL, DIV, POW, MAX, MIN, LT, LE, GT, GE, EQ, NE,
  LEAKY, LEAKY_DNNL,       // LEAKY_DNNL: resolve()'s form of LEAKY at rank 1-5 (never parsed)
  // ternary
  WHERE, CLIP, HARD_SIGMOID,
  // forward-plan only (never parsed): y = a * s + t, see Program::fwd
  AFFINE,
  NUM_OPS
};

constexpr int kLastUnary = GELU_DNNL, kLastBinary = LEAKY_DNNL;
inline bool is_comparison(int op) { return op >= LT && op <= NE; }

// -0 is the neutral addend: x + -0 == x for every x, -0 included (see Instr::t).
inline bool neutral_addend(float t) { return t == 0.f && std::signbit(t); }

// One SSA instruction: value i = op(a, b, c), operands are earlier instruction indices.
// LOAD uses `input`; CONST uses `imm`.
struct Instr {
  int32_t op, a, b, c, input;
  float imm;
  // Pre-scale of operand a, used by the forward plan only: the op reads (a * s) + t,
  // the product and the sum rounded separately (never one fused multiply-add), which is
  // exactly what MXNet's _mul_scalar followed by _plus_scalar computes.
  // t = -0 is the neutral addend (x + -0 == x for every x, -0 included), so a product
  // alone keeps t = -0 and stays exact; x + 0 (t = +0) turns -0 into +0 as MXNet does.
  float s = 1.f, t = -0.f;
  bool pre_affine() const { return s != 1.f || !neutral_t(); }
  bool neutral_t() const { return neutral_addend(t); }
};

struct Program {
  std::vector<Instr> code;   // the last instruction is the result
  int num_inputs = 0;        // max input index + 1
  std::vector<int> load_of;  // input index -> LOAD instruction, or -1 if unused
  // Forward plan for the CPU: `code` with scalar add/sub/mul (and neg, and division by a
  // power of two) turned into AFFINE and every single-use AFFINE folded into the
  // operand of the unary op (or AFFINE) that reads it, so `x * 1.5 + 0.5 -> sigmoid`
  // is one pass over the block instead of three.  Same length as `code`; folded
  // instructions are dead (slot -1).  Results are bitwise those of `code`: a fold only
  // composes steps whose composition rounds exactly as the separate ops do (a product
  // then an addend; a negation anywhere), so overflow to inf, NaN and the sign of zero
  // come out as MXNet's separate ops give them.  The backward pass and the CUDA kernels
  // run `code`.
  std::vector<Instr> fwd;
  // Forward-only buffer plan over `fwd`: value i lives in buffer slot[i] of num_slots.  A buffer is
  // reused once every reader of its value has run (elementwise ops read element k
  // before writing element k, so an instruction may also write over a dying operand).
  // Constants keep buffers of their own (filled once); unused values get -1.
  std::vector<int> slot;
  int num_slots = 0;
};

int arity(int op);
const char* op_name(int op);

// The op MXNet actually runs for `op` on a value of rank `rank`: on the CPU, MXNet 1.9
// computes Activation(relu) and LeakyReLU(leaky|gelu) with oneDNN for ranks 1-5 (unless
// MXNET_MKLDNN_ENABLED=0) and with its own kernels otherwise, and the two differ on
// NaN (relu), in the sign of zero (gelu) and in the backward pass on NaN and for negative
// slopes (leaky).  Every other op is returned unchanged.  `dnnl`: whether oneDNN is on.
int resolve(int op, int rank, bool dnnl);
// MXNet's switch for its oneDNN kernels (MXNET_MKLDNN_ENABLED, default on).
bool mxnet_dnnl_enabled();
// Throws ExprError with the position and the problem.  `num_args` < 0: inferred.
Program compile(const std::string& text, int num_args);

}  // namespace expr
}  // namespace mxf
