// fused_elemwise on the GPU: a kernel per (expression, dtypes, broadcast pattern, vector width),
// generated from the op's program (elemwise_codegen.h), compiled by NVRTC (nvrtc_compile.h) to a
// CUBIN for the device's architecture (PTX for the newest NVRTC knows when the device is newer),
// cached in memory per process and on disk per (source, NVRTC version, architecture), loaded with
// the CUDA runtime's library API (cudaLibraryLoadData / cudaLibraryGetKernel, CUDA 12+; the
// runtime is linked statically, no link to libcuda) and launched with cudaLaunchKernel.
// The forward falls back to the interpreter (fused_elemwise.cu) where NVRTC is unavailable or a
// kernel cannot be built; the backward has no fallback.
//
// Backward: the generated kernel recomputes the program per element and writes each input's
// gradient -- in place for an input of the output's size and layout, else as float32 into a
// workspace buffer of the output's size, which a fixed kernel then sums over the axes the input
// broadcasts along (in a fixed order: deterministic).
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_common.cuh"
#include "elemwise_codegen.h"
#include "elemwise_jit.h"
#include "fused_elemwise.h"
#include "nvrtc_compile.h"

namespace {

using mxf::expr::KernelSpec;
using mxf::expr::Layout;
using mxf::expr::Program;

// ---- settings and status ---------------------------------------------------------------------

std::atomic<int> g_jit{-1};  // -1: not read yet (MXFUSION_ELEMWISE_JIT)
std::mutex g_status_mu;
std::string g_last_failure;  // the last kernel that could not be built, and why

bool jit_enabled() {
  int v = g_jit.load();
  if (v < 0) {
    const char* e = std::getenv("MXFUSION_ELEMWISE_JIT");
    v = (e && std::string(e) == "0") ? 0 : 1;
    g_jit.store(v);
  }
  return v == 1;
}

void note_failure(const std::string& what) {
  std::lock_guard<std::mutex> lk(g_status_mu);
  g_last_failure = what;
}

int fail(char* err, int errlen, int rc, const std::string& msg) {
  if (err && errlen > 0) {
    std::strncpy(err, msg.c_str(), errlen - 1);
    err[errlen - 1] = 0;
  }
  return rc;
}

// ---- the disk cache --------------------------------------------------------------------------

std::string cache_dir() {
  const char* e = std::getenv("MXFUSION_NVRTC_CACHE_DIR");
  if (e) return std::string(e) == "off" ? std::string() : std::string(e);
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  std::string base = xdg && *xdg ? xdg : "";
  if (base.empty()) {
    const char* home = std::getenv("HOME");
    if (!home || !*home) return "";
    base = std::string(home) + "/.cache";
  }
  return base + "/mxnet-fusion/nvrtc";
}

bool make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i)
    if (i == path.size() || path[i] == '/') {
      const std::string p = path.substr(0, i);
      if (mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) return false;
    }
  return true;
}

// 128 bits of FNV-1a (two 64-bit hashes, different offsets) as 32 hex digits: the file name.  The
// file also holds the whole key, compared on reading, so a collision or a damaged file is a miss.
std::string hash_hex(const std::string& s) {
  uint64_t a = 1469598103934665603ull, b = 0x84222325cbf29ce4ull;
  for (unsigned char c : s) {
    a = (a ^ c) * 1099511628211ull;
    b = (b ^ c) * 1099511628211ull + 0x9e3779b97f4a7c15ull;
  }
  char buf[40];
  std::snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b));
  return buf;
}

const char kMagic[] = "mxnet-fusion nvrtc 1\n";

bool read_cached(const std::string& path, const std::string& key, std::string* bin) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return false;
  std::string data;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.append(buf, n);
  std::fclose(f);
  const std::string head = kMagic + std::to_string(key.size()) + "\n" + key;
  if (data.size() <= head.size() || data.compare(0, head.size(), head) != 0) return false;
  *bin = data.substr(head.size());
  return true;
}

// Written to a file of its own, then renamed over the name: a reader sees the whole file or none.
void write_cached(const std::string& dir, const std::string& path, const std::string& key, const std::string& bin) {
  if (!make_dirs(dir)) return;
  char tid[64];
  std::snprintf(tid, sizeof tid, ".%d.%zu.tmp", static_cast<int>(getpid()),
                std::hash<std::thread::id>()(std::this_thread::get_id()));
  const std::string tmp = path + tid;
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) return;
  const std::string head = kMagic + std::to_string(key.size()) + "\n" + key;
  const bool ok = std::fwrite(head.data(), 1, head.size(), f) == head.size() &&
                  std::fwrite(bin.data(), 1, bin.size(), f) == bin.size();
  if (std::fclose(f) == 0 && ok) std::rename(tmp.c_str(), path.c_str());
  else std::remove(tmp.c_str());
}

// ---- compiled kernels --------------------------------------------------------------------------

struct Device {
  int arch = 0, sms = 0;
};

int device_of(Device* d) {
  int dev = 0;
  MXF_CUDA_TRY(cudaGetDevice(&dev));
  static std::mutex mu;
  static std::map<int, Device> devices;
  std::lock_guard<std::mutex> lk(mu);
  auto it = devices.find(dev);
  if (it == devices.end()) {
    int major = 0, minor = 0, sms = 0;
    MXF_CUDA_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    MXF_CUDA_TRY(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    MXF_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    it = devices.emplace(dev, Device{major * 10 + minor, sms}).first;
  }
  *d = it->second;
  return 0;
}

struct Compiled {
  cudaKernel_t kernel = nullptr;
  std::string error;  // why it could not be built (kernel null)
};

// The kernel for `spec` on a device of architecture `arch`: from memory, the disk, or NVRTC.
const Compiled& kernel_for(const KernelSpec& spec, int arch) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Compiled>> cache;
  const std::string mkey = spec.key() + "|" + std::to_string(arch);
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(mkey);
  if (it != cache.end()) return *it->second;
  auto c = std::make_unique<Compiled>();
  const char* name = spec.backward ? "mxf_ew_bwd" : "mxf_ew_fwd";
  std::string why;
  if (!mxf::nvrtc::available(&why)) {
    c->error = why;
  } else {
    std::string source, bin, log;
    try {
      source = mxf::expr::generate(spec);
    } catch (const std::exception& e) {
      c->error = std::string("code generation failed: ") + e.what();
    }
    // the device's own architecture as CUBIN; an architecture newer than NVRTC knows as PTX
    // for the newest it does (the driver compiles it)
    const int target = mxf::nvrtc::best_arch(arch);
    const bool ptx = target != arch;
    if (c->error.empty() && target == 0)
      c->error = "NVRTC " + std::to_string(mxf::nvrtc::version()) + " compiles for no architecture <= sm_" +
                 std::to_string(arch);
    if (c->error.empty()) {
      std::string key = source + "\n// NVRTC " + std::to_string(mxf::nvrtc::version()) + " arch " +
                        std::to_string(target) + (ptx ? " ptx" : " cubin");
      for (const auto& o : mxf::nvrtc::options(target, ptx)) key += " " + o;
      const std::string dir = cache_dir();
      const std::string path = dir.empty() ? "" : dir + "/" + hash_hex(key) + (ptx ? ".ptx" : ".cubin");
      if (path.empty() || !read_cached(path, key, &bin)) {
        if (!mxf::nvrtc::compile(source, "fused_elemwise.cu", target, ptx, &bin, &log))
          c->error = "NVRTC could not compile the kernel: " + log.substr(0, 4000);
        else if (!path.empty())
          write_cached(dir, path, key, bin);
      }
    }
    if (c->error.empty()) {
      cudaLibrary_t lib = nullptr;
      cudaError_t e = cudaLibraryLoadData(&lib, bin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
      if (e == cudaSuccess) e = cudaLibraryGetKernel(&c->kernel, lib, name);
      if (e != cudaSuccess) {
        cudaGetLastError();  // clear it: the call's failure is reported, not left for the next launch
        c->kernel = nullptr;
        c->error = std::string("loading the compiled kernel failed: ") + cudaGetErrorString(e);
      }
      // the library stays loaded for the process's life (the cache owns its kernel)
    }
  }
  if (!c->error.empty()) note_failure(std::string(spec.backward ? "backward" : "forward") + " kernel: " + c->error);
  return *cache.emplace(mkey, std::move(c)).first->second;
}

// ---- calls -------------------------------------------------------------------------------------

struct Dims6 {
  long long d[6];
};

// A call's program, layout and shapes, parsed once per (expression, shapes): the interpreter's
// parse and the layout would otherwise run on every call.
struct Call {
  Program prog;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int> ndims;
  std::vector<int64_t> out_shape;
  Layout layout;
  std::vector<mxf::expr::Instr> code;  // resolved for the GPU (MXNet's own kernels)
};

std::shared_ptr<const Call> call_for(const char* expr, int num_args, const int64_t* const* shapes,
                                     const int* ndims) {
  // the program is parsed first: its inputs say how many shapes there are
  static std::mutex mu;
  static std::map<std::pair<std::string, int>, Program> progs;
  static std::map<std::string, std::shared_ptr<const Call>> calls;
  Program prog;
  {
    std::lock_guard<std::mutex> lk(mu);
    auto key = std::make_pair(std::string(expr), num_args);
    auto it = progs.find(key);
    if (it == progs.end()) it = progs.emplace(key, mxf::expr::compile(expr, num_args)).first;  // may throw
    prog = it->second;
  }
  std::string key = std::string(expr) + "|" + std::to_string(num_args);
  for (int k = 0; k < prog.num_inputs; ++k) {
    key += "|";
    for (int d = 0; d < ndims[k]; ++d) key += std::to_string(shapes[k][d]) + ",";
  }
  std::lock_guard<std::mutex> lk(mu);
  auto it = calls.find(key);
  if (it != calls.end()) return it->second;
  auto c = std::make_shared<Call>();
  c->prog = prog;
  for (int k = 0; k < prog.num_inputs; ++k) {
    if (ndims[k] < 0 || ndims[k] > 32) throw mxf::expr::ExprError("an input's rank is out of range");
    c->shapes.emplace_back(shapes[k], shapes[k] + ndims[k]);
    c->ndims.push_back(ndims[k]);
  }
  c->out_shape = mxf::expr::broadcast_shapes(c->shapes);
  c->layout = mxf::expr::collapse(c->out_shape, c->shapes);
  c->code = mxf::expr::resolved(prog, c->ndims, /*dnnl=*/false);
  if (calls.size() > 4096) calls.clear();  // a bound: shapes that vary call after call (callers hold theirs)
  calls.emplace(key, c);
  return c;
}

KernelSpec spec_of(const Call& c, bool backward, const int* in_dtypes, int out_dtype, int vec) {
  KernelSpec s;
  s.backward = backward;
  s.code = c.code;
  s.num_inputs = c.prog.num_inputs;
  s.in_dtypes.assign(in_dtypes, in_dtypes + s.num_inputs);
  s.out_dtype = out_dtype;
  s.ndim = static_cast<int>(c.layout.shape.size());
  s.bcast = c.layout.bcast;
  s.vec = vec;
  s.idx32 = c.layout.total < (int64_t(1) << 31);
  return s;
}

bool dtypes_ok(const int* d, int n) {
  for (int k = 0; k < n; ++k)
    if (mxf_cuda::dtype_bytes(d[k]) == 0) return false;
  return true;
}

// Blocks for `work` thread-steps of 256 threads: enough to fill the device a few times over
// (a grid-stride loop takes the rest), at least one.
unsigned grid_for(int64_t work, const Device& dev) {
  const int64_t want = (work + 255) / 256;
  const int64_t cap = static_cast<int64_t>(std::max(1, dev.sms)) * 8;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(want, cap)));
}

// The launch arguments of a generated kernel, in its parameter order (elemwise_codegen.cc).
struct Args {
  std::vector<const void*> ptrs;  // pointer values, kept at stable addresses
  std::vector<int> ints;
  std::vector<Dims6> dims;
  long long n = 0;
  std::vector<void*> argv;
  void reserve(size_t k) {
    ptrs.reserve(2 * k + 2);
    ints.reserve(k + 1);
    dims.reserve(k + 1);
  }
  void ptr(const void* p) { ptrs.push_back(p); argv.push_back(&ptrs.back()); }
  void i32(int v) { ints.push_back(v); argv.push_back(&ints.back()); }
  void dim(const Dims6& d) { dims.push_back(d); argv.push_back(&dims.back()); }
  void count(long long v) { n = v; argv.push_back(&n); }
};

void shape_args(Args* a, const Call& c) {
  const Layout& L = c.layout;
  a->count(L.total);
  Dims6 s{};
  for (size_t d = 0; d < L.shape.size(); ++d) s.d[d] = L.shape[d];
  a->dim(s);
  if (L.shape.size() > 1)
    for (int k = 0; k < c.prog.num_inputs; ++k) {
      Dims6 st{};
      for (size_t d = 0; d < L.shape.size(); ++d) st.d[d] = L.stride[k][d];
      a->dim(st);
    }
}

int launch(const Compiled& k, const Call& c, int vec, Args& a, cudaStream_t st) {
  Device dev;
  MXF_TRY(device_of(&dev));
  const int64_t groups = std::max<int64_t>(c.layout.total / vec, 1);
  MXF_CUDA_TRY(cudaLaunchKernel(reinterpret_cast<const void*>(k.kernel), dim3(grid_for(groups, dev)), dim3(256),
                                a.argv.data(), 0, st));
  return 0;
}

// ---- the reduction of a broadcast input's gradient ------------------------------------------------

// The output's collapsed dims split into those the input keeps (its own dims, in order) and those
// it broadcasts along (summed), with the full buffer's strides.
struct RedGeom {
  int nk, nr;
  long long ksize[6], kstride[6], rsize[6], rstride[6];
  long long M, R, P, chunk;  // kept elements, summed elements per kept one, splits of R, R / P rounded up
};

RedGeom red_geom(const Layout& L, int k) {
  RedGeom g{};
  const int D = static_cast<int>(L.shape.size());
  long long stride = 1;
  std::vector<long long> full(D);
  for (int d = D - 1; d >= 0; --d) {
    full[d] = stride;
    stride *= L.shape[d];
  }
  g.M = g.R = 1;
  for (int d = 0; d < D; ++d) {
    if (L.bcast[k] >> d & 1u) {
      g.rsize[g.nr] = L.shape[d];
      g.rstride[g.nr++] = full[d];
      g.R *= L.shape[d];
    } else {
      g.ksize[g.nk] = L.shape[d];
      g.kstride[g.nk++] = full[d];
      g.M *= L.shape[d];
    }
  }
  // enough workers to fill a large GPU with loads in flight: ~8k warps, each summing at least
  // 1024 elements, where the innermost dim is summed; ~256k threads, each summing at least 64,
  // where it is kept.  (The element count alone decides: the workspace query gives the same.)
  const bool inner = L.bcast[k] >> (D - 1) & 1u;
  const long long workers = inner ? 8192 : 262144, least = inner ? 1024 : 64;
  const long long want = (workers + g.M - 1) / g.M;
  const long long most = std::max(1LL, (g.R + least - 1) / least);
  g.P = std::max(1LL, std::min(want, most));
  g.chunk = (g.R + g.P - 1) / g.P;
  return g;
}

__device__ __forceinline__ long long kept_offset(const RedGeom& g, long long i) {
  long long off = 0;
  for (int d = g.nk - 1; d >= 0; --d) {
    const long long q = i / g.ksize[d];
    off += (i - q * g.ksize[d]) * g.kstride[d];
    i = q;
  }
  return off;
}
__device__ __forceinline__ long long red_offset(const RedGeom& g, long long r) {
  if (g.nr == 1) return r * g.rstride[0];
  long long off = 0;
  for (int d = g.nr - 1; d >= 0; --d) {
    const long long q = r / g.rsize[d];
    off += (r - q * g.rsize[d]) * g.rstride[d];
    r = q;
  }
  return off;
}

// The innermost dim is summed: a warp per (kept element, split), lanes over consecutive elements.
__global__ void reduce_inner(const float* __restrict__ full, RedGeom g, float* __restrict__ partial) {
  const long long w = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= g.M * g.P) return;
  const long long i = w / g.P, p = w - i * g.P;
  const long long base = kept_offset(g, i);
  const long long end = min(g.R, (p + 1) * g.chunk);
  float s = 0.f;
  for (long long r = p * g.chunk + lane; r < end; r += 32) s += full[base + red_offset(g, r)];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_down_sync(0xffffffffu, s, o);
  if (lane == 0) partial[i * g.P + p] = s;
}

// The innermost dim is kept: a thread per (kept element, split), neighbours on neighbouring elements.
__global__ void reduce_outer(const float* __restrict__ full, RedGeom g, float* __restrict__ partial) {
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= g.M * g.P) return;
  const long long p = t / g.M, i = t - p * g.M;
  const long long base = kept_offset(g, i);
  const long long end = min(g.R, (p + 1) * g.chunk);
  float s = 0.f;
#pragma unroll 4
  for (long long r = p * g.chunk; r < end; ++r) s += full[base + red_offset(g, r)];
  partial[i * g.P + p] = s;
}

// The splits of each kept element summed in order, written in the gradient's dtype with req.
template <typename T>
__global__ void reduce_finish(const float* __restrict__ partial, RedGeom g, T* __restrict__ grad, int req) {
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= g.M) return;
  float s = 0.f;
  for (long long p = 0; p < g.P; ++p) s += partial[i * g.P + p];
  mxf_cuda::store_req(grad + i, s, req);
}

int reduce_gradient(const Layout& L, int k, const float* full, float* partial, int dtype, void* grad, int req,
                    cudaStream_t st) {
  const RedGeom g = red_geom(L, k);
  const bool inner_summed = L.bcast[k] >> (L.shape.size() - 1) & 1u;
  const long long workers = g.M * g.P * (inner_summed ? 32 : 1);
  const unsigned blocks = static_cast<unsigned>((workers + 255) / 256);
  if (inner_summed) reduce_inner<<<blocks, 256, 0, st>>>(full, g, partial);
  else reduce_outer<<<blocks, 256, 0, st>>>(full, g, partial);
  MXF_CUDA_TRY(cudaGetLastError());
  const unsigned fb = static_cast<unsigned>((g.M + 255) / 256);
  return mxf_cuda::dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    reduce_finish<T><<<fb, 256, 0, st>>>(partial, g, static_cast<T*>(grad), req);
    MXF_CUDA_RETURN_LAST();
  });
}

size_t backward_workspace(const Call& c) {
  size_t total = 0;
  for (int k = 0; k < c.prog.num_inputs; ++k) {
    if (c.layout.full(k)) continue;
    const RedGeom g = red_geom(c.layout, k);
    total += mxf_cuda::align256(static_cast<size_t>(c.layout.total) * sizeof(float));
    total += mxf_cuda::align256(static_cast<size_t>(g.M * g.P) * sizeof(float));
  }
  return total;
}

}  // namespace

extern "C" int mxf_elemwise_forward_ex(const char* expr, int num_args, const int* in_dtypes,
                                       const void* const* inputs, const int64_t* const* shapes, const int* ndims,
                                       int out_dtype, void* out, char* err, int errlen, void* stream) {
  std::shared_ptr<const Call> c;
  try {
    c = call_for(expr ? expr : "", num_args, shapes, ndims);
  } catch (const std::exception& e) {
    return fail(err, errlen, MXF_ERR_BAD_ARGS, e.what());
  }
  const int n = c->prog.num_inputs;
  if (!dtypes_ok(in_dtypes, n) || mxf_cuda::dtype_bytes(out_dtype) == 0)
    return fail(err, errlen, MXF_ERR_BAD_ARGS, "unknown dtype code");
  if (c->layout.total == 0) return 0;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  std::string no_kernel;  // why no generated kernel runs this call
  if (jit_enabled() && mxf::nvrtc::available(&no_kernel)) {
    Device dev;
    MXF_TRY(device_of(&dev));
    std::vector<uintptr_t> ip;
    for (int k = 0; k < n; ++k) ip.push_back(reinterpret_cast<uintptr_t>(inputs[k]));
    const int vec = mxf::expr::choose_vec(c->layout, std::vector<int>(in_dtypes, in_dtypes + n), out_dtype, ip,
                                          reinterpret_cast<uintptr_t>(out));
    const Compiled& k = kernel_for(spec_of(*c, false, in_dtypes, out_dtype, vec), dev.arch);
    if (k.kernel) {
      Args a;
      a.reserve(n);
      for (int i = 0; i < n; ++i) a.ptr(inputs[i]);
      shape_args(&a, *c);
      a.ptr(out);
      return launch(k, *c, vec, a, st);
    }
    no_kernel = k.error;
  } else if (!jit_enabled()) {
    no_kernel = "generated kernels are switched off";
  }
  std::string why;
  const int rc = mxf_ew::interpret(c->prog, in_dtypes, inputs, shapes, ndims, out_dtype, out, &why, st);
  if (rc == MXF_ERR_BAD_ARGS || rc == MXF_ERR_UNSUPPORTED)
    return fail(err, errlen, rc, why + (no_kernel.empty() ? "" : " (no generated kernel: " + no_kernel + ")"));
  return rc;
}

extern "C" int mxf_elemwise_forward(int dtype, const char* expr, int num_args, const void* const* inputs,
                                    const int64_t* const* shapes, const int* ndims, void* out, char* err,
                                    int errlen, void* stream) {
  if (mxf_cuda::dtype_bytes(dtype) == 0) return fail(err, errlen, MXF_ERR_BAD_ARGS, "unknown dtype code");
  // the argument count comes from the program (parsed first: a bad one fails before any CUDA call)
  int n = 0;
  try {
    n = mxf::expr::compile(expr ? expr : "", num_args).num_inputs;
  } catch (const std::exception& e) {
    return fail(err, errlen, MXF_ERR_BAD_ARGS, e.what());
  }
  const std::vector<int> dts(n, dtype);
  return mxf_elemwise_forward_ex(expr, num_args, dts.data(), inputs, shapes, ndims, dtype, out, err, errlen,
                                 stream);
}

extern "C" size_t mxf_elemwise_backward_workspace_size(const char* expr, int num_args, const int64_t* const* shapes,
                                                       const int* ndims) {
  try {
    return backward_workspace(*call_for(expr ? expr : "", num_args, shapes, ndims));
  } catch (const std::exception&) {
    return 0;  // the backward call reports the problem
  }
}

extern "C" int mxf_elemwise_backward(const char* expr, int num_args, int dy_dtype, const void* dy,
                                     const int* in_dtypes, const void* const* inputs, const int64_t* const* shapes,
                                     const int* ndims, const int* grad_dtypes, void* const* grads, const int* reqs,
                                     void* workspace, size_t workspace_size, char* err, int errlen, void* stream) {
  std::shared_ptr<const Call> cp;
  try {
    cp = call_for(expr ? expr : "", num_args, shapes, ndims);
  } catch (const std::exception& e) {
    return fail(err, errlen, MXF_ERR_BAD_ARGS, e.what());
  }
  const Call& c = *cp;
  const int n = c.prog.num_inputs;
  if (!dtypes_ok(in_dtypes, n) || !dtypes_ok(grad_dtypes, n) || mxf_cuda::dtype_bytes(dy_dtype) == 0)
    return fail(err, errlen, MXF_ERR_BAD_ARGS, "unknown dtype code");
  for (int k = 0; k < n; ++k)
    if (!mxf_cuda::req_ok(reqs[k])) return fail(err, errlen, MXF_ERR_BAD_ARGS, "unknown req code");
  const size_t need = backward_workspace(c);
  if (need > 0 && (workspace == nullptr || workspace_size < need))
    return fail(err, errlen, MXF_ERR_WORKSPACE, "the backward needs " + std::to_string(need) + " bytes of workspace");
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (c.layout.total == 0) {  // no output element: every gradient written is zero
    for (int k = 0; k < n; ++k) {
      if (reqs[k] != MXF_REQ_WRITE && reqs[k] != MXF_REQ_INPLACE) continue;
      int64_t sz = 1;
      for (int d = 0; d < ndims[k]; ++d) sz *= shapes[k][d];
      MXF_CUDA_TRY(cudaMemsetAsync(grads[k], 0, static_cast<size_t>(sz) * mxf_cuda::dtype_bytes(grad_dtypes[k]), st));
    }
    return 0;
  }
  std::string why;
  if (!jit_enabled()) why = "generated kernels are switched off (mxf_elemwise_set_jit(0) / MXFUSION_ELEMWISE_JIT=0)";
  else mxf::nvrtc::available(&why);
  if (!why.empty())
    return fail(err, errlen, MXF_ERR_UNSUPPORTED, "fused_elemwise has no GPU backward without NVRTC: " + why);
  Device dev;
  MXF_TRY(device_of(&dev));
  // the vector width: dy and the inputs as the forward's output and inputs, then the gradients
  // written in place must be aligned to it too
  std::vector<uintptr_t> ip;
  for (int k = 0; k < n; ++k) ip.push_back(reinterpret_cast<uintptr_t>(inputs[k]));
  int vec = mxf::expr::choose_vec(c.layout, std::vector<int>(in_dtypes, in_dtypes + n), dy_dtype, ip,
                                  reinterpret_cast<uintptr_t>(dy));
  for (int k = 0; k < n; ++k)
    while (vec > 1 && c.layout.full(k) &&
           reinterpret_cast<uintptr_t>(grads[k]) %
               static_cast<uintptr_t>(std::min<size_t>(16, vec * mxf_cuda::dtype_bytes(grad_dtypes[k]))))
      vec /= 2;
  KernelSpec spec = spec_of(c, true, in_dtypes, dy_dtype, vec);
  spec.grad_dtypes.assign(grad_dtypes, grad_dtypes + n);
  const Compiled& kern = kernel_for(spec, dev.arch);
  if (!kern.kernel)
    return fail(err, errlen, MXF_ERR_UNSUPPORTED, "fused_elemwise's GPU backward kernel: " + kern.error);
  mxf_cuda::Carver ws(workspace);
  std::vector<float*> full(n, nullptr), partial(n, nullptr);
  for (int k = 0; k < n; ++k) {
    if (c.layout.full(k)) continue;
    const RedGeom g = red_geom(c.layout, k);
    full[k] = ws.take<float>(static_cast<size_t>(c.layout.total));
    partial[k] = ws.take<float>(static_cast<size_t>(g.M * g.P));
  }
  Args a;
  a.reserve(n);
  a.ptr(dy);
  for (int k = 0; k < n; ++k) a.ptr(inputs[k]);
  shape_args(&a, c);
  for (int k = 0; k < n; ++k) {
    a.ptr(c.layout.full(k) ? grads[k] : full[k]);
    a.i32(reqs[k]);
  }
  MXF_TRY(launch(kern, c, vec, a, st));
  for (int k = 0; k < n; ++k)
    if (!c.layout.full(k) && reqs[k] != MXF_REQ_NULL)
      MXF_TRY(reduce_gradient(c.layout, k, full[k], partial[k], grad_dtypes[k], grads[k], reqs[k], st));
  return 0;
}

extern "C" const char* mxf_elemwise_jit_status() {
  static thread_local std::string text;
  std::string why;
  if (!jit_enabled()) text = "interpreter: generated kernels are switched off (MXFUSION_ELEMWISE_JIT=0)";
  else if (!mxf::nvrtc::available(&why)) text = "interpreter: " + why;
  else text = "nvrtc: " + mxf::nvrtc::describe();
  std::lock_guard<std::mutex> lk(g_status_mu);
  if (!g_last_failure.empty()) text += "\nlast kernel not built: " + g_last_failure;
  return text.c_str();
}

extern "C" int mxf_elemwise_set_jit(int enabled) {
  const int before = jit_enabled() ? 1 : 0;
  g_jit.store(enabled ? 1 : 0);
  return before;
}
