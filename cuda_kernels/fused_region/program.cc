// fused_region's program: JSON -> Program, checks, and shape inference (see program.h, README.md).
#include "program.h"

#include <cmath>
#include <set>
#include <sstream>
#include <stdexcept>

#include "json.h"

namespace mxf {
namespace region {

using json::Value;

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::Conv: return "conv";
    case OpKind::Deconv: return "deconv";
    case OpKind::Pool: return "pool";
    case OpKind::Concat: return "concat";
    case OpKind::Add: return "add";
    case OpKind::Mul: return "mul";
    case OpKind::BatchNorm: return "batchnorm";
    case OpKind::Act: return "act";
  }
  return "?";
}

std::string dims_str(const Dims& d) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < d.size(); ++i) o << (i ? "," : "") << d[i];
  o << ")";
  return o.str();
}

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

// Where a message points: "op 3 (conv)", "op 3 (conv), post step 1", "outputs"...
struct Where {
  std::string at;
  [[noreturn]] void field(const std::string& name, const std::string& why) const {
    fail(at + ", field '" + name + "': " + why);
  }
  [[noreturn]] void say(const std::string& why) const { fail(at + ": " + why); }
};

std::string num_str(const Value& v) {
  if (v.kind != Value::Number) return Value::kind_name(v.kind);
  std::ostringstream o;
  o << v.num;
  return o.str();
}

const Value& need(const Value& obj, const char* name, const Where& w) {
  const Value* v = obj.find(name);
  if (!v) w.field(name, "missing");
  return *v;
}

int64_t integer(const Value& v, const char* name, const Where& w) {
  if (v.kind != Value::Number || !v.integral || std::fabs(v.num) > 9.0e15)
    w.field(name, std::string("must be an integer, got ") + num_str(v));
  return static_cast<int64_t>(v.num);
}

float number(const Value& v, const char* name, const Where& w) {
  if (v.kind != Value::Number) w.field(name, std::string("must be a number, got ") + Value::kind_name(v.kind));
  return static_cast<float>(v.num);
}

bool boolean(const Value& v, const char* name, const Where& w) {
  if (v.kind == Value::Bool) return v.b;
  if (v.kind == Value::Number && v.integral && (v.num == 0 || v.num == 1)) return v.num == 1;
  w.field(name, std::string("must be true or false, got ") + num_str(v));
}

std::string string(const Value& v, const char* name, const Where& w) {
  if (v.kind != Value::String) w.field(name, std::string("must be a string, got ") + Value::kind_name(v.kind));
  return v.str;
}

// A value number the op at value number `self` may read: made before it.
int value_ref(const Value& v, const char* name, const Where& w, int self) {
  const int64_t k = integer(v, name, w);
  if (k < 0 || k >= self)
    w.field(name, "value " + std::to_string(k) + (k < 0 ? " does not exist" : " is read before it is made") +
                      " (this op may read values 0.." + std::to_string(self - 1) + ")");
  return static_cast<int>(k);
}

int param_ref(const Value& v, const char* name, const Where& w, size_t num_params) {
  const int64_t k = integer(v, name, w);
  if (k < 0 || k >= static_cast<int64_t>(num_params))
    w.field(name, "parameter " + std::to_string(k) + " does not exist (the program has " +
                      std::to_string(num_params) + ")");
  return static_cast<int>(k);
}

// [a, b] of integers >= lo
void pair_field(const Value& obj, const char* name, const Where& w, int64_t lo, int64_t out[2], bool required) {
  const Value* v = obj.find(name);
  if (!v) {
    if (required) w.field(name, "missing");
    return;
  }
  if (v->kind != Value::Array || v->arr.size() != 2) w.field(name, "must be a list of two integers");
  for (int i = 0; i < 2; ++i) {
    out[i] = integer(v->arr[i], name, w);
    if (out[i] < lo) w.field(name, "must be >= " + std::to_string(lo) + ", got " + std::to_string(out[i]));
  }
}

void only_fields(const Value& obj, const std::set<std::string>& allowed, const Where& w) {
  for (const auto& kv : obj.obj)
    if (!allowed.count(kv.first)) w.field(kv.first, "unknown field");
}

Step parse_step(const Value& s, const Where& w, int self) {
  if (s.kind != Value::Object) w.say("a post step must be an object");
  Step st;
  const Value* e = s.find("eltwise");
  const Value* add = s.find("add");
  const Value* mul = s.find("mul");
  if ((e != nullptr) + (add != nullptr) + (mul != nullptr) != 1)
    w.say("a post step has exactly one of 'eltwise', 'add', 'mul'");
  if (add || mul) {
    only_fields(s, {add ? "add" : "mul"}, w);
    st.kind = add ? Step::Add : Step::Mul;
    st.value = value_ref(add ? *add : *mul, add ? "add" : "mul", w, self);
    return st;
  }
  const std::string f = string(*e, "eltwise", w);
  struct Fn { const char* name; Elt elt; const char* a; const char* b; };
  static const Fn fns[] = {
      {"relu", Elt::Relu, nullptr, nullptr},          {"clip", Elt::Clip, "lo", "hi"},
      {"sigmoid", Elt::Sigmoid, nullptr, nullptr},    {"tanh", Elt::Tanh, nullptr, nullptr},
      {"softrelu", Elt::SoftRelu, nullptr, nullptr},  {"leaky", Elt::Leaky, "slope", nullptr},
      {"elu", Elt::Elu, "alpha", nullptr},            {"gelu", Elt::Gelu, nullptr, nullptr},
      {"swish", Elt::Swish, nullptr, nullptr},        {"hard_swish", Elt::HardSwish, nullptr, nullptr},
      {"hard_sigmoid", Elt::HardSigmoid, "alpha", "beta"}, {"linear", Elt::Linear, "scale", "shift"}};
  for (const Fn& fn : fns) {
    if (f != fn.name) continue;
    std::set<std::string> allowed = {"eltwise"};
    if (fn.a) allowed.insert(fn.a), st.a = number(need(s, fn.a, w), fn.a, w);
    if (fn.b) allowed.insert(fn.b), st.b = number(need(s, fn.b, w), fn.b, w);
    only_fields(s, allowed, w);
    st.elt = fn.elt;
    if (fn.elt == Elt::Clip && !(st.a <= st.b)) w.field("lo", "must not exceed hi");
    return st;
  }
  w.field("eltwise", "unknown function '" + f + "' (relu, clip, sigmoid, tanh, softrelu, leaky, elu, gelu, "
                     "swish, hard_swish, hard_sigmoid, linear)");
}

Op parse_op(const Value& o, int index, int self, size_t num_params) {
  Where w{"op " + std::to_string(index)};
  if (o.kind != Value::Object) w.say("must be an object");
  const std::string kind = string(need(o, "op", w), "op", w);
  Op op;
  static const std::pair<const char*, OpKind> kinds[] = {
      {"conv", OpKind::Conv}, {"deconv", OpKind::Deconv}, {"pool", OpKind::Pool}, {"concat", OpKind::Concat}, {"add", OpKind::Add},
      {"mul", OpKind::Mul}, {"batchnorm", OpKind::BatchNorm}, {"act", OpKind::Act}};
  bool known = false;
  for (const auto& k : kinds)
    if (kind == k.first) op.kind = k.second, known = true;
  if (!known) w.field("op", "unknown op '" + kind + "' (conv, deconv, pool, concat, add, mul, batchnorm, act)");
  w.at += " (" + kind + ")";

  const Value& in = need(o, "in", w);
  if (op.kind == OpKind::Concat || op.kind == OpKind::Add || op.kind == OpKind::Mul) {
    if (in.kind != Value::Array) w.field("in", "must be a list of values");
    for (const Value& v : in.arr) op.in.push_back(value_ref(v, "in", w, self));
    if (op.kind == OpKind::Concat && op.in.empty()) w.field("in", "must name at least one value");
    if (op.kind != OpKind::Concat && op.in.size() != 2) w.field("in", "must name two values");
  } else {
    op.in.push_back(value_ref(in, "in", w, self));
  }

  std::set<std::string> allowed = {"op", "in", "post"};
  switch (op.kind) {
    case OpKind::Conv:
    case OpKind::Deconv: {  // a deconv has one group and may add `adj` rows at the end
      const bool conv = op.kind == OpKind::Conv;
      allowed.insert({"weight", "bias", "kernel", "stride", "pad", "dilate", "filters", conv ? "groups" : "adj"});
      op.weight = param_ref(need(o, "weight", w), "weight", w, num_params);
      const Value* b = o.find("bias");
      if (b && b->kind != Value::Null) op.bias = param_ref(*b, "bias", w, num_params);
      pair_field(o, "kernel", w, 1, op.kernel, true);
      pair_field(o, "stride", w, 1, op.stride, false);
      pair_field(o, "pad", w, 0, op.pad, false);
      pair_field(o, "dilate", w, 1, op.dilate, false);
      if (conv) {
        if (const Value* g = o.find("groups")) op.groups = integer(*g, "groups", w);
        if (op.groups < 1) w.field("groups", "must be >= 1");
      } else {
        pair_field(o, "adj", w, 0, op.adj, false);
        for (int i = 0; i < 2; ++i)
          if (op.adj[i] > op.pad[i])
            w.field("adj", "must not exceed pad (the extra rows come out of the padding: oneDNN pads pad - adj at the end)");
      }
      op.filters = integer(need(o, "filters", w), "filters", w);
      if (op.filters < 1) w.field("filters", "must be >= 1");
      break;
    }
    case OpKind::Pool: {
      allowed.insert({"mode", "kernel", "stride", "pad", "convention", "count_include_pad", "global"});
      const std::string mode = string(need(o, "mode", w), "mode", w);
      if (mode != "max" && mode != "avg") w.field("mode", "must be 'max' or 'avg', got '" + mode + "'");
      op.max = mode == "max";
      if (const Value* g = o.find("global")) op.global = boolean(*g, "global", w);
      pair_field(o, "kernel", w, 1, op.kernel, !op.global);
      pair_field(o, "stride", w, 1, op.stride, false);
      pair_field(o, "pad", w, 0, op.pad, false);
      if (const Value* c = o.find("convention")) {
        const std::string conv = string(*c, "convention", w);
        if (conv != "valid" && conv != "full") w.field("convention", "must be 'valid' or 'full', got '" + conv + "'");
        op.full = conv == "full";
      }
      if (const Value* c = o.find("count_include_pad")) op.include_pad = boolean(*c, "count_include_pad", w);
      if (!op.global)
        for (int i = 0; i < 2; ++i)
          if (op.pad[i] >= op.kernel[i])
            w.field("pad", "must be smaller than the kernel (a window wholly in the padding has no MXNet value)");
      break;
    }
    case OpKind::BatchNorm: {
      allowed.insert({"gamma", "beta", "mean", "var", "eps", "fix_gamma"});
      op.gamma = param_ref(need(o, "gamma", w), "gamma", w, num_params);
      op.beta = param_ref(need(o, "beta", w), "beta", w, num_params);
      op.mean = param_ref(need(o, "mean", w), "mean", w, num_params);
      op.var = param_ref(need(o, "var", w), "var", w, num_params);
      if (const Value* e = o.find("eps")) op.eps = number(*e, "eps", w);
      if (!(op.eps >= 0.f)) w.field("eps", "must be >= 0");
      if (const Value* f = o.find("fix_gamma")) op.fix_gamma = boolean(*f, "fix_gamma", w);
      break;
    }
    default:
      break;
  }
  only_fields(o, allowed, w);
  if (const Value* post = o.find("post")) {
    if (post->kind != Value::Array) w.field("post", "must be a list of steps");
    for (size_t s = 0; s < post->arr.size(); ++s) {
      Where ws{w.at + ", post step " + std::to_string(s)};
      op.post.push_back(parse_step(post->arr[s], ws, self));
    }
  }
  return op;
}

}  // namespace

Program parse_program(const std::string& text, int num_data) {
  if (num_data < 1) fail("num_data must be >= 1");
  Value root = json::parse(text);
  Where top{"program"};
  if (root.kind != Value::Object) top.say("must be a JSON object");
  only_fields(root, {"version", "params", "ops", "outputs"}, top);
  const int64_t version = integer(need(root, "version", top), "version", top);
  if (version != 1) top.field("version", "must be 1, got " + std::to_string(version));
  Program p;
  p.num_data = num_data;
  const Value& params = need(root, "params", top);
  if (params.kind != Value::Array) top.field("params", "must be a list of shapes");
  for (size_t i = 0; i < params.arr.size(); ++i) {
    const Value& s = params.arr[i];
    Where wp{"params[" + std::to_string(i) + "]"};
    if (s.kind != Value::Array || s.arr.empty()) wp.say("must be a non-empty list of dimensions");
    Dims d;
    for (const Value& x : s.arr) {
      d.push_back(integer(x, "shape", wp));
      if (d.back() < 1) wp.say("dimensions must be >= 1");
    }
    p.params.push_back(d);
  }
  const Value& ops = need(root, "ops", top);
  if (ops.kind != Value::Array) top.field("ops", "must be a list of ops");
  for (size_t k = 0; k < ops.arr.size(); ++k)
    p.ops.push_back(parse_op(ops.arr[k], static_cast<int>(k), num_data + static_cast<int>(k), p.params.size()));
  const Value& outs = need(root, "outputs", top);
  if (outs.kind != Value::Array || outs.arr.empty()) top.field("outputs", "must be a non-empty list of values");
  for (const Value& v : outs.arr) p.outputs.push_back(value_ref(v, "outputs", top, p.num_values()));
  return p;
}

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }
}  // namespace

int64_t pool_out(const Op& op, int64_t in, int axis) {
  const int64_t span = in + 2 * op.pad[axis] - op.kernel[axis];
  return 1 + (op.full ? ceil_div(span, op.stride[axis]) : span / op.stride[axis]);
}

int64_t pool_pad_right(const Op& op, int64_t in, int axis) {
  if (!op.full) return op.pad[axis];
  return (pool_out(op, in, axis) - 1) * op.stride[axis] + op.kernel[axis] - in - op.pad[axis];
}

std::vector<Dims> infer_values(const Program& p, const std::vector<Dims>& data) {
  if (static_cast<int>(data.size()) != p.num_data) fail("expected " + std::to_string(p.num_data) + " data inputs");
  std::vector<Dims> v(data);
  for (size_t i = 0; i < data.size(); ++i) {
    if (data[i].empty()) fail("data input " + std::to_string(i) + " has no dimensions");
    for (int64_t d : data[i])
      if (d < 1) fail("data input " + std::to_string(i) + " has an empty dimension: " + dims_str(data[i]));
  }
  for (size_t k = 0; k < p.ops.size(); ++k) {
    const Op& op = p.ops[k];
    Where w{"op " + std::to_string(k) + " (" + op_name(op.kind) + ")"};
    const Dims& x = v[op.in[0]];
    auto need_rank4 = [&](const Dims& d) {
      if (d.size() != 4) w.field("in", "value " + std::to_string(op.in[0]) + " is " + dims_str(d) + ", not (N, C, H, W)");
    };
    auto param_is = [&](int prm, const Dims& want, const char* field) {
      if (p.params[prm] != want)
        w.field(field, "parameter " + std::to_string(prm) + " is " + dims_str(p.params[prm]) + " but must be " +
                           dims_str(want));
    };
    Dims y;
    switch (op.kind) {
      case OpKind::Conv: {
        need_rank4(x);
        const int64_t C = x[1], G = op.groups, O = op.filters;
        if (C % G) w.field("groups", std::to_string(G) + " does not divide the input's " + std::to_string(C) + " channels");
        if (O % G) w.field("groups", std::to_string(G) + " does not divide the " + std::to_string(O) + " filters");
        param_is(op.weight, {O, C / G, op.kernel[0], op.kernel[1]}, "weight");
        if (op.bias >= 0) param_is(op.bias, {O}, "bias");
        y = {x[0], O, 0, 0};
        for (int i = 0; i < 2; ++i) {
          const int64_t span = x[2 + i] + 2 * op.pad[i], ext = op.dilate[i] * (op.kernel[i] - 1) + 1;
          if (span < ext) w.field("kernel", "the (dilated) kernel does not fit the padded input " + dims_str(x));
          y[2 + i] = (span - ext) / op.stride[i] + 1;
        }
        break;
      }
      case OpKind::Deconv: {
        need_rank4(x);
        const int64_t C = x[1], O = op.filters;
        param_is(op.weight, {C, O, op.kernel[0], op.kernel[1]}, "weight");
        if (op.bias >= 0) param_is(op.bias, {O}, "bias");
        y = {x[0], O, 0, 0};
        for (int i = 0; i < 2; ++i) {  // MXNet's Deconvolution: (H - 1)·S - 2P + D·(K - 1) + 1 + adj
          y[2 + i] = (x[2 + i] - 1) * op.stride[i] - 2 * op.pad[i] + op.dilate[i] * (op.kernel[i] - 1) + 1 + op.adj[i];
          if (y[2 + i] < 1) w.field("pad", "leaves no output of the input " + dims_str(x));
        }
        break;
      }
      case OpKind::Pool: {
        need_rank4(x);
        y = {x[0], x[1], 1, 1};
        if (op.global) break;
        for (int i = 0; i < 2; ++i) {
          if (x[2 + i] + 2 * op.pad[i] < op.kernel[i])
            w.field("kernel", "the kernel does not fit the padded input " + dims_str(x));
          y[2 + i] = pool_out(op, x[2 + i], i);
          // `full` rounds up: the last window must still cover an input element
          if ((y[2 + i] - 1) * op.stride[i] - op.pad[i] >= x[2 + i])
            w.field("stride", "the last window of the 'full' convention lies wholly in the padding of input " + dims_str(x));
        }
        break;
      }
      case OpKind::Concat: {
        if (x.size() < 2) w.field("in", "value " + std::to_string(op.in[0]) + " has no channel axis");
        y = x;
        y[1] = 0;
        for (int in : op.in) {
          const Dims& d = v[in];
          bool fits = d.size() == x.size();
          for (size_t a = 0; fits && a < d.size(); ++a) fits = a == 1 || d[a] == x[a];
          if (!fits) w.field("in", "value " + std::to_string(in) + " is " + dims_str(d) + "; concatenated values must agree "
                                   "in every axis but 1 with " + dims_str(x));
          y[1] += d[1];
        }
        break;
      }
      case OpKind::Add:
        if (v[op.in[1]] != x)
          w.field("in", "the values added are " + dims_str(x) + " and " + dims_str(v[op.in[1]]) + ", not one shape");
        y = x;
        break;
      case OpKind::Mul: {
        const Dims& b = v[op.in[1]];
        Dims gate(x.size(), 1);
        if (x.size() >= 2) gate[0] = x[0], gate[1] = x[1];
        if (b != x && !(x.size() >= 3 && b == gate))
          w.field("in", "the second value is " + dims_str(b) + "; it must be " + dims_str(x) +
                            (x.size() >= 3 ? " or " + dims_str(gate) : std::string()));
        y = x;
        break;
      }
      case OpKind::BatchNorm: {
        if (x.size() < 2) w.field("in", "value " + std::to_string(op.in[0]) + " has no channel axis");
        const Dims c = {x[1]};
        param_is(op.gamma, c, "gamma");
        param_is(op.beta, c, "beta");
        param_is(op.mean, c, "mean");
        param_is(op.var, c, "var");
        y = x;
        break;
      }
      case OpKind::Act:
        y = x;
        break;
    }
    for (size_t s = 0; s < op.post.size(); ++s) {
      const Step& st = op.post[s];
      if (st.kind == Step::Eltwise) continue;
      Where ws{w.at + ", post step " + std::to_string(s)};
      const Dims& d = v[st.value];
      Dims gate(y.size(), 1);
      if (y.size() >= 2) gate[0] = y[0], gate[1] = y[1];
      const bool ok = d == y || (st.kind == Step::Mul && y.size() >= 3 && d == gate);
      if (!ok)
        ws.field(st.kind == Step::Add ? "add" : "mul",
                 "value " + std::to_string(st.value) + " is " + dims_str(d) + " but the op's result is " + dims_str(y) +
                     (st.kind == Step::Mul && y.size() >= 3 ? " (or a gate " + dims_str(gate) + ")" : std::string()));
    }
    v.push_back(y);
  }
  return v;
}

}  // namespace region
}  // namespace mxf
