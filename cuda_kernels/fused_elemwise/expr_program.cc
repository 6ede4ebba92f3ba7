// Recursive-descent parser for the fused_elemwise expression language -> SSA bytecode.
#include "expr_program.h"

#include <array>
#include <cctype>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

namespace mxf {
namespace expr {

namespace {
struct OpInfo {
  const char* name;
  int op, arity;
};
const OpInfo kOps[] = {
    {"neg", NEG, 1}, {"abs", ABS, 1}, {"exp", EXP, 1}, {"log", LOG, 1}, {"sqrt", SQRT, 1},
    {"rsqrt", RSQRT, 1}, {"tanh", TANH, 1}, {"sigmoid", SIGMOID, 1}, {"relu", RELU, 1},
    {"erf", ERF, 1}, {"square", SQUARE, 1}, {"softrelu", SOFTRELU, 1},
    {"softsign", SOFTSIGN, 1}, {"log_sigmoid", LOG_SIGMOID, 1}, {"mish", MISH, 1},
    {"log1p", LOG1P, 1}, {"expm1", EXPM1, 1}, {"act_relu", ACT_RELU, 1}, {"gelu", GELU, 1},
    {"add", ADD, 2}, {"sub", SUB, 2}, {"mul", MUL, 2},
    {"div", DIV, 2}, {"pow", POW, 2}, {"max", MAX, 2}, {"min", MIN, 2}, {"lt", LT, 2},
    {"le", LE, 2}, {"gt", GT, 2}, {"ge", GE, 2}, {"eq", EQ, 2}, {"ne", NE, 2},
    {"leaky", LEAKY, 2}, {"where", WHERE, 3}, {"clip", CLIP, 3},
    {"hard_sigmoid", HARD_SIGMOID, 3}};
// forms resolve() gives at bind time; never parsed, named for messages
const OpInfo kResolved[] = {{"relu(oneDNN)", RELU_DNNL, 1}, {"gelu(oneDNN)", GELU_DNNL, 1},
                            {"leaky(oneDNN)", LEAKY_DNNL, 2}};

class Parser {
 public:
  Parser(const std::string& s, int num_args) : s_(s), num_args_(num_args) {}

  Program run() {
    skip();
    if (pos_ >= s_.size()) fail("empty expression");
    const int r = parse_expr();
    skip();
    if (pos_ != s_.size()) fail("unexpected '" + s_.substr(pos_, 10) + "' after the expression");
    if (r != static_cast<int>(prog_.code.size()) - 1) {
      // the whole program is an input read earlier -- cannot happen for a single
      // expression, but keep the invariant explicit
      fail("internal error: result is not the last instruction");
    }
    prog_.num_inputs = num_args_ >= 0 ? num_args_ : max_input_ + 1;
    prog_.load_of.assign(prog_.num_inputs, -1);
    for (size_t i = 0; i < prog_.code.size(); ++i)
      if (prog_.code[i].op == LOAD) prog_.load_of[prog_.code[i].input] = static_cast<int>(i);
    return prog_;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw ExprError("invalid expression '" + s_ + "' at position " + std::to_string(pos_) +
                    ": " + why);
  }
  void skip() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  // A subexpression written again (the same op of the same operands, a constant of the same
  // bits) is the same value: one instruction, whose adjoint sums every reader's before it
  // flows on -- as MXNet sums the gradients of a node read twice before that node's backward
  // (max(d, d) with d = x / 0: (g + 0) / 0 = inf there, not g / 0 + 0 / 0 = NaN).
  int emit(Instr in) {
    uint32_t bits = 0;
    std::memcpy(&bits, &in.imm, sizeof bits);
    const std::array<int64_t, 5> key{in.op, in.a, in.b, in.c, in.op == CONST ? int64_t(bits) : int64_t(in.input)};
    auto it = emitted_.find(key);
    if (it != emitted_.end()) return it->second;
    prog_.code.push_back(in);
    const int r = static_cast<int>(prog_.code.size()) - 1;
    emitted_[key] = r;
    return r;
  }
  // Emits operands before their user, so the result is always the last instruction.
  // Each input gets one LOAD, at its first use; later uses refer back to it.
  int parse_expr() {
    skip();
    if (pos_ >= s_.size()) fail("expected an expression");
    const char ch = s_[pos_];
    if (ch == 'x' && pos_ + 1 < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_ + 1]))) {
      ++pos_;
      size_t st = pos_;
      while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) ++pos_;
      const int idx = std::atoi(s_.substr(st, pos_ - st).c_str());
      if (num_args_ >= 0 && idx >= num_args_)
        fail("input x" + std::to_string(idx) + " does not exist: the op has num_args=" +
             std::to_string(num_args_) + " inputs (x0..x" + std::to_string(num_args_ - 1) + ")");
      if (idx > 4096) fail("input index too large");
      max_input_ = std::max(max_input_, idx);
      auto it = loads_.find(idx);
      if (it != loads_.end()) return it->second;
      const int r = emit({LOAD, -1, -1, -1, idx, 0.f});
      loads_[idx] = r;
      return r;
    }
    if (std::isdigit(static_cast<unsigned char>(ch)) || ch == '-' || ch == '+' || ch == '.' ||
        s_.compare(pos_, 3, "inf") == 0 || s_.compare(pos_, 3, "nan") == 0) {
      const char* begin = s_.c_str() + pos_;
      char* end = nullptr;
      const float v = std::strtof(begin, &end);
      if (end == begin) fail("expected a number");
      pos_ += end - begin;
      return emit({CONST, -1, -1, -1, -1, v});
    }
    if (std::isalpha(static_cast<unsigned char>(ch))) {
      size_t st = pos_;
      while (pos_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[pos_])) || s_[pos_] == '_'))
        ++pos_;
      const std::string name = s_.substr(st, pos_ - st);
      const OpInfo* info = nullptr;
      for (const auto& o : kOps)
        if (name == o.name) info = &o;
      if (!info) {
        pos_ = st;
        std::string known;
        for (const auto& o : kOps) known += std::string(known.empty() ? "" : " ") + o.name;
        fail("unknown function '" + name + "' (known: " + known + ")");
      }
      const int want = info->arity;
      skip();
      if (pos_ >= s_.size() || s_[pos_] != '(') fail("expected '(' after '" + name + "'");
      ++pos_;
      std::vector<int> args;
      for (;;) {
        args.push_back(parse_expr());
        skip();
        if (pos_ < s_.size() && s_[pos_] == ',') { ++pos_; continue; }
        if (pos_ < s_.size() && s_[pos_] == ')') { ++pos_; break; }
        fail("expected ',' or ')' in the arguments of '" + name + "'");
      }
      if (static_cast<int>(args.size()) != want)
        fail("'" + name + "' takes " + std::to_string(want) + " argument(s), got " +
             std::to_string(args.size()));
      return emit({info->op, args[0], want > 1 ? args[1] : -1, want > 2 ? args[2] : -1, -1, 0.f});
    }
    fail(std::string("unexpected character '") + ch + "'");
  }

  const std::string& s_;
  int num_args_;
  size_t pos_ = 0;
  int max_input_ = -1;
  std::map<int, int> loads_;
  std::map<std::array<int64_t, 5>, int> emitted_;
  Program prog_;
};
}  // namespace

int arity(int op) {
  if (op == LOAD || op == CONST) return 0;
  if (op == AFFINE) return 1;
  if (op <= kLastUnary) return 1;
  if (op <= kLastBinary) return 2;
  return 3;
}

const char* op_name(int op) {
  for (const auto& o : kOps)
    if (o.op == op) return o.name;
  for (const auto& o : kResolved)
    if (o.op == op) return o.name;
  return op == LOAD ? "load" : op == CONST ? "const" : op == AFFINE ? "affine" : "?";
}

int resolve(int op, int rank, bool dnnl) {
  const bool via_dnnl = dnnl && rank >= 1 && rank <= 5;  // MXNet's SupportMKLDNN{Act,LeakyRelu}
  if (!via_dnnl) return op == ACT_RELU ? RELU : op;
  if (op == ACT_RELU) return RELU_DNNL;
  if (op == GELU) return GELU_DNNL;
  if (op == LEAKY) return LEAKY_DNNL;
  return op;
}

bool mxnet_dnnl_enabled() {
  // dmlc::GetEnv("MXNET_MKLDNN_ENABLED", true): a bool field, "0"/"false" turn it off
  const char* e = std::getenv("MXNET_MKLDNN_ENABLED");
  if (!e || !*e) return true;
  std::string v(e);
  for (auto& ch : v) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return !(v == "0" || v == "false");
}

namespace {
bool normal_or_zero(float v) { return v == 0.f || std::fpclassify(v) == FP_NORMAL; }

// Whether the affine steps g (inner) then h (outer), each (y * s) + t with the product
// and the sum rounded separately, compose into one such step with bitwise the same
// results for every input (inf, NaN and the sign of zero included); sets (s, t).
// Rounding commutes with negation, so a pure negation composes with anything on its
// side of the sum; a product followed by an addend is itself one step.  Two products, or
// two addends, would round once instead of twice (and x * 10 * 0.1 overflows where
// x * 1 does not), so they stay separate.
bool compose(const Instr& g, const Instr& h, float* s, float* t) {
  const bool g_prod = g.neutral_t(), h_prod = h.neutral_t();  // no addend
  if (g_prod && h.s == 1.f) { *s = g.s; *t = h.t; return true; }         // (y*s1) + t2
  if (g_prod && g.s == -1.f) { *s = -h.s; *t = h.t; return true; }       // (-y)*s2 + t2
  if (g_prod && h_prod && h.s == -1.f) { *s = -g.s; *t = -0.f; return true; }  // -(y*s1)
  return false;
}

void plan_forward(Program& p) {
  std::vector<Instr>& f = p.fwd;
  f = p.code;
  const int n = static_cast<int>(f.size());
  std::vector<int> uses(n, 0);
  for (const Instr& in : f)
    for (int k : {in.a, in.b, in.c})
      if (k >= 0) ++uses[k];
  uses[n - 1] += 1;  // the result is read by the caller
  auto is_const = [&](int k) { return k >= 0 && f[k].op == CONST; };
  for (int i = 0; i < n; ++i) {
    Instr& in = f[i];
    // 1. scalar arithmetic -> AFFINE(a; s, t), one op each: x*c, x+c, x-c = x+(-c),
    //    c-x = (-x)+c, -x, x/c = x*(1/c) for c a power of two (both are the correctly
    //    rounded x/c, subnormal results included)
    float s = 1.f, t = -0.f;  // -0: the neutral addend, see Instr::t
    int x = -1, c = -1;
    if (in.op == NEG) { x = in.a; s = -1.f; }
    if ((in.op == ADD || in.op == SUB || in.op == MUL || in.op == DIV) &&
        (is_const(in.a) != is_const(in.b))) {
      const bool ca = is_const(in.a);
      x = ca ? in.b : in.a;
      c = ca ? in.a : in.b;
      const float v = f[c].imm;
      if (in.op == ADD) t = v;
      else if (in.op == MUL) s = v;
      else if (in.op == SUB) { if (ca) { s = -1.f; t = v; } else { t = -v; } }
      else if (in.op == DIV && !ca && std::isfinite(v) && v != 0.f) {
        int e;
        if (std::frexp(v, &e) == (v > 0 ? 0.5f : -0.5f) && normal_or_zero(1.f / v)) s = 1.f / v;
        else x = -1;  // x / c is not x * (1/c) in floating point unless c is a power of 2
      } else {
        x = -1;
      }
      if (!std::isfinite(s) || !std::isfinite(t)) x = -1;  // keep inf/nan constants as ops
    }
    if (x >= 0) {
      in = Instr{AFFINE, x, -1, -1, -1, 0.f, s, t};  // (x * s) + t, exactly the op it replaces
      if (c >= 0) --uses[c];
    }
    // 2. fold a single-use AFFINE operand into this op's pre-affine, when that is exact
    if ((arity(in.op) == 1) && in.a >= 0 && f[in.a].op == AFFINE && uses[in.a] == 1) {
      const Instr& g = f[in.a];
      float s2, t2;
      if (!in.pre_affine()) {        // a plain unary op reads g's result: take g whole
        s2 = g.s;
        t2 = g.t;
      } else if (!compose(g, in, &s2, &t2)) {
        continue;
      }
      const int y = g.a;
      --uses[in.a];
      in.a = y;
      in.s = s2;
      in.t = t2;
    }
  }
  // instructions nothing reads any more are dead; the slot planner gives them no buffer
}

void plan_slots(Program& p) {
  const int n = static_cast<int>(p.fwd.size());
  std::vector<int> last(n, -1);
  // liveness over the forward plan, reached from the result only
  std::vector<char> live(n, 0);
  live[n - 1] = 1;
  for (int i = n - 1; i >= 0; --i)
    if (live[i])
      for (int k : {p.fwd[i].a, p.fwd[i].b, p.fwd[i].c})
        if (k >= 0) live[k] = 1;
  for (int i = 0; i < n; ++i)
    if (live[i])
      for (int k : {p.fwd[i].a, p.fwd[i].b, p.fwd[i].c})
        if (k >= 0) last[k] = i;
  last[n - 1] = n;  // the result outlives the program
  p.slot.assign(n, -1);
  std::vector<int> free_slots;
  p.num_slots = 0;
  for (int i = 0; i < n; ++i) {
    const Instr& in = p.fwd[i];
    if (!live[i]) continue;
    // operands whose last reader is i give their buffer back first (once, however often
    // i reads them); constants keep theirs
    const int ops[3] = {in.a, in.b, in.c};
    for (int j = 0; j < 3; ++j) {
      const int k = ops[j];
      if (k < 0 || last[k] != i || p.fwd[k].op == CONST) continue;
      if ((j > 0 && ops[0] == k) || (j > 1 && ops[1] == k)) continue;
      free_slots.push_back(p.slot[k]);
    }
    if (in.op == CONST || free_slots.empty()) {
      p.slot[i] = p.num_slots++;
    } else {
      p.slot[i] = free_slots.back();
      free_slots.pop_back();
    }
  }
}
}  // namespace

Program compile(const std::string& text, int num_args) {
  Program p = Parser(text, num_args).run();
  if (p.num_inputs <= 0)
    throw ExprError("invalid expression '" + text + "': it reads no input (use at least x0) "
                    "and num_args is not set");
  plan_forward(p);
  plan_slots(p);
  return p;
}

}  // namespace expr
}  // namespace mxf
