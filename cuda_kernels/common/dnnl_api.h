// The oneDNN 3.x C functions the fused ops call, typed from oneDNN's own header.
//
// The library (libdnnl.so.3 from the onednn-cpu-gomp wheel) is opened at run time with
// RTLD_LOCAL by dnnl_symbol() (common.cc): MXNet 1.9.1 carries oneDNN 2.x with the same
// symbol names, so the fused ops never link against libdnnl directly.  The header
// (onednn-devel-cpu-gomp, the same release) gives every type, enum and signature; this table
// holds one pointer per function, each declared as `decltype(&::dnnl_...)`, so a call reads
// as the C API does: `api.dnnl_memory_create(&mem, md, api.engine, handle)`.
#pragma once
#include <oneapi/dnnl/dnnl.h>

#include <string>

namespace mxf {

// Every oneDNN function the op library uses.  A function added here is bound with the rest;
// a library without it makes the whole table unusable (with the missing names in `error`).
#define MXF_DNNL_FUNCTIONS(X)                                                            \
  X(dnnl_engine_create) X(dnnl_stream_create) X(dnnl_stream_wait) X(dnnl_stream_destroy) \
  X(dnnl_memory_desc_create_with_strides) X(dnnl_memory_desc_create_with_tag)            \
  X(dnnl_memory_desc_clone) X(dnnl_memory_desc_equal) X(dnnl_memory_desc_get_size)       \
  X(dnnl_memory_desc_destroy)                                                            \
  X(dnnl_memory_create) X(dnnl_memory_set_data_handle) X(dnnl_memory_get_data_handle)    \
  X(dnnl_memory_destroy)                                                                 \
  X(dnnl_matmul_primitive_desc_create) X(dnnl_convolution_forward_primitive_desc_create) \
  X(dnnl_deconvolution_forward_primitive_desc_create)                                    \
  X(dnnl_reorder_primitive_desc_create) X(dnnl_eltwise_forward_primitive_desc_create)    \
  X(dnnl_binary_primitive_desc_create) X(dnnl_pooling_forward_primitive_desc_create)     \
  X(dnnl_primitive_desc_query_md) X(dnnl_primitive_desc_query)                           \
  X(dnnl_primitive_desc_destroy)                                                         \
  X(dnnl_primitive_create) X(dnnl_primitive_execute) X(dnnl_primitive_destroy)           \
  X(dnnl_post_ops_create) X(dnnl_post_ops_append_eltwise) X(dnnl_post_ops_append_binary) \
  X(dnnl_post_ops_append_sum) X(dnnl_post_ops_append_dw) X(dnnl_post_ops_destroy)        \
  X(dnnl_primitive_attr_create) X(dnnl_primitive_attr_set_post_ops)                      \
  X(dnnl_primitive_attr_set_scratchpad_mode) X(dnnl_primitive_attr_set_fpmath_mode)      \
  X(dnnl_primitive_attr_destroy)                                                         \
  X(dnnl_concat_primitive_desc_create) X(dnnl_memory_desc_query)                         \
  X(dnnl_get_effective_cpu_isa)

struct DnnlApi {
#define MXF_DNNL_MEMBER(f) decltype(&::f) f = nullptr;
  MXF_DNNL_FUNCTIONS(MXF_DNNL_MEMBER)
#undef MXF_DNNL_MEMBER
  dnnl_engine_t engine = nullptr;  // the CPU engine; null when the table is unusable
  std::string error;               // why it is unusable (empty when it is usable)
};

// The table, bound once (thread-safe).  Usable when `engine` is set.
const DnnlApi& dnnl();

// Whether oneDNN implements `pd` with its reference code (implementation name "ref:..."): what it
// falls back to where no optimised kernel takes the layouts asked for on this CPU, e.g. 16-channel
// blocked convolutions on a CPU without AVX-512 -- orders of magnitude slower than the ops' own
// direct loops, so the ops never run it.
bool dnnl_reference_impl(const_dnnl_primitive_desc_t pd);

// How good a kernel oneDNN picked for `pd`, lower is better: 0 its direct kernels (jit, brgemm) for
// the CPU's vector width, 1 direct kernels for a narrower one ("jit_1x1:avx2" on an AVX-512 CPU,
// which a channel-blocked-by-8 source gets there: its nChw8c output then sends the binary ops after
// it to oneDNN's reference code, SE-ResNeXt50 378 ms against 45 ms, measured), 2 its gemm-based ones
// ("gemm:jit", "x64:gemm:jit": im2col and a matrix product, in plain layouts -- what a convolution
// falls to on a layout or a group width the direct kernels do not take, 2-3x slower than a direct
// kernel of the same convolution, measured on AVX2), 3 its reference code.
int dnnl_impl_rank(const_dnnl_primitive_desc_t pd);

// The calling thread's in-order oneDNN stream on dnnl().engine (MXNet may run ops from
// several engine threads); null when none can be created.
dnnl_stream_t dnnl_thread_stream();

}  // namespace mxf
