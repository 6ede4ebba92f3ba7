// The fused_elemwise expression language, parsed once into SSA bytecode.
// Depends only on the C++ standard library so the CUDA library can reuse it.
//
//   expr   := call | input | number
//   input  := 'x' DIGITS                      x0 is the op's first input
//   number := C float literal, or inf / -inf / nan  (e.g. 3, -0.5, 1e-3)
//   call   := NAME '(' expr {',' expr} ')'
//
// unary : neg abs exp log sqrt rsqrt tanh sigmoid relu erf square
//         softrelu softsign log_sigmoid mish log1p expm1  (as MXNet's Activation act_types)
// binary: add sub mul div pow max min lt le gt ge eq ne   (comparisons give 1.0 / 0.0)
// ternary: where(c, a, b)  (c != 0 ? a : b),  clip(a, lo, hi) == min(max(a, lo), hi)
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
  SOFTRELU, SOFTSIGN, LOG_SIGMOID, MISH, LOG1P, EXPM1,  // MXNet Activation act_types too
  // binary
  ADD, SUB, MUL, DIV, POW, MAX, MIN, LT, LE, GT, GE, EQ, NE,
  // ternary
  WHERE,
  // forward-plan only (never parsed): y = a * s + t, see Program::fwd
  AFFINE,
  NUM_OPS
};

// -0 is the neutral addend: x + -0 == x for every x, -0 included (see Instr::t).
inline bool neutral_addend(float t) { return t == 0.f && std::signbit(t); }

// One SSA instruction: value i = op(a, b, c), operands are earlier instruction indices.
// LOAD uses `input`; CONST uses `imm`.
struct Instr {
  int32_t op, a, b, c, input;
  float imm;
  // Pre-scale of operand a, used by the forward plan only: the op reads a * s + t.
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
  // instructions are dead (slot -1).  Results agree with `code` to float rounding
  // (one fused multiply-add instead of separately rounded ops; a folded chain of them
  // rounds once, sign of a zero result included).  The backward pass and
  // the CUDA kernels run `code`.
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
// Throws ExprError with the position and the problem.  `num_args` < 0: inferred.
Program compile(const std::string& text, int num_args);

}  // namespace expr
}  // namespace mxf
