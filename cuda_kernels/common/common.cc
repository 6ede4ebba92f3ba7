// Library entry point, attribute helpers and the run-time binding to dnnl_sgemm.
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include <oneapi/dnnl/dnnl.h>

#include "mxf_common.h"

namespace mxf {

std::string attr_str(const Attrs& a, const char* name, const char* dflt) {
  auto it = a.find(name);
  return it == a.end() ? std::string(dflt) : it->second;
}

bool has_attr(const Attrs& a, const char* name) { return a.count(name) > 0; }

float attr_float(const Attrs& a, const char* name, float dflt) {
  auto it = a.find(name);
  if (it == a.end()) return dflt;
  std::string v = it->second;
  std::string lv = v;
  std::transform(lv.begin(), lv.end(), lv.begin(), ::tolower);
  if (lv == "-inf" || lv == "-infinity") return -INFINITY;
  if (lv == "inf" || lv == "infinity" || lv == "+inf") return INFINITY;
  try {
    size_t pos = 0;
    float f = std::stof(v, &pos);
    if (pos != v.size()) throw std::invalid_argument("trailing");
    return f;
  } catch (const std::out_of_range&) {
    // std::stof rejects e.g. -1e300; clamp like a float cast would.
    double d = std::stod(v);
    return static_cast<float>(d);
  } catch (const std::exception&) {
    throw OpError("attribute '" + std::string(name) + "' must be a float, got '" + v + "'");
  }
}

int64_t attr_int(const Attrs& a, const char* name, int64_t dflt) {
  auto it = a.find(name);
  if (it == a.end()) return dflt;
  try {
    size_t pos = 0;
    long long v = std::stoll(it->second, &pos);
    if (pos != it->second.size()) throw std::invalid_argument("trailing");
    return v;
  } catch (const std::exception&) {
    throw OpError("attribute '" + std::string(name) + "' must be an integer, got '" +
                  it->second + "'");
  }
}

std::pair<int64_t, int64_t> attr_pair(const Attrs& a, const char* name, int64_t dflt) {
  auto it = a.find(name);
  if (it == a.end()) return {dflt, dflt};
  std::string s = it->second;
  for (char& ch : s)
    if (ch == '(' || ch == ')' || ch == '[' || ch == ']' || ch == ',') ch = ' ';
  std::vector<int64_t> v;
  size_t pos = 0;
  while (true) {
    while (pos < s.size() && s[pos] == ' ') ++pos;
    if (pos >= s.size()) break;
    size_t end = pos;
    while (end < s.size() && s[end] != ' ') ++end;
    size_t used = 0;
    const std::string tok = s.substr(pos, end - pos);
    try {
      v.push_back(std::stoll(tok, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != tok.size())
      throw OpError("attribute '" + std::string(name) + "' must hold integers, got '" + it->second + "'");
    pos = end;
  }
  if (v.empty()) return {dflt, dflt};
  if (v.size() > 2)
    throw OpError("attribute '" + std::string(name) + "' must have one or two values, got '" + it->second + "'");
  return {v[0], v.size() == 2 ? v[1] : v[0]};
}

bool attr_bool(const Attrs& a, const char* name, bool dflt) {
  auto it = a.find(name);
  if (it == a.end()) return dflt;
  std::string v = it->second;
  std::transform(v.begin(), v.end(), v.begin(), ::tolower);
  if (v == "1" || v == "true") return true;
  if (v == "0" || v == "false") return false;
  throw OpError("attribute '" + std::string(name) + "' must be a boolean (True/False/1/0), got '" +
                it->second + "'");
}

std::string attr_choice(const Attrs& a, const char* name, const char* dflt,
                        const std::vector<std::string>& choices) {
  std::string v = attr_str(a, name, dflt);
  for (const auto& c : choices)
    if (c == v) return v;
  std::string msg = "attribute '" + std::string(name) + "' must be one of {";
  for (size_t i = 0; i < choices.size(); ++i) msg += (i ? ", " : "") + choices[i];
  throw OpError(msg + "}, got '" + v + "'");
}

std::string shape_str(const Shape& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? "," : "") << s[i];
  o << ")";
  return o.str();
}
std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? "," : "") << s[i];
  o << ")";
  return o.str();
}
bool shape_unknown(const Shape& s) {
  if (s.empty()) return true;
  for (auto d : s)
    if (d == static_cast<unsigned int>(-1)) return true;
  return false;
}

void require_known_shapes(const std::vector<Shape>& in) {
  for (size_t i = 0; i < in.size(); ++i)
    if (shape_unknown(in[i]))
      throw OpError("the shape of input " + std::to_string(i) + " is unknown and cannot be inferred "
                    "from the op's data and attributes; give it when binding (e.g. the bound "
                    "parameter's shape)");
}

void require_known_input(const std::vector<Shape>& in, size_t i, const char* what) {
  if (i < in.size() && shape_unknown(in[i]))
    throw OpError("the shape of input " + std::to_string(i) + " (" + what + ") is unknown; the op "
                  "infers its parameters' shapes from it, not the reverse");
}

void fill_input(std::vector<Shape>* in, size_t i, const Shape& want, const char* what) {
  Shape& s = (*in)[i];
  if (!shape_unknown(s)) return;
  bool agrees = s.empty() || s.size() == want.size();
  for (size_t d = 0; agrees && !s.empty() && d < s.size(); ++d)
    agrees = s[d] == static_cast<unsigned int>(-1) || s[d] == want[d];
  if (!agrees) {
    std::string given = "(";
    for (size_t d = 0; d < s.size(); ++d)
      given += (d ? "," : "") + (s[d] == static_cast<unsigned int>(-1) ? std::string("?")
                                                                       : std::to_string(s[d]));
    throw OpError("input " + std::to_string(i) + " (" + what + ") is given as " + given +
                  ")" + " but must be " + shape_str(want));
  }
  s = want;
}

int64_t numel(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

void require_f32(const MXTensor& t, const char* what) {
  if (t.dtype != mxnet::ext::kFloat32)
    throw OpError(std::string(what) + " must be float32");
}

MXReturnValue infer_type_float32(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused op", [&] {
    for (size_t i = 0; i < in->size(); ++i)
      if ((*in)[i] != mxnet::ext::kFloat32) throw OpError("input " + std::to_string(i) + " must be float32");
    for (auto& t : *out) t = mxnet::ext::kFloat32;
  });
}

ClipGate parse_clip_gate(const Attrs& a) {
  ClipGate g;
  g.add = attr_float(a, "gate_add", g.add);
  g.min = attr_float(a, "gate_min", g.min);
  g.max = attr_float(a, "gate_max", g.max);
  g.div = attr_float(a, "gate_div", g.div);
  return g;
}

MXReturnValue inference_only_backward(const Attrs&, std::vector<MXTensor>*, std::vector<MXTensor>*,
                                      const OpResource&) {
  report_error("this fused op has no backward: the graph was fused for inference; fuse it with "
               "mode='training' to train it (hybridize(backend='fusion') does so under autograd.record())");
  return mxnet::ext::MX_FAIL;
}

// ---- dnnl_sgemm --------------------------------------------------------------
namespace {
using sgemm_fn = decltype(&::dnnl_sgemm);
sgemm_fn g_sgemm = nullptr;
void* g_dnnl = nullptr;  // the dlopen handle g_sgemm came from
std::string g_sgemm_error;
std::once_flag g_sgemm_once;

void bind_sgemm() {
  // fusion._native sets MXFUSION_DNNL_LIB to the absolute path of libdnnl.so.3
  // from the onednn-cpu-gomp wheel; fall back to the loader's search path.
  std::vector<std::string> cands;
  if (const char* p = std::getenv("MXFUSION_DNNL_LIB")) cands.emplace_back(p);
  cands.emplace_back("libdnnl.so.3");
  cands.emplace_back("libdnnl.so");
  std::string errs;
  for (const auto& c : cands) {
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      errs += "\n  " + c + ": " + (e ? e : "not found");
      continue;
    }
    g_sgemm = reinterpret_cast<sgemm_fn>(dlsym(h, "dnnl_sgemm"));
    if (g_sgemm) {
      g_dnnl = h;
      return;
    }
    errs += "\n  " + c + ": no symbol dnnl_sgemm";
  }
  g_sgemm_error = "cannot load oneDNN (libdnnl.so.3 with dnnl_sgemm); install "
                  "'onednn-cpu-gomp==2023.2.0' or set MXFUSION_DNNL_LIB. Tried:" + errs;
}
}  // namespace

void* dnnl_symbol(const char* name) {
  std::call_once(g_sgemm_once, bind_sgemm);
  return g_dnnl ? dlsym(g_dnnl, name) : nullptr;
}

void sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
           int64_t ldc) {
  std::call_once(g_sgemm_once, bind_sgemm);
  if (!g_sgemm) throw OpError(g_sgemm_error);
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // oneDNN rejects K == 0; C = beta * C
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  int st = g_sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  if (st != 0) throw OpError("dnnl_sgemm failed with status " + std::to_string(st));
}

}  // namespace mxf

// Exported for fusion._native: tells whether dnnl_sgemm could be bound.
extern "C" const char* mxfusion_sgemm_status() {
  std::call_once(mxf::g_sgemm_once, mxf::bind_sgemm);
  return mxf::g_sgemm ? "" : mxf::g_sgemm_error.c_str();
}

mxnet::ext::MXReturnValue initialize(int version) {
  if (version >= 10900) return mxnet::ext::MX_SUCCESS;
  mxf::report_error("mxnet-fusion ops need MXNet >= 1.9.0, found version " + std::to_string(version));
  return mxnet::ext::MX_FAIL;
}
