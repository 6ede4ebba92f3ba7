// CUDA fused elementwise, the interpreter: the expression is parsed on the host (the same
// parser as the CPU op) and interpreted by one kernel; each thread evaluates the whole program
// for its elements (grid-stride loop), so every input is read once and the output written once.
// The fallback of the kernels NVRTC compiles per expression (elemwise_jit.cu), which run where
// NVRTC can be loaded; interpret() below is what runs otherwise.
// Storage fp32 / fp16 / bf16, math float32.  Where every input is the output's shape, a
// single element, or a row broadcast over the last dim (bias-like), and the pointers are
// 16-byte aligned, a thread takes 16 bytes of elements (4 floats, 8 halves) per step with
// 128-bit loads and stores, and runs each instruction over all of them (the interpreter's
// dispatch paid once per 4-8 elements); otherwise one element a step with NumPy-broadcast
// index arithmetic.
// Each function computes what MXNet's op computes on the GPU (README.md), NaN and inf
// included, with CUDA's libdevice math (expf, tanhf, erff: <= 2 ulp).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_common.cuh"
#include "elemwise_jit.h"
#include "expr_program.h"
#include "fused_elemwise.h"

namespace {

using mxf::expr::Instr;
constexpr int kMaxInstr = 64, kMaxIn = 8, kMaxDim = 6;

enum { kFull = 0, kScalar = 1, kRow = 2 };  // how an input maps onto the output (vector path)

struct EwParams {
  Instr code[kMaxInstr];
  const void* in[kMaxIn];
  int dtype[kMaxIn];  // per input (elemwise_kernel_any); the templated kernels take one T
  int out_dtype;
  int64_t stride[kMaxIn][kMaxDim];
  int kind[kMaxIn];
  bool keep[kMaxInstr];  // vector path: the value is read by an instruction other than the next
  int64_t row_len;  // kRow inputs: element e reads e % row_len
  int64_t oshape[kMaxDim];
  int64_t total;
  void* out;
  int ninstr, nin, ndim;
};

// MXNet's own (mshadow) semantics: the GPU has no oneDNN, so resolve() is run with
// dnnl = false on the host and ACT_RELU / GELU / LEAKY keep their plain forms; the
// oneDNN forms are implemented all the same.
__device__ float gelu(float a) { return 0.5f * a * (1.f + erff(a / 1.41421356237309504880f)); }

__device__ float unary(int op, float a) {
  using namespace mxf::expr;
  switch (op) {
    case NEG: return -a;
    case ABS: return fabsf(a);
    case EXP: return expf(a);
    case LOG: return logf(a);
    case SQRT: return sqrtf(a);
    case RSQRT: return 1.f / sqrtf(a);
    case TANH: return tanhf(a);
    case SIGMOID: return 1.f / (1.f + expf(-a));
    case RELU:
    case ACT_RELU: return !(a <= 0.f) ? a : 0.f;  // MXNet's relu: NaN stays NaN
    case RELU_DNNL: return a > 0.f ? a : 0.f;
    case ERF: return erff(a);
    case SQUARE: return a * a;
    case SOFTRELU: return a > 20.f ? a : log1pf(expf(a));
    case SOFTSIGN: return a / (1.f + fabsf(a));
    case LOG_SIGMOID: return -a > 20.f ? a : -log1pf(expf(-a));
    case MISH: return a * tanhf(a > 20.f ? a : log1pf(expf(a)));
    case LOG1P: return log1pf(a);
    case EXPM1: return expm1f(a);
    case GELU: return gelu(a);
    case GELU_DNNL: return gelu(a) + 0.f;
  }
  return a;
}

__device__ float binary(int op, float a, float b) {
  using namespace mxf::expr;
  switch (op) {
    case ADD: return __fadd_rn(a, b);
    case SUB: return __fsub_rn(a, b);
    case MUL: return __fmul_rn(a, b);  // _rn: never contracted with a neighbouring add
    case DIV: return a / b;
    case POW: return powf(a, b);
    case MAX: return (a != a || a > b) ? a : b;  // MXNet: a NaN left operand wins, ties give b
    case MIN: return (a != a || a < b) ? a : b;
    case LT: return a < b ? 1.f : 0.f;
    case LE: return a <= b ? 1.f : 0.f;
    case GT: return a > b ? 1.f : 0.f;
    case GE: return a >= b ? 1.f : 0.f;
    case EQ: return a == b ? 1.f : 0.f;
    case NE: return a != b ? 1.f : 0.f;
    case LEAKY: return a > 0.f ? a : __fmul_rn(a, b);
    case LEAKY_DNNL: return a > 0.f ? a : (b == 0.f ? 0.f : __fmul_rn(a, b));
  }
  return a;
}

__device__ float ternary(int op, float x, float b, float c) {
  using namespace mxf::expr;
  switch (op) {
    case WHERE: return x != 0.f ? b : c;
    case CLIP: return x > c ? c : (x < b ? b : x);  // MXNet's clip: NaN stays NaN
    case HARD_SIGMOID: {  // r = alpha x + beta, rounded twice as MXNet's
      float r = __fadd_rn(__fmul_rn(b, x), c);
      r = 1.f < r ? 1.f : r;
      return 0.f > r ? 0.f : r;
    }
  }
  return x;
}

__device__ __forceinline__ float apply(const Instr& c, float a, float b, float x) {
  if (c.c >= 0) return ternary(c.op, a, b, x);
  if (c.b < 0) return unary(c.op, a);
  return binary(c.op, a, b);
}

template <typename T>
__global__ void elemwise_kernel(const EwParams p) {
  using namespace mxf::expr;
  float v[kMaxInstr];
  const T* const* in = reinterpret_cast<const T* const*>(p.in);
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < p.total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    for (int i = 0; i < p.ninstr; ++i) {
      const Instr& c = p.code[i];
      if (c.op == LOAD) {
        int64_t rem = e, off = 0;
        for (int d = p.ndim - 1; d >= 0; --d) {
          off += (rem % p.oshape[d]) * p.stride[c.input][d];
          rem /= p.oshape[d];
        }
        v[i] = mxf_cuda::to_f(in[c.input][off]);
      } else if (c.op == CONST) {
        v[i] = c.imm;
      } else {
        v[i] = apply(c, v[c.a], c.b >= 0 ? v[c.b] : 0.f, c.c >= 0 ? v[c.c] : 0.f);
      }
    }
    static_cast<T*>(p.out)[e] = mxf_cuda::from_f<T>(v[p.ninstr - 1]);
  }
}

__device__ __forceinline__ float load_any(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case MXF_F16: return mxf_cuda::to_f(static_cast<const mxf_cuda::half*>(p)[i]);
    case MXF_BF16: return mxf_cuda::to_f(static_cast<const mxf_cuda::bf16*>(p)[i]);
  }
  return static_cast<const float*>(p)[i];
}

// One element per step, each input and the output in its own dtype.
__global__ void elemwise_kernel_any(const EwParams p) {
  using namespace mxf::expr;
  float v[kMaxInstr];
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < p.total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    for (int i = 0; i < p.ninstr; ++i) {
      const Instr& c = p.code[i];
      if (c.op == LOAD) {
        int64_t rem = e, off = 0;
        for (int d = p.ndim - 1; d >= 0; --d) {
          off += (rem % p.oshape[d]) * p.stride[c.input][d];
          rem /= p.oshape[d];
        }
        v[i] = load_any(p.in[c.input], p.dtype[c.input], off);
      } else if (c.op == CONST) {
        v[i] = c.imm;
      } else {
        v[i] = apply(c, v[c.a], c.b >= 0 ? v[c.b] : 0.f, c.c >= 0 ? v[c.c] : 0.f);
      }
    }
    const float r = v[p.ninstr - 1];
    switch (p.out_dtype) {
      case MXF_F16: static_cast<mxf_cuda::half*>(p.out)[e] = mxf_cuda::from_f<mxf_cuda::half>(r); break;
      case MXF_BF16: static_cast<mxf_cuda::bf16*>(p.out)[e] = mxf_cuda::from_f<mxf_cuda::bf16>(r); break;
      default: static_cast<float*>(p.out)[e] = r;
    }
  }
}

// 16 bytes of output per step; inputs kFull / kScalar / kRow (row_len a multiple of kN).
// The previous instruction's values stay in registers (cur); a value is stored to the
// (local-memory) value array only when an instruction other than the next one reads it
// (p.keep), so a chain of ops runs in registers.
template <typename T>
__global__ void elemwise_vec_kernel(const EwParams p) {
  using namespace mxf::expr;
  using V = mxf_cuda::Vec<T>;
  constexpr int kN = V::N;
  float v[kMaxInstr][kN];
  const T* const* in = reinterpret_cast<const T* const*>(p.in);
  const int64_t nv = p.total / kN;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; q < nv;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = q * kN;
    float cur[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) cur[j] = 0.f;
    for (int i = 0; i < p.ninstr; ++i) {
      const Instr& c = p.code[i];
      float res[kN];
      // operands: the previous instruction's from registers, older ones from the value array
      const bool ap = c.a == i - 1, bp = c.b == i - 1, cp = c.c == i - 1;
      if (c.op == LOAD) {
        const int k = p.kind[c.input];
        if (k == kScalar) {
          const float x = mxf_cuda::to_f(in[c.input][0]);
#pragma unroll
          for (int j = 0; j < kN; ++j) res[j] = x;
        } else {
          const V x = mxf_cuda::load_vec(in[c.input] + (k == kRow ? e0 % p.row_len : e0));
#pragma unroll
          for (int j = 0; j < kN; ++j) res[j] = mxf_cuda::to_f(x.u.e[j]);
        }
      } else if (c.op == CONST) {
#pragma unroll
        for (int j = 0; j < kN; ++j) res[j] = c.imm;
      } else if (c.c >= 0) {
#pragma unroll
        for (int j = 0; j < kN; ++j)
          res[j] = ternary(c.op, ap ? cur[j] : v[c.a][j], bp ? cur[j] : v[c.b][j], cp ? cur[j] : v[c.c][j]);
      } else if (c.b < 0) {
#pragma unroll
        for (int j = 0; j < kN; ++j) res[j] = unary(c.op, ap ? cur[j] : v[c.a][j]);
      } else {
#pragma unroll
        for (int j = 0; j < kN; ++j) res[j] = binary(c.op, ap ? cur[j] : v[c.a][j], bp ? cur[j] : v[c.b][j]);
      }
#pragma unroll
      for (int j = 0; j < kN; ++j) cur[j] = res[j];
      if (p.keep[i]) {
#pragma unroll
        for (int j = 0; j < kN; ++j) v[i][j] = res[j];
      }
    }
    V o;
#pragma unroll
    for (int j = 0; j < kN; ++j) o.u.e[j] = mxf_cuda::from_f<T>(cur[j]);
    mxf_cuda::store_vec(static_cast<T*>(p.out) + e0, o);
  }
}

}  // namespace

namespace mxf_ew {

int interpret(const mxf::expr::Program& prog, const int* in_dtypes, const void* const* inputs,
              const int64_t* const* shapes, const int* ndims, int out_dtype, void* out, std::string* err,
              cudaStream_t st) {
  if (static_cast<int>(prog.code.size()) > kMaxInstr) {
    *err = "program too long for the interpreter (" + std::to_string(prog.code.size()) + " instructions, max " +
           std::to_string(kMaxInstr) + ")";
    return MXF_ERR_UNSUPPORTED;
  }
  if (prog.num_inputs > kMaxIn) {
    *err = "too many inputs for the interpreter (max 8)";
    return MXF_ERR_UNSUPPORTED;
  }
  bool uniform = true;
  for (int k = 0; k < prog.num_inputs; ++k) uniform = uniform && in_dtypes[k] == out_dtype;
  const size_t es = mxf_cuda::dtype_bytes(out_dtype);
  EwParams p{};
  int ndim = 0;
  for (int k = 0; k < prog.num_inputs; ++k) ndim = std::max(ndim, ndims[k]);
  if (ndim > kMaxDim) {
    *err = "rank > 6";
    return MXF_ERR_BAD_ARGS;
  }
  p.ndim = ndim;
  for (int d = 0; d < kMaxDim; ++d) p.oshape[d] = 1;
  for (int k = 0; k < prog.num_inputs; ++k)
    for (int d = 0; d < ndims[k]; ++d) {
      int64_t& o = p.oshape[ndim - ndims[k] + d];
      const int64_t s = shapes[k][d];
      if (s == o || s == 1) continue;
      if (o == 1) { o = s; continue; }
      *err = "inputs do not broadcast together";
      return MXF_ERR_BAD_ARGS;
    }
  p.total = 1;
  for (int d = 0; d < ndim; ++d) p.total *= p.oshape[d];
  const int64_t last = ndim > 0 ? p.oshape[ndim - 1] : 1;
  const int vn = static_cast<int>(16 / es);
  bool vec = uniform && p.total % vn == 0 && mxf_cuda::aligned16(out);
  p.row_len = last;
  for (int k = 0; k < prog.num_inputs; ++k) {
    int64_t acc = 1, size = 1;
    for (int d = ndim - 1; d >= 0; --d) {
      const int kd = d - (ndim - ndims[k]);
      const int64_t s = kd >= 0 ? shapes[k][kd] : 1;
      p.stride[k][d] = s == 1 ? 0 : acc;
      acc *= s;
      size *= s;
    }
    p.in[k] = inputs[k];
    p.dtype[k] = in_dtypes[k];
    if (size == 1) {
      p.kind[k] = kScalar;
    } else if (size == p.total) {
      p.kind[k] = kFull;
    } else if (size == last && ndims[k] >= 1 && shapes[k][ndims[k] - 1] == last && last % vn == 0) {
      p.kind[k] = kRow;
    } else {
      vec = false;
    }
    if (size != 1 && !mxf_cuda::aligned16(inputs[k])) vec = false;
  }
  // each value's rank (its operands' largest, as MXNet's ops give it) resolves the ops
  // MXNet would run through oneDNN on a CPU; the GPU has none
  std::vector<int> rank(prog.code.size(), 0);
  for (size_t i = 0; i < prog.code.size(); ++i) {
    p.code[i] = prog.code[i];
    const Instr& c = prog.code[i];
    if (c.op == mxf::expr::LOAD) rank[i] = ndims[c.input];
    for (int k : {c.a, c.b, c.c})
      if (k >= 0) rank[i] = std::max(rank[i], rank[k]);
    p.code[i].op = mxf::expr::resolve(c.op, rank[i], /*dnnl=*/false);
  }
  p.ninstr = static_cast<int>(prog.code.size());
  for (int i = 0; i < p.ninstr; ++i) {
    const Instr& c = p.code[i];
    for (int k : {c.a, c.b, c.c})
      if (k >= 0 && k != i - 1) p.keep[k] = true;
  }
  p.nin = prog.num_inputs;
  p.out = out;
  p.out_dtype = out_dtype;
  if (p.total == 0) return 0;
  const int threads = 256;
  const int64_t work = vec ? p.total / vn : p.total;
  const int64_t blocks = std::min<int64_t>((work + threads - 1) / threads, 65535 * 8);
  if (!uniform) {
    elemwise_kernel_any<<<static_cast<unsigned>(blocks), threads, 0, st>>>(p);
    MXF_CUDA_RETURN_LAST();
  }
  return mxf_cuda::dispatch_dtype(out_dtype, [&](auto t) {
    using T = decltype(t);
    if (vec) elemwise_vec_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, st>>>(p);
    else elemwise_kernel<T><<<static_cast<unsigned>(blocks), threads, 0, st>>>(p);
    MXF_CUDA_RETURN_LAST();
  });
}

}  // namespace mxf_ew
