// A user's own C++ operator, outside mxnet-fusion: my_relu6(x) = min(max(x, 0), 6).
// Built with
//   g++ -shared -fPIC -std=c++17 -O2 -I<mxnet>/include my_relu6.cc <mxnet>/src/lib_api.cc -o libmy_relu6.so \
//       -Wl,--version-script=lib_api.map -Wl,-Bsymbolic
// (lib_api.map: export only MXNet's entry points, so that the library's copy of lib_api.cc stays its
// own beside a libmxnet.so loaded RTLD_GLOBAL, as Horovod loads it)
// and loaded with mx.library.load(path); rules.py lowers clip(x, 0, 6) onto it.
#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"

using namespace mxnet::ext;
using Attrs = std::unordered_map<std::string, std::string>;

MXReturnValue parse_attrs(const Attrs&, int* num_in, int* num_out) {
  *num_in = 1;
  *num_out = 1;
  return MX_SUCCESS;
}

MXReturnValue infer_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kFloat32) return MX_FAIL;
  (*out)[0] = kFloat32;
  return MX_SUCCESS;
}

MXReturnValue infer_shape(const Attrs&, std::vector<std::vector<unsigned int>>* in,
                          std::vector<std::vector<unsigned int>>* out) {
  (*out)[0] = (*in)[0];
  return MX_SUCCESS;
}

static int64_t size_of(const MXTensor& t) {
  int64_t n = 1;
  for (auto d : t.shape) n *= d;
  return n;
}

MXReturnValue forward(const Attrs&, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  const float* x = (*in)[0].data<float>();
  float* y = (*out)[0].data<float>();
  for (int64_t i = 0, n = size_of((*in)[0]); i < n; ++i) y[i] = std::min(std::max(x[i], 0.f), 6.f);
  return MX_SUCCESS;
}

// inputs: dy, x, y; outputs: dx
MXReturnValue backward(const Attrs&, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                       const OpResource&) {
  const float* dy = (*in)[0].data<float>();
  const float* x = (*in)[1].data<float>();
  float* dx = (*out)[0].data<float>();
  for (int64_t i = 0, n = size_of((*in)[1]); i < n; ++i) dx[i] = (x[i] > 0.f && x[i] < 6.f) ? dy[i] : 0.f;
  return MX_SUCCESS;
}

REGISTER_OP(my_relu6)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(backward, "cpu");

MXReturnValue initialize(int version) { return version >= 10700 ? MX_SUCCESS : MX_FAIL; }
