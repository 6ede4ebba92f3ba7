// NVRTC, opened with dlopen at first use (no link to it, no header of it needed to build):
// CUDA C source to CUBIN for one GPU architecture, or to PTX.  MXNet's own GPU pointwise
// fusion loads NVRTC the same way.
//
// The library is looked for as MXFUSION_NVRTC_LIB names it, then libnvrtc.so.13 / .12 / .so on
// the loader's path (from the CUDA kernel library: beside cuBLASLt, which the PyPI wheels
// nvidia-cuda-nvrtc and nvidia-cublas install into one folder, nvidia/cu13/lib), then
// /usr/local/cuda/lib64.  Plain C++: the op library (g++) and the CUDA kernel library both
// carry it.
#pragma once
#include <string>
#include <vector>

namespace mxf {
namespace nvrtc {

// Whether NVRTC could be opened; `why` (optional) says why not.  Thread-safe; tries once.
bool available(std::string* why = nullptr);
// "NVRTC 13.0 (<path>)", or why it is unavailable
std::string describe();
// NVRTC's version as major * 1000 + minor * 10 (e.g. 13000), 0 when unavailable.
int version();
// The highest architecture (e.g. 90) this NVRTC compiles for that is <= `arch`, or 0.
int best_arch(int arch);

// The compile options every kernel is built with: float32 IEEE arithmetic without contraction
// (--fmad=false: a product and a sum round separately, as MXNet's separate operators round them),
// C++17.
std::vector<std::string> options(int arch, bool ptx);

// Compiles `source` for sm_<arch> (CUBIN) or, with `ptx`, compute_<arch> (PTX).  False with the
// compiler's log (or why NVRTC is unavailable) in `log`.
bool compile(const std::string& source, const std::string& name, int arch, bool ptx, std::string* out,
             std::string* log);

}  // namespace nvrtc
}  // namespace mxf
