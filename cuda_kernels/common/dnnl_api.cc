// Binding of the oneDNN function table (see dnnl_api.h).
#include "dnnl_api.h"

#include <mutex>
#include <string>

#include "mxf_common.h"

namespace mxf {

const DnnlApi& dnnl() {
  static DnnlApi a;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string missing;
#define MXF_DNNL_BIND(f)                                                 \
  a.f = reinterpret_cast<decltype(a.f)>(dnnl_symbol(#f));                \
  if (!a.f) missing += std::string(missing.empty() ? "" : ", ") + #f;
    MXF_DNNL_FUNCTIONS(MXF_DNNL_BIND)
#undef MXF_DNNL_BIND
    if (!missing.empty()) {
      a.error = "oneDNN 3.x API not found in the oneDNN library (" + missing + ")";
      return;
    }
    if (a.dnnl_engine_create(&a.engine, dnnl_cpu, 0) != dnnl_success) {
      a.engine = nullptr;
      a.error = "oneDNN CPU engine could not be created";
    }
  });
  return a;
}

bool dnnl_reference_impl(const_dnnl_primitive_desc_t pd) {
  const char* name = nullptr;
  if (!pd || dnnl().dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name) != dnnl_success || !name)
    return false;
  return std::string(name).compare(0, 4, "ref:") == 0;
}

int dnnl_impl_rank(const_dnnl_primitive_desc_t pd) {
  const char* name = nullptr;
  if (!pd || dnnl().dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name) != dnnl_success || !name)
    return 0;
  const std::string n(name);
  if (n.compare(0, 4, "ref:") == 0) return 3;
  const size_t g = n.find("gemm");  // "gemm:jit", "x64:gemm:jit"; not a "brgemm" kernel (direct)
  if (g != std::string::npos && (g < 2 || n.compare(g - 2, 2, "br") != 0)) return 2;
  // a direct kernel for a narrower vector than the CPU's ("jit_1x1:avx2" on AVX-512): its layout
  // (nChw8c) also sends the binary ops after it to reference code there
  static const bool avx512 = (static_cast<unsigned>(dnnl().dnnl_get_effective_cpu_isa()) &
                              static_cast<unsigned>(dnnl_cpu_isa_avx512_core)) ==
                             static_cast<unsigned>(dnnl_cpu_isa_avx512_core);
  const size_t colon = n.rfind(':');
  const std::string isa = colon == std::string::npos ? "" : n.substr(colon + 1);
  return avx512 && (isa == "avx2" || isa == "avx" || isa == "sse41") ? 1 : 0;
}

dnnl_stream_t dnnl_thread_stream() {
  struct Stream {
    dnnl_stream_t s = nullptr;
    ~Stream() {
      if (s) dnnl().dnnl_stream_destroy(s);
    }
  };
  thread_local Stream st;
  const DnnlApi& a = dnnl();
  if (!st.s && a.engine &&
      a.dnnl_stream_create(&st.s, a.engine, dnnl_stream_default_flags) != dnnl_success)
    st.s = nullptr;
  return st.s;
}

}  // namespace mxf
