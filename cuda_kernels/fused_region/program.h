// fused_region's program (README.md, "The program"): parsed from its JSON, checked, and its values'
// shapes inferred.  Nothing here touches oneDNN: the op's shape inference runs it on any machine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mxf {
namespace region {

using Dims = std::vector<int64_t>;

enum class OpKind { Conv, Deconv, Pool, Concat, Add, Mul, BatchNorm, Act };
const char* op_name(OpKind k);

// The eltwise functions of a post step (README's table), each oneDNN's eltwise algorithm.
enum class Elt { Relu, Clip, Sigmoid, Tanh, SoftRelu, Leaky, Elu, Gelu, Swish, HardSwish, HardSigmoid, Linear };

struct Step {
  enum Kind { Eltwise, Add, Mul } kind = Eltwise;
  Elt elt = Elt::Relu;
  float a = 0.f, b = 0.f;  // clip: lo, hi; leaky: slope; elu: alpha; hard_sigmoid: alpha, beta; linear: scale, shift
  int value = -1;          // add / mul: the value read
};

struct Op {
  OpKind kind = OpKind::Act;
  std::vector<int> in;  // values read (conv, pool, batchnorm, act: one)
  std::vector<Step> post;
  // conv, deconv (a deconv has one group; its weight is MXNet's (C, O, KH, KW))
  int weight = -1, bias = -1;  // parameter numbers (bias -1: none)
  int64_t kernel[2] = {1, 1}, stride[2] = {1, 1}, pad[2] = {0, 0}, dilate[2] = {1, 1};
  int64_t groups = 1, filters = 0;
  int64_t adj[2] = {0, 0};  // deconv: extra output rows / columns at the end
  // pool
  bool max = true, full = false, include_pad = true, global = false;
  // batchnorm
  int gamma = -1, beta = -1, mean = -1, var = -1;
  float eps = 1e-3f;
  bool fix_gamma = true;
};

struct Program {
  int num_data = 0;
  std::vector<Dims> params;
  std::vector<Op> ops;
  std::vector<int> outputs;
  int num_values() const { return num_data + static_cast<int>(ops.size()); }
};

// Parses and checks the program's structure (fields, kinds, value and parameter numbers, each read
// of a value made before); a std::runtime_error with a one-line message naming the op (its index)
// and the field otherwise.
Program parse_program(const std::string& text, int num_data);

// Every value's shape (data inputs first, then one per op) from the data inputs' shapes, checking
// each op's operands and parameters' shapes; a one-line error naming the op and field otherwise.
std::vector<Dims> infer_values(const Program& p, const std::vector<Dims>& data);

// The output plane size of a pooling along one axis (MXNet's Pooling: floor for `valid`, ceil for
// `full`), and the right padding that makes oneDNN give that size.
int64_t pool_out(const Op& op, int64_t in, int axis);
int64_t pool_pad_right(const Op& op, int64_t in, int axis);

std::string dims_str(const Dims& d);

}  // namespace region
}  // namespace mxf
