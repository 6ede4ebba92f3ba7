// oneDNN 3.x grouped 3x3 convolution alone, the kernel fused_grouped_conv calls: median time and
// GFLOP/s for one shape, in oneDNN's own (blocked) layout or with the NCHW reorders a library op pays.
//
//   g++ -O2 -o /tmp/grouped_conv_dnnl benchmarks/grouped_conv_dnnl.cc .venv/lib/libdnnl.so.3 -Wl,-rpath,$PWD/.venv/lib
//   OMP_NUM_THREADS=1 /tmp/grouped_conv_dnnl C HW GROUPS STRIDE MODE   (MODE 0: blocked, 1: plain NCHW
//                                                                       kernel, 2: NCHW -> blocked -> NCHW)
//
// ResNeXt-50 32x4d's stages: "128 56 32 1", "256 28 32 1", "256 56 32 2", "512 14 32 1".
// The C API is declared here from the oneDNN 3.x headers (the wheel ships none).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstdint>
typedef int st;
typedef int64_t dims[12];
extern "C" {
st dnnl_engine_create(void**, int, size_t);
st dnnl_stream_create(void**, void*, unsigned);
st dnnl_stream_wait(void*);
st dnnl_memory_desc_create_with_tag(void**, int, const int64_t*, int, int);
st dnnl_convolution_forward_primitive_desc_create(void**, void*, int, int, const void*, const void*, const void*,
    const void*, const int64_t*, const int64_t*, const int64_t*, const int64_t*, const void*);
const void* dnnl_primitive_desc_query_md(const void*, int, int);
st dnnl_primitive_create(void**, const void*);
st dnnl_primitive_execute(const void*, void*, int, const void*);
st dnnl_memory_create(void**, const void*, void*, void*);
size_t dnnl_memory_desc_get_size(const void*);
st dnnl_reorder_primitive_desc_create(void**, const void*, void*, const void*, void*, const void*);
}
struct Arg { int arg; void* mem; };
#define CK(x) do { st s_ = (x); if (s_) { printf("fail %s = %d\n", #x, s_); exit(1);} } while (0)
int main(int argc, char** argv) {
  int C = atoi(argv[1]), HW = atoi(argv[2]), G = atoi(argv[3]), stride = atoi(argv[4]), plain = atoi(argv[5]);
  int reps = 200;
  void *eng, *strm;
  CK(dnnl_engine_create(&eng, 1, 0));
  CK(dnnl_stream_create(&strm, eng, 1));
  int OH = (HW + 2 - 3) / stride + 1;
  int64_t sd[4] = {1, C, HW, HW}, dd[4] = {1, C, OH, OH}, wd[5] = {G, C / G, C / G, 3, 3};
  void *smd, *dmd, *wmd;
  int tag = plain == 1 ? 5 : 1;  // abcd | any
  CK(dnnl_memory_desc_create_with_tag(&smd, 4, sd, 3, tag));
  CK(dnnl_memory_desc_create_with_tag(&dmd, 4, dd, 3, tag));
  CK(dnnl_memory_desc_create_with_tag(&wmd, 5, wd, 3, 1));
  int64_t strides[2] = {stride, stride}, dil[2] = {0, 0}, pl[2] = {1, 1}, pr[2] = {1, 1};
  void* pd;
  CK(dnnl_convolution_forward_primitive_desc_create(&pd, eng, 96, 1, smd, wmd, nullptr, dmd, strides, dil, pl, pr, nullptr));
  void* prim;
  CK(dnnl_primitive_create(&prim, pd));
  const void* q[3] = {dnnl_primitive_desc_query_md(pd, 129, 0), dnnl_primitive_desc_query_md(pd, 131, 0),
                      dnnl_primitive_desc_query_md(pd, 133, 0)};
  void* mem[3];
  std::vector<std::vector<float>> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.emplace_back(dnnl_memory_desc_get_size(q[i]) / 4 + 16, 0.5f);
    CK(dnnl_memory_create(&mem[i], q[i], eng, bufs.back().data()));
  }
  Arg args[3] = {{1, mem[0]}, {33, mem[1]}, {17, mem[2]}};
  void *ri = nullptr, *ro = nullptr, *pin, *pout;
  Arg ai[2], ao[2];
  std::vector<float> bin(1 * C * HW * HW, 0.5f), bout(1 * C * OH * OH);
  if (plain == 2) {
    void *psmd, *pdmd, *rpd;
    CK(dnnl_memory_desc_create_with_tag(&psmd, 4, sd, 3, 5));
    CK(dnnl_memory_desc_create_with_tag(&pdmd, 4, dd, 3, 5));
    CK(dnnl_memory_create(&pin, psmd, eng, bin.data()));
    CK(dnnl_memory_create(&pout, pdmd, eng, bout.data()));
    CK(dnnl_reorder_primitive_desc_create(&rpd, psmd, eng, q[0], eng, nullptr));
    CK(dnnl_primitive_create(&ri, rpd));
    CK(dnnl_reorder_primitive_desc_create(&rpd, q[2], eng, pdmd, eng, nullptr));
    CK(dnnl_primitive_create(&ro, rpd));
    ai[0] = {1, pin}; ai[1] = {17, mem[0]};
    ao[0] = {1, mem[2]}; ao[1] = {17, pout};
  }
  std::vector<double> t;
  for (int r = 0; r < reps + 10; ++r) {
    auto a = std::chrono::steady_clock::now();
    if (ri) CK(dnnl_primitive_execute(ri, strm, 2, ai));
    CK(dnnl_primitive_execute(prim, strm, 3, args));
    if (ro) CK(dnnl_primitive_execute(ro, strm, 2, ao));
    CK(dnnl_stream_wait(strm));
    auto b = std::chrono::steady_clock::now();
    if (r >= 10) t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  double gflop = 2.0 * C * (C / G) * 9 * OH * OH / 1e9;
  printf("C=%d HW=%d G=%d (%d/group) stride %d %s: median %.3f ms [p10 %.3f p90 %.3f] %.0f GFLOP/s\n", C, HW, G,
         C / G, stride, plain == 1 ? "nchw" : (plain == 2 ? "nchw->blocked->nchw" : "any "), t[t.size() / 2], t[t.size() / 10], t[t.size() * 9 / 10],
         gflop / (t[t.size() / 2] / 1e3));
}
