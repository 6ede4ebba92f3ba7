// oneDNN 3.x grouped 3x3 convolution alone, the kernel fused_grouped_conv calls: median time and
// GFLOP/s for one shape, in oneDNN's own (blocked) layout or with the NCHW reorders a library op pays.
//
//   g++ -O2 -I.venv/include -o /tmp/grouped_conv_dnnl benchmarks/grouped_conv_dnnl.cc .venv/lib/libdnnl.so.3 \
//       -Wl,-rpath,$PWD/.venv/lib
//   OMP_NUM_THREADS=1 /tmp/grouped_conv_dnnl C HW GROUPS STRIDE MODE   (MODE 0: blocked, 1: plain NCHW
//                                                                       kernel, 2: NCHW -> blocked -> NCHW)
//
// ResNeXt-50 32x4d's stages: "128 56 32 1", "256 28 32 1", "256 56 32 2", "512 14 32 1".
// Compiled against oneDNN's own headers (onednn-devel-cpu-gomp, installed with the project).
#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                          \
  do {                                                 \
    dnnl_status_t s_ = (x);                            \
    if (s_ != dnnl_success) {                          \
      printf("fail %s = %d\n", #x, static_cast<int>(s_)); \
      exit(1);                                         \
    }                                                  \
  } while (0)
int main(int argc, char** argv) {
  int C = atoi(argv[1]), HW = atoi(argv[2]), G = atoi(argv[3]), stride = atoi(argv[4]), plain = atoi(argv[5]);
  int reps = 200;
  dnnl_engine_t eng;
  dnnl_stream_t strm;
  CK(dnnl_engine_create(&eng, dnnl_cpu, 0));
  CK(dnnl_stream_create(&strm, eng, dnnl_stream_default_flags));
  int OH = (HW + 2 - 3) / stride + 1;
  dnnl_dims_t sd = {1, C, HW, HW}, dd = {1, C, OH, OH}, wd = {G, C / G, C / G, 3, 3};
  dnnl_memory_desc_t smd, dmd, wmd;
  const dnnl_format_tag_t tag = plain == 1 ? dnnl_abcd : dnnl_format_tag_any;
  CK(dnnl_memory_desc_create_with_tag(&smd, 4, sd, dnnl_f32, tag));
  CK(dnnl_memory_desc_create_with_tag(&dmd, 4, dd, dnnl_f32, tag));
  CK(dnnl_memory_desc_create_with_tag(&wmd, 5, wd, dnnl_f32, dnnl_format_tag_any));
  dnnl_dims_t strides = {stride, stride}, dil = {0, 0}, pl = {1, 1}, pr = {1, 1};
  dnnl_primitive_desc_t pd;
  CK(dnnl_convolution_forward_primitive_desc_create(&pd, eng, dnnl_forward_inference, dnnl_convolution_direct,
                                                    smd, wmd, nullptr, dmd, strides, dil, pl, pr, nullptr));
  dnnl_primitive_t prim;
  CK(dnnl_primitive_create(&prim, pd));
  const_dnnl_memory_desc_t q[3] = {dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0),
                                   dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0),
                                   dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0)};
  dnnl_memory_t mem[3];
  std::vector<std::vector<float>> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.emplace_back(dnnl_memory_desc_get_size(q[i]) / 4 + 16, 0.5f);
    CK(dnnl_memory_create(&mem[i], q[i], eng, bufs.back().data()));
  }
  dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, mem[0]}, {DNNL_ARG_WEIGHTS, mem[1]}, {DNNL_ARG_DST, mem[2]}};
  dnnl_primitive_t ri = nullptr, ro = nullptr;
  dnnl_memory_t pin, pout;
  dnnl_exec_arg_t ai[2], ao[2];
  std::vector<float> bin(1 * C * HW * HW, 0.5f), bout(1 * C * OH * OH);
  if (plain == 2) {
    dnnl_memory_desc_t psmd, pdmd;
    dnnl_primitive_desc_t rpd;
    CK(dnnl_memory_desc_create_with_tag(&psmd, 4, sd, dnnl_f32, dnnl_abcd));
    CK(dnnl_memory_desc_create_with_tag(&pdmd, 4, dd, dnnl_f32, dnnl_abcd));
    CK(dnnl_memory_create(&pin, psmd, eng, bin.data()));
    CK(dnnl_memory_create(&pout, pdmd, eng, bout.data()));
    CK(dnnl_reorder_primitive_desc_create(&rpd, psmd, eng, q[0], eng, nullptr));
    CK(dnnl_primitive_create(&ri, rpd));
    CK(dnnl_reorder_primitive_desc_create(&rpd, q[2], eng, pdmd, eng, nullptr));
    CK(dnnl_primitive_create(&ro, rpd));
    ai[0] = {DNNL_ARG_SRC, pin};
    ai[1] = {DNNL_ARG_DST, mem[0]};
    ao[0] = {DNNL_ARG_SRC, mem[2]};
    ao[1] = {DNNL_ARG_DST, pout};
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
