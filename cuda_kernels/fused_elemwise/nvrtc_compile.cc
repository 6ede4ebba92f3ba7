// NVRTC through dlopen (see nvrtc_compile.h).
#include "nvrtc_compile.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace mxf {
namespace nvrtc {

namespace {

// nvrtc.h's C API (stable since CUDA 11): nvrtcResult is an enum, NVRTC_SUCCESS = 0
typedef int Result;
typedef struct _nvrtcProgram* Program;

struct Api {
  Result (*version)(int*, int*) = nullptr;
  Result (*num_archs)(int*) = nullptr;
  Result (*archs)(int*) = nullptr;
  Result (*create)(Program*, const char*, const char*, int, const char* const*, const char* const*) = nullptr;
  Result (*compile)(Program, int, const char* const*) = nullptr;
  Result (*log_size)(Program, size_t*) = nullptr;
  Result (*log)(Program, char*) = nullptr;
  Result (*ptx_size)(Program, size_t*) = nullptr;
  Result (*ptx)(Program, char*) = nullptr;
  Result (*cubin_size)(Program, size_t*) = nullptr;
  Result (*cubin)(Program, char*) = nullptr;
  Result (*destroy)(Program*) = nullptr;
  const char* (*error_string)(Result) = nullptr;
  std::string path, error;
  int major = 0, minor = 0;
  std::vector<int> supported;
};

template <class F>
bool bind(void* h, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(h, name));
  return *fn != nullptr;
}

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    std::vector<std::string> cands;
    if (const char* e = std::getenv("MXFUSION_NVRTC_LIB"))
      if (*e) cands.emplace_back(e);
    for (const char* n : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", "/usr/local/cuda/lib64/libnvrtc.so"})
      cands.emplace_back(n);
    std::string tried;
    void* h = nullptr;
    for (const auto& c : cands) {
      h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h) {
        a.path = c;
        break;
      }
      const char* e = dlerror();
      tried += "\n  " + c + ": " + (e ? e : "not found");
    }
    if (!h) {
      a.error = "NVRTC (libnvrtc.so) not found; install the nvidia-cuda-nvrtc wheel or set MXFUSION_NVRTC_LIB. "
                "Tried:" + tried;
      return;
    }
    Dl_info info;
    bool ok = bind(h, "nvrtcVersion", &a.version) && bind(h, "nvrtcCreateProgram", &a.create) &&
              bind(h, "nvrtcCompileProgram", &a.compile) && bind(h, "nvrtcGetProgramLogSize", &a.log_size) &&
              bind(h, "nvrtcGetProgramLog", &a.log) && bind(h, "nvrtcGetPTXSize", &a.ptx_size) &&
              bind(h, "nvrtcGetPTX", &a.ptx) && bind(h, "nvrtcGetCUBINSize", &a.cubin_size) &&
              bind(h, "nvrtcGetCUBIN", &a.cubin) && bind(h, "nvrtcDestroyProgram", &a.destroy) &&
              bind(h, "nvrtcGetErrorString", &a.error_string);
    if (!ok) {
      a.error = "NVRTC at " + a.path + " lacks a function this build needs (older than CUDA 11.1?)";
      return;
    }
    if (dladdr(reinterpret_cast<void*>(a.version), &info) && info.dli_fname) a.path = info.dli_fname;
    a.version(&a.major, &a.minor);
    if (bind(h, "nvrtcGetNumSupportedArchs", &a.num_archs) && bind(h, "nvrtcGetSupportedArchs", &a.archs)) {
      int n = 0;
      if (a.num_archs(&n) == 0 && n > 0) {
        a.supported.resize(n);
        if (a.archs(a.supported.data()) != 0) a.supported.clear();
      }
    }
  });
  return a;
}

}  // namespace

bool available(std::string* why) {
  const Api& a = api();
  if (why) *why = a.error;
  return a.error.empty();
}

std::string describe() {
  const Api& a = api();
  if (!a.error.empty()) return a.error;
  return "NVRTC " + std::to_string(a.major) + "." + std::to_string(a.minor) + " (" + a.path + ")";
}

int version() {
  const Api& a = api();
  return a.error.empty() ? a.major * 1000 + a.minor * 10 : 0;
}

int best_arch(int arch) {
  const Api& a = api();
  if (!a.error.empty()) return 0;
  if (a.supported.empty()) return arch;  // no list: let the compile say
  int best = 0;
  for (int s : a.supported)
    if (s <= arch && s > best) best = s;
  return best;
}

std::vector<std::string> options(int arch, bool ptx) {
  return {std::string("--gpu-architecture=") + (ptx ? "compute_" : "sm_") + std::to_string(arch),
          "--std=c++17", "--fmad=false", "-DMXF_NVRTC=1"};
}

bool compile(const std::string& source, const std::string& name, int arch, bool ptx, std::string* out,
             std::string* log) {
  const Api& a = api();
  if (!a.error.empty()) {
    *log = a.error;
    return false;
  }
  Program prog = nullptr;
  Result r = a.create(&prog, source.c_str(), name.c_str(), 0, nullptr, nullptr);
  if (r != 0) {
    *log = std::string("nvrtcCreateProgram: ") + a.error_string(r);
    return false;
  }
  const std::vector<std::string> opts = options(arch, ptx);
  std::vector<const char*> argv;
  for (const auto& s : opts) argv.push_back(s.c_str());
  r = a.compile(prog, static_cast<int>(argv.size()), argv.data());
  size_t n = 0;
  log->clear();
  if (a.log_size(prog, &n) == 0 && n > 1) {
    log->resize(n);
    a.log(prog, &(*log)[0]);
    log->resize(n - 1);
  }
  bool ok = r == 0;
  if (!ok) {
    *log = std::string("nvrtcCompileProgram: ") + a.error_string(r) + "\n" + *log;
  } else {
    n = 0;
    Result s = ptx ? a.ptx_size(prog, &n) : a.cubin_size(prog, &n);
    if (s == 0 && n > 0) {
      out->resize(n);
      s = ptx ? a.ptx(prog, &(*out)[0]) : a.cubin(prog, &(*out)[0]);
    }
    if (s != 0 || n == 0) {
      ok = false;
      *log = std::string("reading NVRTC's output: ") + (s ? a.error_string(s) : "empty");
    }
  }
  a.destroy(&prog);
  return ok;
}

}  // namespace nvrtc
}  // namespace mxf

// For the tests: NVRTC as the CUDA kernels use it.  Compiles `src` for sm_<arch> (CUBIN) or
// compute_<arch> (PTX); returns the output's size (copied into out when it fits), or -1 with the
// log in `log`.  mxf_nvrtc_describe(): NVRTC's version and path, or why it is unavailable.
extern "C" long long mxf_nvrtc_compile(const char* src, int arch, int ptx, char* out, long long outlen, char* log,
                                       int loglen) {
  std::string bin, text;
  const bool ok = mxf::nvrtc::compile(src ? src : "", "mxf_test.cu", arch, ptx != 0, &bin, &text);
  if (log && loglen > 0) {
    const size_t n = std::min(text.size(), static_cast<size_t>(loglen - 1));
    std::memcpy(log, text.data(), n);
    log[n] = 0;
  }
  if (!ok) return -1;
  if (out && outlen >= static_cast<long long>(bin.size())) std::memcpy(out, bin.data(), bin.size());
  return static_cast<long long>(bin.size());
}

extern "C" const char* mxf_nvrtc_describe() {
  static const std::string d = mxf::nvrtc::describe();
  return d.c_str();
}
