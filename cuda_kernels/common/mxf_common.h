// Shared helpers for the mxnet-fusion CPU operator library.
//  - attribute parsing that reports errors through report_error (errors.cc)
//  - dnnl_sgemm, loaded at run time (oneDNN ships no headers in its wheel)
//  - small vectorizable math helpers
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mxnet/lib_api.h"

namespace mxf {

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;
using Shape = std::vector<unsigned int>;

// Whether a parameter's values may have changed since the last call that asked about it (a state
// keeps one per cached form of a parameter: a packed weight, a widened copy, a bound).  MXNet bumps
// an NDArray's version on every write (>= 1 once written), so (data pointer, version) identifies its
// values -- except for a temporary: an array that MXNet's own oneDNN ops left in their blocked
// layout (a stock executor bound for inference on the same arrays reorders its weights in place)
// reaches a library op as a fresh plain copy each call, version 0, often at the address of the last
// call's copy.  Such a parameter is compared by content against a copy kept here: a memcmp per call
// (MXNet already copies the whole array for that call) rather than a stale pack, which would give
// wrong results after the user updates the weights, or a repack per call.
class ParamVersion {
 public:
  // True on the first call and whenever `t` may hold other values than at the last call.
  bool changed(const MXTensor& t) {
    const size_t bytes = static_cast<size_t>(t.size()) * ((t.dltensor.dtype.bits + 7) / 8);
    bool differs = !seen_;
    if (t.verID == 0) {
      temporary_ = true;
      const unsigned char* d = static_cast<const unsigned char*>(t.data_ptr);
      if (copy_.size() != bytes || (bytes && std::memcmp(copy_.data(), d, bytes) != 0)) {
        copy_.assign(d, d + bytes);
        differs = true;
      }
    } else {
      temporary_ = false;
      differs = differs || t.data_ptr != ptr_ || t.verID != ver_ || bytes != bytes_;
      std::vector<unsigned char>().swap(copy_);
    }
    seen_ = true;
    ptr_ = t.data_ptr;
    ver_ = t.verID;
    bytes_ = bytes;
    return differs;
  }
  // Whether the last call's parameter was such a temporary (compared by content).
  bool temporary() const { return temporary_; }
  // The next call counts as a change (a cached form was dropped).
  void forget() { seen_ = false; }

 private:
  const void* ptr_ = nullptr;
  size_t ver_ = 0, bytes_ = 0;
  bool seen_ = false, temporary_ = false;
  std::vector<unsigned char> copy_;
};

// Raised by helpers; converted to an MXNet error at the op boundary.
struct OpError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Hands one message to MXNet with the failure being returned (errors.cc: each message
// reaches MXNet once, unlike lib_api's MX_ERROR_MSG, which repeats every earlier one).
void report_error(const std::string& msg);

// Runs `body` and turns any exception into report_error + MX_FAIL, so the
// user sees an MXNetError naming the op and the problem.
template <class F>
MXReturnValue guarded(const char* op, F&& body) {
  try {
    body();
    return mxnet::ext::MX_SUCCESS;
  } catch (const std::exception& e) {
    report_error(std::string(op) + ": " + e.what());
    return mxnet::ext::MX_FAIL;
  }
}

// The backward of an op that is fused for inference only (its rules refuse training).  It
// exists because a hybridized Gluon block builds the gradient graph of its whole graph when
// the block is created, inference included, and MXNet refuses a graph with an op without
// one; it is never run unless a graph fused for inference is trained, and then it fails
// with a message that says so.  mxf_capabilities() does not count it as a backward.
MXReturnValue inference_only_backward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                                      std::vector<MXTensor>* outputs, const OpResource& res);

// The clipped gate clip(x + add, min, max) / div (MobileNetV3's hard sigmoid, ReLU6(x + 3) / 6 by
// default), from the attributes gate_add, gate_min, gate_max and gate_div.  The same arithmetic
// as the ops it replaces: add, clip, then divide.
struct ClipGate {
  float add = 3.f, min = 0.f, max = 6.f, div = 6.f;
  float operator()(float x) const {
    float t = x + add;
    t = t < min ? min : (t > max ? max : t);
    return t / div;
  }
};
ClipGate parse_clip_gate(const Attrs& a);

// Type inference of an op that computes in float32 only: every input float32 (else an error naming
// it), every output float32.
MXReturnValue infer_type_float32(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out);

std::string attr_str(const Attrs& a, const char* name, const char* dflt);
bool has_attr(const Attrs& a, const char* name);
float attr_float(const Attrs& a, const char* name, float dflt);
int64_t attr_int(const Attrs& a, const char* name, int64_t dflt);
bool attr_bool(const Attrs& a, const char* name, bool dflt);
// Value must be one of `choices`; error message lists them.
std::string attr_choice(const Attrs& a, const char* name, const char* dflt,
                        const std::vector<std::string>& choices);
// (a, b) of a tuple attribute like "(3, 3)" or "[2, 2]" (one value is used for both; absent or
// empty: (dflt, dflt)); an error naming the attribute for more values or a non-integer.
std::pair<int64_t, int64_t> attr_pair(const Attrs& a, const char* name, int64_t dflt);
std::string shape_str(const Shape& s);
std::string shape_str(const std::vector<int64_t>& s);
int64_t numel(const std::vector<int64_t>& s);
// A shape MXNet has not inferred yet (no dims, or the unknown-dim marker).
bool shape_unknown(const Shape& s);
// Shape inference in both directions, as far as MXNet 1.9's wrapper for library ops carries it.
// It hands the op an input MXNet does not know yet as no dims (an unknown dim as the marker
// 0xFFFFFFFF) and copies back whatever the op leaves there.  An op fills the inputs it derives
// from its data and attributes (a weight from the data and num_hidden, as FullyConnected does)
// with fill_input(); an input still unknown then fails in require_known_shapes() -- left as it
// was, MXNet would take no dims for a scalar and the marker for a size.  The wrapper also
// mis-sizes its buffer when an input has no dims at all (a crash in MXNet, before the op runs,
// where the unknown inputs are as many as the known inputs' dims): fuse() writes every
// parameter's shape into the graph (a variable's __shape__), which MXNet reads before it asks
// the op, and Gluon's exported graphs carry such hints (a deferred dim as 0, which the op fills).
void require_known_shapes(const std::vector<Shape>& in);
// Input i must be known already (data the op cannot derive); `what` names it in the error.
void require_known_input(const std::vector<Shape>& in, size_t i, const char* what);
// Input i is `want`: set where MXNet does not know it (wholly or some dims), else left for the
// op's own checks; an error where its known dims disagree with `want`.
void fill_input(std::vector<Shape>* in, size_t i, const Shape& want, const char* what);

void require_f32(const MXTensor& t, const char* what);

// A symbol of the oneDNN library dnnl_sgemm was bound from (null if none / missing).
void* dnnl_symbol(const char* name);

// Row-major C = alpha * op(A) * op(B) + beta * C through oneDNN's dnnl_sgemm.
// Inside an OpenMP parallel region oneDNN runs the call on the calling thread.
void sgemm(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
           float* C, int64_t ldc);

// exp accurate to ~2 ulp for normal results; written so GCC vectorizes it.
// Cody-Waite range reduction + Cephes polynomial; results below ~2.4e-38 (x < -86.6)
// flush to 0; x > ln(FLT_MAX) -> inf; -inf -> 0, +inf -> inf, nan -> nan.
static inline float fast_exp(float x) {
  const float hi = 88.72283935546875f, lo = -86.6f;  // hi = ln(FLT_MAX)
  float xc = x > hi ? hi : (x < lo ? lo : x);
  float fx = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - fx * 0.693359375f;
  r = r + fx * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^fx built as 2^(fx-1) * 2 so that fx = 128 (x up to ln(FLT_MAX)) stays finite
  int32_t e = static_cast<int32_t>(fx) + 126;
  union { int32_t i; float f; } u;
  u.i = e << 23;
  float res = p * u.f * 2.0f;
  // NaN flows through the arithmetic (r is NaN), so it needs no select of its own
  return x < lo ? 0.0f : (x > hi ? INFINITY : res);
}

}  // namespace mxf
