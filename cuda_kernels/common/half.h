// float16 storage on the CPU: the fused ops compute in float32, so a float16 tensor is widened
// to float32 before a kernel reads it and a float32 result is rounded to float16 (nearest even)
// when it is written.  The CPU path is for correctness (the self-check, --verify, tests), not
// speed: float16 graphs are GPU graphs (MXNet's AMP with target_dtype="float16").
//
// Conversions use F16C (vcvtph2ps / vcvtps2ph, part of x86-64-v3) where the build has it,
// the same bits as IEEE's conversions otherwise: exact widening; rounding to nearest even,
// subnormal float16 results included, overflow to inf, NaN stays NaN (quiet).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mxf_common.h"

namespace mxf {

// mshadow's dtype codes (lib_api's MXDType names float16; bfloat16 is 12, see fusion/native/library.py)
constexpr int kF32 = mxnet::ext::kFloat32;
constexpr int kF16 = mxnet::ext::kFloat16;
constexpr int kBF16 = 12;

// "float32", "float16", "bfloat16", "float64", the integer types' names, or "dtype code N"
std::string dtype_name(int code);
// The code of out_dtype-style names: "float32" / "float16" / "bfloat16"; -1 for "" (unset).
int dtype_code(const std::string& name);
// attribute `name`: one of float32 / float16 / bfloat16 (each in `allowed`), or -1 when absent
int attr_dtype(const Attrs& a, const char* name, const std::vector<int>& allowed);

float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
void from_f16(const uint16_t* x, float* y, int64_t n);
void to_f16(const float* x, uint16_t* y, int64_t n);

// A call's float16 tensors as float32: `in` holds the inputs with every float16 one widened
// into a float32 copy, `out` the outputs with every float16 one replaced by a float32 buffer;
// finish() rounds those buffers into the caller's float16 outputs.  Other dtypes pass as they
// are (views of the caller's tensors).  The op's float32 code then runs unchanged, and its
// float16 results are the float32 results rounded once.
class Float32Call {
 public:
  Float32Call(const std::vector<MXTensor>& in, const std::vector<MXTensor>& out);
  std::vector<MXTensor> in, out;
  void finish();

 private:
  std::vector<std::vector<float>> bufs_;
  std::vector<std::pair<MXTensor, size_t>> back_;  // (caller's float16 output, index in out)
};

// Whether any tensor of the call is float16.
bool any_f16(const std::vector<MXTensor>& a, const std::vector<MXTensor>& b = {});

}  // namespace mxf
