// The ceiling of fused_dense in bfloat16 on this CPU: oneDNN 3.x's matmul alone (the library
// fused_dense runs), weights prepacked in the layout oneDNN picks, on BERT-base's shapes, with
// float32 and bfloat16 source / destination, plus the cost of rounding a float32 source to
// bfloat16 (what fused_dense does per call when its input is float32).  Built and run by
// `benchmarks/bench_precision.py --ceiling` (g++ against the onednn-devel-cpu-gomp wheel's
// headers; a process of its own, so MXNet's oneDNN 2.x never meets it).
//
// Prints per configuration: the median and best of `reps` timed runs (after warm-up) and the
// GFLOP/s they make, the median of runs with cold weights (each run reads another copy of the
// packed weights, ~96 MB of copies in all: in a model, a layer's weights are evicted by the
// other layers' before they are read again — BERT-base's are 170 MB in bfloat16), and the median
// time of rounding the (M, K) source on one thread.
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace dnnl;
using dt = memory::data_type;
using tag = memory::format_tag;

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void to_bf16(const float* x, uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    y[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  std::vector<int> Ms;
  for (int i = 2; i < argc; ++i) Ms.push_back(std::atoi(argv[i]));
  if (Ms.empty()) Ms = {128, 512};
  engine eng(engine::kind::cpu, 0);
  stream s(eng);
  const int shapes[][2] = {{768, 768}, {768, 2304}, {768, 3072}, {3072, 768}};
  struct Cfg {
    const char* name;
    dt src, wei, dst;
  } cfgs[] = {{"f32 f32 f32", dt::f32, dt::f32, dt::f32},
              {"bf16 bf16 f32", dt::bf16, dt::bf16, dt::f32},
              {"bf16 bf16 bf16", dt::bf16, dt::bf16, dt::bf16}};
  std::printf("%-6s %-6s %-6s %-16s %10s %8s %10s %8s %10s %8s %14s  %s\n", "M", "K", "N", "src wei dst",
              "median ms", "GF/s", "best ms", "GF/s", "cold ms", "GF/s", "round src ms", "oneDNN kernel");
  for (int M : Ms)
    for (const auto& sh : shapes) {
      const int K = sh[0], N = sh[1];
      for (const auto& c : cfgs) {
        memory::desc sd({M, K}, c.src, tag::ab), wd({K, N}, c.wei, tag::any), bd({1, N}, dt::f32, tag::ab),
            dd({M, N}, c.dst, tag::ab);
        matmul::primitive_desc pd(eng, sd, wd, bd, dd);
        matmul prim(pd);
        memory sm(sd, eng), wm(pd.weights_desc(), eng), bm(bd, eng), dm(dd, eng);
        std::memset(sm.get_data_handle(), 0x3f, sd.get_size());
        std::memset(wm.get_data_handle(), 0x3f, pd.weights_desc().get_size());
        std::memset(bm.get_data_handle(), 0, bd.get_size());
        std::vector<float> xf(static_cast<size_t>(M) * K, 0.5f);
        std::vector<uint16_t> xb(xf.size());
        auto run = [&] {
          prim.execute(s, {{DNNL_ARG_SRC, sm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_BIAS, bm}, {DNNL_ARG_DST, dm}});
          s.wait();
        };
        for (int i = 0; i < 5; ++i) run();
        std::vector<double> t, tc;
        for (int r = 0; r < reps; ++r) {
          double a = now();
          run();
          t.push_back(now() - a);
          if (c.src == dt::bf16) {
            a = now();
            to_bf16(xf.data(), xb.data(), static_cast<int64_t>(xf.size()));
            tc.push_back(now() - a);
          }
        }
        // cold weights: copies of the packed weights read in turn
        const size_t wbytes = pd.weights_desc().get_size();
        const size_t copies = std::min<size_t>(256, std::max<size_t>(2, (96u << 20) / wbytes + 1));
        std::vector<memory> wc;
        for (size_t i = 0; i < copies; ++i) {
          wc.emplace_back(pd.weights_desc(), eng);
          std::memset(wc.back().get_data_handle(), 0x3f, wbytes);
        }
        std::vector<double> tcold;
        for (int r = 0; r < reps + static_cast<int>(copies); ++r) {
          const double a = now();
          prim.execute(s, {{DNNL_ARG_SRC, sm}, {DNNL_ARG_WEIGHTS, wc[r % copies]}, {DNNL_ARG_BIAS, bm},
                           {DNNL_ARG_DST, dm}});
          s.wait();
          if (r >= static_cast<int>(copies)) tcold.push_back(now() - a);  // after one round of all copies
        }
        wc.clear();
        std::sort(tcold.begin(), tcold.end());
        const double cold = tcold[tcold.size() / 2];
        std::sort(t.begin(), t.end());
        std::sort(tc.begin(), tc.end());
        const double flop = 2.0 * M * N * K, med = t[t.size() / 2], best = t[0];
        char cvt[32] = "-";
        if (!tc.empty()) std::snprintf(cvt, sizeof cvt, "%.3f", tc[tc.size() / 2] * 1e3);
        std::printf("%-6d %-6d %-6d %-16s %10.3f %8.0f %10.3f %8.0f %10.3f %8.0f %14s  %s\n", M, K, N, c.name,
                    med * 1e3, flop / med / 1e9, best * 1e3, flop / best / 1e9, cold * 1e3, flop / cold / 1e9, cvt,
                    pd.impl_info_str());
        std::fflush(stdout);
      }
    }
  return 0;
}
