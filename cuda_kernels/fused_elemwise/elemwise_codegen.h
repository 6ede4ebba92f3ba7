// CUDA C source for one fused_elemwise expression, compiled at run time with NVRTC
// (elemwise_jit.cu) -- the GPU's per-expression kernels, forward and backward.
//
// Depends only on the C++ standard library and expr_program.h, so that the op library (g++)
// carries it too: the tests generate every kind of source on a machine without a GPU, compile
// it to PTX with NVRTC and, as host C++, compare its element functions with the CPU op.
//
// A kernel is specialised for (program, dtypes, broadcast pattern, vector width):
//  - the inputs' and the output's shapes are collapsed first (collapse()): size-1 output dims
//    dropped, neighbouring dims merged where every input broadcasts along both or neither, so
//    an output read only by full-size and single-element inputs is one flat dim;
//  - each thread step handles `vec` consecutive output elements (16 bytes of the narrowest
//    tensor accessed in place): inputs whose innermost dim is contiguous are read with
//    aligned vector loads, inputs broadcast along it as one element; the output is written
//    with vector stores.  Arithmetic is float32 whatever the storage dtype;
//  - the element functions (mxf_ew_forward / mxf_ew_gradient) are straight-line float code of
//    the program's SSA, the same text on the device and, for the tests, on the host (where the
//    elementary functions are the CPU op's own: act.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "expr_program.h"

namespace mxf {
namespace expr {

// storage dtypes (mxf_cuda_types.h's codes)
enum { kGenF32 = 0, kGenF16 = 1, kGenBF16 = 2 };
constexpr int kMaxGenDims = 6;
constexpr int kMaxGenInputs = 32;

// The collapsed iteration space of one call.
struct Layout {
  std::vector<int64_t> shape;              // the output's collapsed dims (at least one)
  std::vector<uint32_t> bcast;             // per input: bit d = broadcast along collapsed dim d
  std::vector<std::vector<int64_t>> stride;  // per input: element stride per collapsed dim (0: broadcast)
  int64_t total = 0;
  // inputs that are the output's size and layout (no broadcast dim): read and, in the backward
  // pass, written at the output's offsets
  bool full(int k) const { return bcast[k] == 0; }
};

// `in_shapes` broadcast together (NumPy rules) into `out_shape`; throws ExprError when they do
// not, or when the collapsed rank exceeds kMaxGenDims.
Layout collapse(const std::vector<int64_t>& out_shape, const std::vector<std::vector<int64_t>>& in_shapes);

struct KernelSpec {
  bool backward = false;
  std::vector<Instr> code;   // the program with resolve() applied for the target
  int num_inputs = 0;
  std::vector<int> in_dtypes;  // per input
  int out_dtype = kGenF32;     // forward: the output; backward: dy
  std::vector<int> grad_dtypes;  // backward: per input, its gradient's dtype (full inputs)
  int ndim = 1;                // collapsed rank
  std::vector<uint32_t> bcast;  // per input, as Layout::bcast
  int vec = 1;                 // elements per thread step: 1, 2, 4, 8 or 16
  bool idx32 = false;          // every element index fits 32 bits (cheaper index arithmetic)
  // The cache key: every field above in text (the program as its instructions).
  std::string key() const;
};

// The widest vector step `layout` allows for these dtypes (16 bytes of the narrowest tensor
// read or written in place; 1 when the innermost dim is not a multiple of it or a pointer is
// not aligned to its vector).  `ptrs`: the input pointers then the output (or, backward, the
// gradients of full inputs), as integers.
int choose_vec(const Layout& layout, const std::vector<int>& in_dtypes, int out_dtype,
               const std::vector<uintptr_t>& in_ptrs, uintptr_t out_ptr);

// The whole CUDA source: prelude, element function(s), kernel (extern "C" mxf_ew_fwd or
// mxf_ew_bwd; parameters in elemwise_jit.cu's order).  Kernels sit under __CUDACC__, so the
// same text compiled as host C++ (after act.h and elemwise_eval.h, see the tests) declares only
// the element functions.
std::string generate(const KernelSpec& spec);

// The program's code with resolve() applied per value: a value's rank is its operands' largest,
// an input's its number of dims (`ndims`), as MXNet's operators give it.  dnnl=false: MXNet's own
// kernels (its GPU ones, and its CPU ones with MXNET_MKLDNN_ENABLED=0).
std::vector<Instr> resolved(const Program& p, const std::vector<int>& ndims, bool dnnl);

// NumPy's broadcast shape of `shapes`; throws ExprError when they do not broadcast together.
std::vector<int64_t> broadcast_shapes(const std::vector<std::vector<int64_t>>& shapes);

// Per instruction: whether its adjoint is wanted (it leads to an input) and whether an adjoint
// flows into it, exactly as the CPU op's backward decides (fused_elemwise.cc).
void gradient_flow(const std::vector<Instr>& code, std::vector<char>* wants, std::vector<char>* flows);

}  // namespace expr
}  // namespace mxf
