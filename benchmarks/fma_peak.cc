// Peak single-precision FMA rate of this machine, for the benchmarks' "fraction of
// peak" columns: every OpenMP thread runs 12 independent chains of vector FMAs (enough
// to cover the FMA latency on current x86 cores) for a fixed count; best of 5 runs.
// Built by benchmarks/bench_kernels.py with -O3 -march=native, so it uses the widest
// vectors the compiler may emit here.
#include <omp.h>

#include <chrono>

#if defined(__AVX512F__)
#include <immintrin.h>
using vec = __m512;
#define VSET _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define VADD _mm512_add_ps
constexpr int kLanes = 16;
#elif defined(__FMA__)
#include <immintrin.h>
using vec = __m256;
#define VSET _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define VADD _mm256_add_ps
constexpr int kLanes = 8;
#else
#error "fma_peak.cc needs an x86 CPU with FMA"
#endif

extern "C" int fma_peak_lanes() { return kLanes; }

extern "C" double fma_peak_gflops(int threads, long iters) {
  double best = 0;
  volatile float sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      vec a0 = VSET(1.0f), a1 = VSET(1.1f), a2 = VSET(1.2f), a3 = VSET(1.3f), a4 = VSET(1.4f),
          a5 = VSET(1.5f), a6 = VSET(1.6f), a7 = VSET(1.7f), a8 = VSET(1.8f), a9 = VSET(1.9f),
          a10 = VSET(2.0f), a11 = VSET(2.1f);
      const vec b = VSET(0.999999f), c = VSET(1e-7f);
      for (long i = 0; i < iters; ++i) {
        a0 = VFMA(a0, b, c); a1 = VFMA(a1, b, c); a2 = VFMA(a2, b, c); a3 = VFMA(a3, b, c);
        a4 = VFMA(a4, b, c); a5 = VFMA(a5, b, c); a6 = VFMA(a6, b, c); a7 = VFMA(a7, b, c);
        a8 = VFMA(a8, b, c); a9 = VFMA(a9, b, c); a10 = VFMA(a10, b, c); a11 = VFMA(a11, b, c);
      }
      vec s = VADD(VADD(VADD(a0, a1), VADD(a2, a3)), VADD(VADD(a4, a5), VADD(a6, a7)));
      s = VADD(s, VADD(VADD(a8, a9), VADD(a10, a11)));
      float out[kLanes];
      __builtin_memcpy(out, &s, sizeof(out));
#pragma omp atomic
      sink += out[0];
    }
    const double sec =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gf = 2.0 * kLanes * 12 * static_cast<double>(iters) * threads / sec / 1e9;
    if (gf > best) best = gf;
  }
  return best;
}
