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
  NUM_OPS
};

// One SSA instruction: value i = op(a, b, c), operands are earlier instruction indices.
// LOAD uses `input`; CONST uses `imm`.
struct Instr {
  int32_t op, a, b, c, input;
  float imm;
};

struct Program {
  std::vector<Instr> code;   // the last instruction is the result
  int num_inputs = 0;        // max input index + 1
  std::vector<int> load_of;  // input index -> LOAD instruction, or -1 if unused
};

int arity(int op);
const char* op_name(int op);
// Throws ExprError with the position and the problem.  `num_args` < 0: inferred.
Program compile(const std::string& text, int num_args);

}  // namespace expr
}  // namespace mxf
