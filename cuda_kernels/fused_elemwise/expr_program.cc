// Recursive-descent parser for the fused_elemwise expression language -> SSA bytecode.
#include "expr_program.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>

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
    {"log1p", LOG1P, 1}, {"expm1", EXPM1, 1}, {"add", ADD, 2}, {"sub", SUB, 2}, {"mul", MUL, 2},
    {"div", DIV, 2}, {"pow", POW, 2}, {"max", MAX, 2}, {"min", MIN, 2}, {"lt", LT, 2},
    {"le", LE, 2}, {"gt", GT, 2}, {"ge", GE, 2}, {"eq", EQ, 2}, {"ne", NE, 2},
    {"where", WHERE, 3}};

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
  int emit(Instr in) {
    prog_.code.push_back(in);
    return static_cast<int>(prog_.code.size()) - 1;
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
      const bool is_clip = name == "clip";
      if (!info && !is_clip) {
        pos_ = st;
        fail("unknown function '" + name + "' (known: neg abs exp log sqrt rsqrt tanh sigmoid "
             "relu erf square softrelu softsign log_sigmoid mish log1p expm1 add sub mul div pow "
             "max min lt le gt ge eq ne where clip)");
      }
      const int want = is_clip ? 3 : info->arity;
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
      if (is_clip) {
        const int m = emit({MAX, args[0], args[1], -1, -1, 0.f});
        return emit({MIN, m, args[2], -1, -1, 0.f});
      }
      return emit({info->op, args[0], want > 1 ? args[1] : -1, want > 2 ? args[2] : -1, -1, 0.f});
    }
    fail(std::string("unexpected character '") + ch + "'");
  }

  const std::string& s_;
  int num_args_;
  size_t pos_ = 0;
  int max_input_ = -1;
  std::map<int, int> loads_;
  Program prog_;
};
}  // namespace

int arity(int op) {
  if (op == LOAD || op == CONST) return 0;
  if (op == AFFINE) return 1;
  if (op <= EXPM1) return 1;
  if (op <= NE) return 2;
  return 3;
}

const char* op_name(int op) {
  for (const auto& o : kOps)
    if (o.op == op) return o.name;
  return op == LOAD ? "load" : op == CONST ? "const" : op == AFFINE ? "affine" : "?";
}

namespace {
bool normal_or_zero(float v) { return v == 0.f || std::fpclassify(v) == FP_NORMAL; }

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
    // 1. scalar arithmetic -> AFFINE(a; s, t)
    float s = 1.f, t = -0.f;  // -0: the neutral addend, see Instr::t
    int x = -1, c = -1;
    if (in.op == NEG) { x = in.a; s = -1.f; }
    if (arity(in.op) == 2 && (is_const(in.a) != is_const(in.b))) {
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
      if (!std::isfinite(s) || !std::isfinite(t)) x = -1;  // keep inf/nan constants exact
    }
    if (x >= 0) {
      in = Instr{AFFINE, x, -1, -1, -1, 0.f, s, t};  // x * s + t, exactly the op it replaces
      if (c >= 0) --uses[c];
    }
    // 2. fold a single-use AFFINE operand into this op's pre-affine
    if ((arity(in.op) == 1) && in.a >= 0 && f[in.a].op == AFFINE && uses[in.a] == 1) {
      const Instr& g = f[in.a];  // in reads (y * g.s + g.t) * in.s + in.t, y = g's operand
      const bool neutral = g.neutral_t() && in.neutral_t();  // products only: stays a product
      const float s2 = g.s * in.s, t2 = neutral ? -0.f : g.t * in.s + in.t;
      if (std::isfinite(s2) && std::isfinite(t2) && normal_or_zero(s2) && normal_or_zero(t2) &&
          (s2 != 0.f || g.s == 0.f || in.s == 0.f)) {
        const int y = g.a;
        --uses[in.a];
        in.a = y;
        in.s = s2;
        in.t = t2;
      }
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
