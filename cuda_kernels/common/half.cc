// float16 <-> float32 on the CPU (see half.h).
#include "half.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace mxf {

std::string dtype_name(int code) {
  switch (code) {
    case kF32: return "float32";
    case kF16: return "float16";
    case kBF16: return "bfloat16";
    case mxnet::ext::kFloat64: return "float64";
    case mxnet::ext::kUint8: return "uint8";
    case mxnet::ext::kInt32: return "int32";
    case mxnet::ext::kInt8: return "int8";
    case mxnet::ext::kInt64: return "int64";
    default: return "dtype code " + std::to_string(code);
  }
}

int dtype_code(const std::string& name) {
  if (name == "float32") return kF32;
  if (name == "float16") return kF16;
  if (name == "bfloat16") return kBF16;
  return -1;
}

int attr_dtype(const Attrs& a, const char* name, const std::vector<int>& allowed) {
  if (!has_attr(a, name)) return -1;
  std::vector<std::string> names;
  for (int c : allowed) names.push_back(dtype_name(c));
  return dtype_code(attr_choice(a, name, "", names));
}

// IEEE conversions in integer arithmetic (the F16C instructions give the same bits)
float half_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400u));
      bits = sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

uint16_t float_to_half(float f) {
#ifdef __F16C__
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);  // NaN, quiet
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (a < 0x38800000u) {                        // below 2^-14: a subnormal float16 (or zero)
    float v;
    std::memcpy(&v, &a, 4);
    // v * 2^24 rounded to an integer (nearest even, the FPU's mode) is the subnormal's mantissa
    return sign | static_cast<uint16_t>(static_cast<uint32_t>(std::nearbyint(v * 16777216.f)));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return sign | static_cast<uint16_t>((r - 0x38000000u) >> 13);
#endif
}

void from_f16(const uint16_t* x, float* y, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i))));
#endif
  for (; i < n; ++i) y[i] = half_to_float(x[i]);
}

void to_f16(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; ++i) y[i] = float_to_half(x[i]);
}

Float32Call::Float32Call(const std::vector<MXTensor>& i, const std::vector<MXTensor>& o) : in(i), out(o) {
  auto widen = [&](MXTensor& t) {
    bufs_.emplace_back(static_cast<size_t>(t.size()));
    t.data_ptr = bufs_.back().data();
    t.dtype = mxnet::ext::kFloat32;
  };
  for (MXTensor& t : in)
    if (t.dtype == kF16) {
      const uint16_t* src = static_cast<const uint16_t*>(t.data_ptr);
      widen(t);
      from_f16(src, t.data<float>(), t.size());
    }
  for (size_t k = 0; k < out.size(); ++k)
    if (out[k].dtype == kF16) {
      back_.emplace_back(out[k], k);
      widen(out[k]);
    }
}

void Float32Call::finish() {
  for (auto& b : back_)
    to_f16(out[b.second].data<float>(), static_cast<uint16_t*>(b.first.data_ptr), b.first.size());
}

bool any_f16(const std::vector<MXTensor>& a, const std::vector<MXTensor>& b) {
  for (const auto* v : {&a, &b})
    for (const MXTensor& t : *v)
      if (t.dtype == kF16) return true;
  return false;
}

}  // namespace mxf

// The library's float16 conversions, for the tests: the bits every float16 path reads and writes.
extern "C" void mxf_to_f16(const float* x, uint16_t* y, int64_t n) { mxf::to_f16(x, y, n); }
extern "C" void mxf_from_f16(const uint16_t* x, float* y, int64_t n) { mxf::from_f16(x, y, n); }
