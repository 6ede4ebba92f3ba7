// fused_attention CPU kernels: blockwise attention with an online softmax.
// Each OpenMP task owns one (batch*head, query block); the score tile never exceeds
// BQ x BK.  Forward tile products: AVX-512 register-blocked loops where the CPU has
// them (qk_tile / pv_tile), single-threaded dnnl_sgemm calls otherwise and in backward.
//
// Results follow the unfused MXNet graph, fully masked rows and non-finite values
// included: keys a row does not see (valid length, causal band) are skipped, and where
// the unfused graph would still multiply them by a probability of 0, a non-finite value
// in v gives NaN as that product does (see finish_rows); among the keys it computes, a
// non-finite value meets the exact probability the unfused softmax gives (nonfinite_values).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "attention_geom.h"
#include "dnnl_matmul.h"  // to_bf16
#include "vmath_avx512.h"

namespace mxf {
namespace attn {
namespace {

// Tile sizes: query rows per task, keys per score tile.  MXFUSION_ATTN_BQ / _BK
// override them (read when the library loads) for tuning on other machines.
int64_t env_tile(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  const int64_t t = v ? std::atoll(v) : 0;
  return t >= 8 && t <= 4096 ? t : dflt;
}
const int64_t BQ = env_tile("MXFUSION_ATTN_BQ", 64);
const int64_t BK = env_tile("MXFUSION_ATTN_BK", 256);
const float NEG_INF = -std::numeric_limits<float>::infinity();

#ifdef MXF_HAVE_AVX512_PATH
// AVX-512 tile products for the forward pass.  dnnl_sgemm on these small tiles (inner
// dimension D = 64 for q.k) re-packs both operands on every call and reached ~65% of
// the FMA peak here; these register-blocked loops read k pre-transposed once per call
// (kt: per head, D rows of Sk keys) and v in place.
using vmath::tail_mask16;

// S[r, c] = scale * sum_d q[r*qs + d] * kt[d*kts + c], r < R, c < nc (<= 32)
template <int R>
MXF_AVX512 void qk_block(const float* q, int64_t qs, const float* kt, int64_t kts, int64_t D,
                         int64_t nc, float scale, float* S, int64_t ss) {
  const __mmask16 m0 = tail_mask16(nc), m1 = tail_mask16(nc - 16);
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  for (int64_t d = 0; d < D; ++d) {
    const __m512 b0 = _mm512_maskz_loadu_ps(m0, kt + d * kts);
    const __m512 b1 = _mm512_maskz_loadu_ps(m1, kt + d * kts + 16);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(q[r * qs + d]);
      acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(S + r * ss, m0, _mm512_mul_ps(acc0[r], vs));
    _mm512_mask_storeu_ps(S + r * ss + 16, m1, _mm512_mul_ps(acc1[r], vs));
  }
}

// kt: the key tile's panels of 32 keys, each (D, 32) contiguous (see KT)
MXF_AVX512 void qk_tile(const float* q, int64_t qs, const float* kt, int64_t D, int64_t bq,
                        int64_t nb, float scale, float* S, int64_t ss) {
  for (int64_t c0 = 0; c0 < nb; c0 += 32) {
    const int64_t nc = std::min<int64_t>(32, nb - c0);
    const float* panel = kt + c0 * D;
    int64_t r0 = 0;
    for (; r0 + 8 <= bq; r0 += 8)
      qk_block<8>(q + r0 * qs, qs, panel, 32, D, nc, scale, S + r0 * ss + c0, ss);
    for (; r0 + 4 <= bq; r0 += 4)
      qk_block<4>(q + r0 * qs, qs, panel, 32, D, nc, scale, S + r0 * ss + c0, ss);
    for (; r0 < bq; ++r0)
      qk_block<1>(q + r0 * qs, qs, panel, 32, D, nc, scale, S + r0 * ss + c0, ss);
  }
}

// O[r, c] += sum_j P[r*ps + j] * v[j*vs + c], r < R, c < nc (<= 64)
template <int R>
MXF_AVX512 void pv_block(const float* P, int64_t ps, const float* v, int64_t vs, int64_t nb,
                         int64_t nc, float* O, int64_t os) {
  __mmask16 mk[4];
  for (int k = 0; k < 4; ++k) mk[k] = tail_mask16(nc - 16 * k);
  __m512 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_maskz_loadu_ps(mk[k], O + r * os + 16 * k);
  for (int64_t j = 0; j < nb; ++j) {
    __m512 bv[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) bv[k] = _mm512_maskz_loadu_ps(mk[k], v + j * vs + 16 * k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(P[r * ps + j]);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_fmadd_ps(a, bv[k], acc[r][k]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) _mm512_mask_storeu_ps(O + r * os + 16 * k, mk[k], acc[r][k]);
}

MXF_AVX512 void pv_tile(const float* P, int64_t ps, const float* v, int64_t vs, int64_t bq,
                        int64_t nb, int64_t Dv, float* O, int64_t os) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    const int64_t nc = std::min<int64_t>(64, Dv - c0);
    int64_t r0 = 0;
    for (; r0 + 6 <= bq; r0 += 6)
      pv_block<6>(P + r0 * ps, ps, v + c0, vs, nb, nc, O + r0 * os + c0, os);
    for (; r0 + 3 <= bq; r0 += 3)
      pv_block<3>(P + r0 * ps, ps, v + c0, vs, nb, nc, O + r0 * os + c0, os);
    for (; r0 < bq; ++r0) pv_block<1>(P + r0 * ps, ps, v + c0, vs, nb, nc, O + r0 * os + c0, os);
  }
}
#endif

// bfloat16 tile products (attribute precision="bfloat16", CPUs with avx512_bf16): the operands
// rounded to bfloat16 (nearest even), products accumulated in float32 by vdpbf16ps, which
// multiplies pairs of bf16 held in one 32-bit lane.  Both operands are laid out so that a
// lane holds two consecutive terms of the inner sum: q rows as they are (pairs along D), k
// in panels of 32 keys as (D/2, 32, 2), p rows as they are (pairs along the keys), v as
// (Sk/2, Dv, 2) per head; odd D / Sk are padded with zeros.  Softmax statistics, the
// scaling and the output stay float32.
#if defined(MXF_HAVE_AVX512_PATH) && defined(__GNUC__) && __GNUC__ >= 10
#define MXF_HAVE_BF16_PATH 1
#define MXF_BF16 __attribute__((target("avx512f,avx512dq,avx512bw,avx512bf16,fma")))

bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    if (!cpu_has_avx512()) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

inline int32_t bf16_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// S[r, c] = scale * sum_d q[r*qs + d] * k[d, c], r < R, c < nc (<= 32); panel (Dp/2, 32, 2)
template <int R>
MXF_BF16 void qk_block_bf16(const uint16_t* q, int64_t qs, const uint16_t* panel, int64_t Dp,
                            int64_t nc, float scale, float* S, int64_t ss) {
  const __mmask16 m0 = tail_mask16(nc), m1 = tail_mask16(nc - 16);
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  for (int64_t d2 = 0; d2 < Dp / 2; ++d2) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + d2 * 64);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + d2 * 64 + 32);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(bf16_pair(q + r * qs + 2 * d2));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(S + r * ss, m0, _mm512_mul_ps(acc0[r], vs));
    _mm512_mask_storeu_ps(S + r * ss + 16, m1, _mm512_mul_ps(acc1[r], vs));
  }
}

// q: bq rows of Dp bf16 (stride qs); kt: the key tile's panels of 32 keys, each (Dp/2, 32, 2)
MXF_BF16 void qk_tile_bf16(const uint16_t* q, int64_t qs, const uint16_t* kt, int64_t Dp,
                           int64_t bq, int64_t nb, float scale, float* S, int64_t ss) {
  for (int64_t c0 = 0; c0 < nb; c0 += 32) {
    const int64_t nc = std::min<int64_t>(32, nb - c0);
    const uint16_t* panel = kt + c0 * Dp;
    int64_t r0 = 0;
    for (; r0 + 12 <= bq; r0 += 12)
      qk_block_bf16<12>(q + r0 * qs, qs, panel, Dp, nc, scale, S + r0 * ss + c0, ss);
    for (; r0 + 4 <= bq; r0 += 4)
      qk_block_bf16<4>(q + r0 * qs, qs, panel, Dp, nc, scale, S + r0 * ss + c0, ss);
    for (; r0 < bq; ++r0)
      qk_block_bf16<1>(q + r0 * qs, qs, panel, Dp, nc, scale, S + r0 * ss + c0, ss);
  }
}

// O[r, c] += sum_j P[r*ps + j] * v[j, c], r < R, c < nc (<= 64); P: bf16 rows of nb2 pairs,
// v: (nb2, Dv, 2) from column c0 on
template <int R>
MXF_BF16 void pv_block_bf16(const uint16_t* P, int64_t ps, const uint16_t* v, int64_t Dv,
                            int64_t nb2, int64_t nc, float* O, int64_t os) {
  __mmask16 mk[4];
  for (int k = 0; k < 4; ++k) mk[k] = tail_mask16(nc - 16 * k);
  __m512 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_maskz_loadu_ps(mk[k], O + r * os + 16 * k);
  for (int64_t j2 = 0; j2 < nb2; ++j2) {
    __m512bh bv[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k)
      bv[k] = (__m512bh)_mm512_maskz_loadu_epi32(mk[k], v + j2 * Dv * 2 + 32 * k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(bf16_pair(P + r * ps + 2 * j2));
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], a, bv[k]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) _mm512_mask_storeu_ps(O + r * os + 16 * k, mk[k], acc[r][k]);
}

MXF_BF16 void pv_tile_bf16(const uint16_t* P, int64_t ps, const uint16_t* v, int64_t Dv,
                           int64_t bq, int64_t nb2, float* O, int64_t os) {
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    const int64_t nc = std::min<int64_t>(64, Dv - c0);
    const uint16_t* vc = v + c0 * 2;
    int64_t r0 = 0;
    for (; r0 + 6 <= bq; r0 += 6)
      pv_block_bf16<6>(P + r0 * ps, ps, vc, Dv, nb2, nc, O + r0 * os + c0, os);
    for (; r0 + 3 <= bq; r0 += 3)
      pv_block_bf16<3>(P + r0 * ps, ps, vc, Dv, nb2, nc, O + r0 * os + c0, os);
    for (; r0 < bq; ++r0) pv_block_bf16<1>(P + r0 * ps, ps, vc, Dv, nb2, nc, O + r0 * os + c0, os);
  }
}

// r[0..15] (16 rows of 16 32-bit values) transposed in place: r[c] becomes column c
MXF_BF16 inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i+3
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44), e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
  }
}

// k of one head (bfloat16 rows `rs` elements apart, D even) into its panels (D/2, 32, 2), zero
// past Sk: the pair d2 of key j goes to panel j/32 at (d2, j%32).  Blocks of 16 keys x 16 pairs
// are loaded as rows and transposed in registers.
MXF_BF16 void k_panels_bf16(const uint16_t* k, int64_t rs, int64_t Sk, int64_t D, int64_t Skp,
                            uint16_t* dst) {
  const int64_t D2 = D / 2;
  for (int64_t j0 = 0; j0 < Skp; j0 += 16) {
    int32_t* out = reinterpret_cast<int32_t*>(dst) + (j0 / 32) * 32 * D2 + j0 % 32;
    for (int64_t p0 = 0; p0 < D2; p0 += 16) {
      const __mmask16 m = vmath::tail_mask16(D2 - p0);
      __m512i r[16];
      for (int64_t jj = 0; jj < 16; ++jj) {
        // rows lie a row stride apart (often more than a page: no hardware prefetch across them)
        if (p0 == 0 && j0 + 16 + jj < Sk)
          for (int64_t d = 0; d < D; d += 32) _mm_prefetch(reinterpret_cast<const char*>(k + (j0 + 16 + jj) * rs + d), _MM_HINT_T0);
        r[jj] = j0 + jj < Sk ? _mm512_maskz_loadu_epi32(m, k + (j0 + jj) * rs + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16x16_epi32(r);
      for (int64_t c = 0; c < 16 && p0 + c < D2; ++c) _mm512_storeu_si512(out + (p0 + c) * 32, r[c]);
    }
  }
}

bool k_panels_fit(int64_t D) { return D % 2 == 0; }

// exp(s[c] - m) for c < n, rounded to bfloat16 into p (as to_bf16 rounds: nearest even, a NaN
// kept quiet), p[c] = 0 for n <= c < width; returns the float32 sum of the exps (before rounding,
// in the order exp_shift_sum_avx512 adds them).  One pass where exp_shift_sum_avx512 then to_bf16
// made two over the row.
MXF_BF16 float exp_sum_bf16(const float* s, int64_t n, float m, uint16_t* p, int64_t width) {
  const __m512 vm = _mm512_set1_ps(m);
  auto cvt = [](__m512 e) MXF_BF16 { return vmath::bf16_bits16(_mm512_castps_si512(e)); };
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = vmath::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    acc = _mm512_add_ps(acc, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm512_cvtepi32_epi16(cvt(e)));
  }
  if (i < n) {
    const __mmask16 k = vmath::tail_mask16(n - i);
    const __m512 e = _mm512_maskz_mov_ps(k, vmath::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm)));
    acc = _mm512_add_ps(acc, e);
    // zeros past n, up to width
    _mm512_mask_cvtepi32_storeu_epi16(p + i, vmath::tail_mask16(std::min<int64_t>(16, width - i)), cvt(e));
    i += 16;
  }
  for (; i < width; i += 32) _mm512_mask_storeu_epi16(p + i, static_cast<__mmask32>(
      width - i >= 32 ? ~0u : (1u << (width - i)) - 1u), _mm512_setzero_si512());
  return _mm512_reduce_add_ps(acc);
}

// v of one head (bfloat16 rows `rs` elements apart) into pairs of keys (Skp/2, Dv, 2), zero past
// Sk: two rows interleaved 32 columns at a time.  Returns whether a value is not finite.
MXF_BF16 bool v_pairs_bf16(const uint16_t* v, int64_t rs, int64_t Sk, int64_t Dv, int64_t Skp,
                           uint16_t* dst) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
  const __m512i ex = _mm512_set1_epi16(0x7f80), zero = _mm512_setzero_si512();
  auto lanes = [](int64_t n) -> __mmask32 {
    return n >= 32 ? ~__mmask32{0} : n <= 0 ? __mmask32{0} : static_cast<__mmask32>((1u << n) - 1u);
  };
  __mmask32 bad = 0;
  for (int64_t j = 0; j < Sk; j += 2) {
    const uint16_t* a = v + j * rs;
    const uint16_t* b = j + 1 < Sk ? v + (j + 1) * rs : nullptr;  // an odd tail pairs with zeros
    uint16_t* out = dst + (j / 2) * 2 * Dv;
    for (int64_t a2 = j + 8; a2 < std::min(j + 10, Sk); ++a2)     // rows ahead (see k_panels_bf16)
      for (int64_t c0 = 0; c0 < Dv; c0 += 32) _mm_prefetch(reinterpret_cast<const char*>(v + a2 * rs + c0), _MM_HINT_T0);
    for (int64_t c0 = 0; c0 < Dv; c0 += 32) {
      const int64_t nc = std::min<int64_t>(32, Dv - c0);
      const __mmask32 m = lanes(nc);
      const __m512i va = _mm512_maskz_loadu_epi16(m, a + c0);
      const __m512i vb = b ? _mm512_maskz_loadu_epi16(m, b + c0) : zero;
      bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(va, ex), ex) |
             _mm512_cmpeq_epi16_mask(_mm512_and_si512(vb, ex), ex);
      _mm512_mask_storeu_epi16(out + 2 * c0, lanes(2 * nc), _mm512_permutex2var_epi16(va, ilo, vb));
      if (nc > 16)
        _mm512_mask_storeu_epi16(out + 2 * c0 + 32, lanes(2 * nc - 32), _mm512_permutex2var_epi16(va, ihi, vb));
    }
  }
  std::fill(dst + (Sk + 1) / 2 * 2 * Dv, dst + Skp * Dv, uint16_t{0});
  return bad != 0;
}
#else
bool cpu_has_avx512_bf16() { return false; }
#endif


// k of every (batch, head) transposed in panels of 32 keys: panel p of head n holds
// k[32p .. 32p+31][0 .. D) as (D, 32), contiguous, zero past Sk.  Contiguous panels keep
// qk_block's loads sequential (rows of a plain (D, Sk) transpose lie Sk floats apart,
// which for Sk = 1024 maps them all onto the same L1 sets).  Empty when the AVX-512 tile
// loops are not used (then dnnl_sgemm reads k in place).
struct KT {
  std::vector<float> data;
  int64_t Skp = 0, D = 0;  // Skp: Sk rounded up to 32
  // panels from key j0 (a multiple of 32) of head n
  const float* at(int64_t n, int64_t j0) const { return data.data() + n * D * Skp + j0 * D; }
  // bfloat16 products instead (see qk_tile_bf16): k's panels (Dp/2, 32, 2) and v's pairs
  // (Skp/2, Dv, 2) per head, Dp: D rounded up to 2; data is then empty
  std::vector<uint16_t> kb, vb;
  int64_t Dp = 0, Dv = 0;
  int64_t n0 = 0;  // the first head kb / vb hold (forward_heads_bf16: one head per thread)
  const uint16_t* kat(int64_t n, int64_t j0) const { return kb.data() + (n - n0) * Dp * Skp + j0 * Dp; }
  const uint16_t* vat(int64_t n, int64_t j0) const { return vb.data() + (n - n0) * Skp * Dv + j0 * Dv; }
};

// Facts about the inputs computed once per call and read by every query block.
struct Prep {
  KT kt;
  // causal add: per head, the largest |k_j| over keys j >= index (Sk + 1 entries per
  // head; +inf once a non-finite key is among them)
  std::vector<float> knsuf;
  // rows that skip keys (valid length, causal): per head and value column, the last key
  // whose value is not finite (-1: none)
  std::vector<int64_t> vbad;
  // per head, the keys whose value row holds a non-finite value: head n's are
  // vkeys[voff[n] .. voff[n+1]) (forward only; see nonfinite_values)
  std::vector<int64_t> voff, vkeys;
  bool onednn_softmax = false;  // which softmax the unfused graph runs (see softmax_zero)
  // a bfloat16 output (forward_bf16_io): each block's rows, final in g.o (a float32 buffer
  // laid out as the output), are rounded into it
  uint16_t* out_bf16 = nullptr;
  bool vh_bad = false;  // a bfloat16 v read as it is holds a non-finite value
};

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// |a|, or +inf when a holds a non-finite value (or its squares overflow)
inline float norm(const float* a, int64_t n) {
  const float s = dot(a, a, n);
  return std::isfinite(s) ? std::sqrt(s) : INFINITY;
}

// Whether a row holds a non-finite value: 0 * x is NaN exactly for x = ±inf or NaN.
inline bool any_non_finite(const float* a, int64_t n) {
  float z = 0.f;
#pragma omp simd reduction(+ : z)
  for (int64_t c = 0; c < n; ++c) z += a[c] * 0.f;
  return z != 0.f || std::isnan(z);
}

bool has_nan(const float* s, int64_t n) {
  for (int64_t c = 0; c < n; ++c)
    if (std::isnan(s[c])) return true;
  return false;
}

bool skips_keys(const Params& p, const MaskView& m) {
  return p.causal || m.kind == MaskKind::valid_length;
}

// Whether a bfloat16 row holds a non-finite value (exponent all ones).
bool any_non_finite_bf16(const uint16_t* a, int64_t n) {
  bool bad = false;
  for (int64_t c = 0; c < n; ++c) bad |= (a[c] & 0x7f80u) == 0x7f80u;
  return bad;
}

// k and v of every head as bfloat16 pairs (KT::kb, KT::vb), rounded to nearest even (bfloat16
// inputs, Geom::kh / vh: as they are).  Returns whether a bfloat16 v holds a non-finite value.
// The calling thread's k / v pair buffers, kept between calls (no allocation, no page faults
// per call): prepare_bf16 takes them, forward_io gives them back.
std::vector<uint16_t>& pair_pool(int which) {
  thread_local std::vector<uint16_t> pool[2];
  return pool[which];
}

// Whether q·kᵀ and p·v run as bfloat16 tile products (KT::kb, vb): asked for, a CPU with
// avx512_bf16, key tiles of whole panels, and something to multiply.
bool bf16_tiles(const Geom& g, bool bf16_products) {
  return bf16_products && cpu_has_avx512_bf16() && BK % 32 == 0 && g.Sk > 0 && g.D > 0;
}

// KT's sizes for the bfloat16 pairs of g (buffers not sized)
void pair_dims(const Geom& g, KT& kt) {
  kt.Skp = (g.Sk + 31) / 32 * 32;
  kt.D = g.D;
  kt.Dp = (g.D + 1) / 2 * 2;
  kt.Dv = g.Dv;
}

// Head n's k panels and v pairs (KT::kb, vb layouts) into kd / vd, every element written, the
// padding (keys from Sk on, column D of an odd D) included.  bfloat16 inputs (Geom::kh, vh) are
// taken as they are (laid out 16 / 32 values at a time); float32 ones rounded to nearest even.
// row: scratch of max(D, Dv).  Returns whether a bfloat16 v holds a non-finite value.
bool pair_head(const Geom& g, const KT& kt, int64_t n, uint16_t* kd, uint16_t* vd, std::vector<uint16_t>& row) {
  const int64_t b = n / g.H, h = n % g.H;
  bool bad = false, k_done = false, v_done = false;
#ifdef MXF_HAVE_BF16_PATH
  if (g.kh.p && k_panels_fit(g.D)) {
    k_panels_bf16(g.kh.row(b, h, 0), g.kh.rs, g.Sk, g.D, kt.Skp, kd);
    k_done = true;
  }
  if (g.vh.p) {
    bad = v_pairs_bf16(g.vh.row(b, h, 0), g.vh.rs, g.Sk, g.Dv, kt.Skp, vd);
    v_done = true;
  }
#endif
  if (!k_done) std::fill(kd, kd + kt.Dp * kt.Skp, uint16_t{0});
  if (!v_done) std::fill(vd, vd + kt.Skp * g.Dv, uint16_t{0});
  for (int64_t j = 0; j < g.Sk && !(k_done && v_done); ++j) {
    if (!k_done) {
      const uint16_t* kr = g.kh.p ? g.kh.row(b, h, j) : row.data();
      if (!g.kh.p) to_bf16(g.k.row(b, h, j), row.data(), g.D);
      uint16_t* dst = kd + (j / 32) * 32 * kt.Dp + (j % 32) * 2;
      for (int64_t d = 0; d < g.D; ++d) dst[(d / 2) * 64 + (d & 1)] = kr[d];
    }
    if (!v_done) {
      const uint16_t* vr = g.vh.p ? g.vh.row(b, h, j) : row.data();
      if (!g.vh.p)
        to_bf16(g.v.row(b, h, j), row.data(), g.Dv);
      else
        bad = bad || any_non_finite_bf16(vr, g.Dv);
      uint16_t* dst = vd + (j / 2) * 2 * g.Dv + (j & 1);
      for (int64_t c = 0; c < g.Dv; ++c) dst[2 * c] = vr[c];
    }
  }
  return bad;
}

bool prepare_bf16(const Geom& g, KT& kt) {
  bool bad = false;
  kt.kb.swap(pair_pool(0));
  kt.vb.swap(pair_pool(1));
  const int64_t N = g.B * g.H;
  pair_dims(g, kt);
  kt.kb.resize(static_cast<size_t>(N) * kt.Dp * kt.Skp);
  kt.vb.resize(static_cast<size_t>(N) * kt.Skp * g.Dv);
#pragma omp parallel reduction(|| : bad)
  {
    std::vector<uint16_t> row(std::max(g.D, g.Dv));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      bad = pair_head(g, kt, n, kt.kb.data() + n * kt.Dp * kt.Skp, kt.vb.data() + n * kt.Skp * g.Dv, row) || bad;
  }
  return bad;
}

Prep prepare(const Params& p, const Geom& g, const MaskView& m, bool forward, bool bf16 = false) {
  Prep pr;
  const int64_t N = g.B * g.H;
  if (forward && bf16_tiles(g, bf16)) {
    pr.vh_bad = prepare_bf16(g, pr.kt);
  } else if (forward && cpu_has_avx512() && BK % 32 == 0 && g.Sk > 0 && g.D > 0) {
    KT& kt = pr.kt;
    kt.Skp = (g.Sk + 31) / 32 * 32;
    kt.D = g.D;
    kt.data.assign(static_cast<size_t>(N) * g.D * kt.Skp, 0.f);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const int64_t b = n / g.H, h = n % g.H;
      for (int64_t j = 0; j < g.Sk; ++j) {
        const float* krow = g.k.row(b, h, j);
        float* dst = kt.data.data() + n * g.D * kt.Skp + (j / 32) * 32 * g.D + j % 32;
        for (int64_t d = 0; d < g.D; ++d) dst[d * 32] = krow[d];
      }
    }
  }
  if (p.causal && p.causal_mode == CausalMode::add) {
    pr.knsuf.assign(static_cast<size_t>(N) * (g.Sk + 1), 0.f);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float* suf = pr.knsuf.data() + n * (g.Sk + 1);
      for (int64_t j = g.Sk; j-- > 0;)
        suf[j] = std::max(suf[j + 1], norm(g.k.row(n / g.H, n % g.H, j), g.D));
    }
  }
  if (forward && g.vh.p) {
    // bfloat16 inputs read as they are (forward_bf16_io): nothing is causal, the bfloat16
    // products run (checked there), and no value of v is non-finite (vh_bad otherwise: the
    // caller widens the inputs)
    pr.onednn_softmax = softmax_nan_at_scores(p, g);
    pr.voff.assign(N + 1, 0);
    return pr;
  }
  if (forward) {
    pr.onednn_softmax = softmax_nan_at_scores(p, g);
    std::vector<std::vector<int64_t>> keys(N);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < g.Sk; ++j)
        if (any_non_finite(g.v.row(n / g.H, n % g.H, j), g.Dv)) keys[n].push_back(j);
    pr.voff.assign(N + 1, 0);
    for (int64_t n = 0; n < N; ++n) {
      pr.voff[n + 1] = pr.voff[n] + static_cast<int64_t>(keys[n].size());
      pr.vkeys.insert(pr.vkeys.end(), keys[n].begin(), keys[n].end());
    }
  }
  if (forward && skips_keys(p, m)) {
    pr.vbad.assign(static_cast<size_t>(N) * g.Dv, -1);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      int64_t* bad = pr.vbad.data() + n * g.Dv;
      for (int64_t j = 0; j < g.Sk; ++j) {
        const float* vr = g.v.row(n / g.H, n % g.H, j);
        if (!any_non_finite(vr, g.Dv)) continue;
        for (int64_t c = 0; c < g.Dv; ++c)
          if (!std::isfinite(vr[c])) bad[c] = j;
      }
    }
  }
  return pr;
}

// Whether the keys after row i's causal band (keys >= e, e >= 1) can be skipped under
// causal_mode add / fill: their probabilities are then below e^-110, 0 in float32, and
// their scores are not NaN or +inf.  Proved from bounds: the row max is at least the
// score L of key e-1 (visible), and a skipped score is at most |scale|·|q_i|·max|k_j|
// + c (add) or c (fill).  Otherwise the row computes those keys like the unfused graph.
bool band_skips(const Params& p, const Geom& g, const Prep& pr, int64_t n, int64_t i, int64_t e) {
  if (e >= g.Sk) return true;  // nothing after the band
  if (e <= 0) return false;    // no visible key: the scores after the band decide the row
  const double c = p.mask_value;
  if (std::isnan(c)) return false;
  const bool add = p.causal_mode == CausalMode::add;
  const int64_t b = n / g.H, h = n % g.H;
  const float* qi = g.q.row(b, h, i);
  double U = 0;  // add: bound on |score| after the band
  if (add) {
    U = std::fabs(static_cast<double>(p.scale)) * norm(qi, g.D) * pr.knsuf[n * (g.Sk + 1) + e];
    if (!std::isfinite(U)) return false;
  }
  if (c == -INFINITY) return true;  // every skipped score is -inf
  if (c == INFINITY) return false;
  const float* ke = g.k.row(b, h, e - 1);
  const double L = static_cast<double>(p.scale) * dot(qi, ke, g.D);
  if (!std::isfinite(L)) return false;
  // slack for the float32 rounding of the scores (relative to |scale|·|q|·|k|) and of score + c
  const double lower = L - 1e-3 * std::fabs(L) - (1e-4 + 1.2e-7 * g.D) *
                       std::fabs(static_cast<double>(p.scale)) * norm(qi, g.D) * norm(ke, g.D);
  const double upper = c + 1e-6 * std::fabs(c) + (add ? U * (1 + 1e-3) : 0.0);
  return upper - lower < -110.0;
}

struct Scratch {
  std::vector<float> S, O, m, l;
  // keys [0, lim) are computed; keys [band, lim) get the causal add / fill (band = lim
  // unless a row of causal_mode add / fill cannot skip the keys after its band)
  std::vector<int64_t> lim, band;
  std::vector<char> touched;
  Scratch(int64_t Dv) : S(BQ * BK), O(BQ * std::max<int64_t>(Dv, 1)), m(BQ), l(BQ),
                        lim(BQ), band(BQ), touched(BQ) {}
  // room for value rows of Dv (a Scratch kept between calls; every field is written before it is read)
  void fit(int64_t Dv) {
    if (O.size() < static_cast<size_t>(BQ * std::max<int64_t>(Dv, 1))) O.resize(BQ * std::max<int64_t>(Dv, 1));
  }
};

// Plans the rows of a query block (keys they compute) and resets their running
// statistics; returns how many keys any row computes.
int64_t init_rows(const Params& p, const Geom& g, const MaskView& mk, const Prep& pr, int64_t n,
                  int64_t i0, int64_t bq, Scratch& w) {
  int64_t kmax = 0;
  for (int64_t r = 0; r < bq; ++r) {
    const int64_t i = i0 + r;
    int64_t kend = g.Sk;
    if (mk.kind == MaskKind::valid_length)
      kend = std::max<int64_t>(0, std::min<int64_t>(g.Sk, mk.lengths[n * g.Sq + i]));
    int64_t lim = kend, band = kend;
    if (p.causal) {  // bottom-right aligned band: keys j <= i + Sk - Sq
      band = std::max<int64_t>(0, std::min<int64_t>(kend, i + (g.Sk - g.Sq) + 1));
      lim = p.causal_mode == CausalMode::exclude || band_skips(p, g, pr, n, i, band) ? band : kend;
    }
    w.lim[r] = lim;
    w.band[r] = band;
    w.m[r] = NEG_INF;
    w.l[r] = 0.f;
    w.touched[r] = lim > 0;
    kmax = std::max(kmax, lim);
  }
  return kmax;
}

// S[r, c] = scale * q_i . k_j, then the mask and the causal add / fill; columns past a
// row's limit are left as they are.
void score_tile(const Params& p, const Geom& g, const MaskView& m, int64_t n, int64_t i0,
                int64_t bq, int64_t j0, int64_t nb, float* S, const Scratch& w,
                const KT* kt = nullptr) {
  const int64_t b = n / g.H, h = n % g.H;
#ifdef MXF_HAVE_BF16_PATH
  if (kt && !kt->kb.empty() && g.qh.p && kt->Dp == g.D) {
    // bfloat16 queries of an even D: their pairs read in place
    qk_tile_bf16(g.qh.row(b, h, i0), g.qh.rs, kt->kat(n, j0), kt->Dp, bq, nb, p.scale, S, BK);
  } else if (kt && !kt->kb.empty()) {
    thread_local std::vector<uint16_t> qb;  // the block's queries in bfloat16, D padded to Dp
    qb.assign(bq * kt->Dp, 0);
    for (int64_t r = 0; r < bq; ++r) {
      if (g.qh.p)
        std::memcpy(qb.data() + r * kt->Dp, g.qh.row(b, h, i0 + r), g.D * sizeof(uint16_t));
      else
        to_bf16(g.q.row(b, h, i0 + r), qb.data() + r * kt->Dp, g.D);
    }
    qk_tile_bf16(qb.data(), kt->Dp, kt->kat(n, j0), kt->Dp, bq, nb, p.scale, S, BK);
  } else
#endif
#ifdef MXF_HAVE_AVX512_PATH
  if (kt && !kt->data.empty())
    qk_tile(g.q.row(b, h, i0), g.q.rs, kt->at(n, j0), g.D, bq, nb, p.scale, S, BK);
  else
#endif
    sgemm('N', 'T', bq, nb, g.D, p.scale, g.q.row(b, h, i0), g.q.rs, g.k.row(b, h, j0), g.k.rs,
          0.f, S, BK);
  if (m.kind == MaskKind::additive || m.kind == MaskKind::boolean) {
    const float* mb = m.base(n);
    for (int64_t r = 0; r < bq; ++r) {
      const float* mr = mb + (i0 + r) * m.sq + j0 * m.sk;
      float* s = S + r * BK;
      if (m.kind == MaskKind::additive) {
        if (m.sk == 1)
          for (int64_t c = 0; c < nb; ++c) s[c] += mr[c];
        else
          for (int64_t c = 0; c < nb; ++c) s[c] += mr[c * m.sk];
      } else {
        const float mv = p.mask_value;
        for (int64_t c = 0; c < nb; ++c) s[c] = mr[c * m.sk] != 0.f ? s[c] : mv;
      }
    }
  }
  if (p.causal && p.causal_mode != CausalMode::exclude) {
    const float cv = p.mask_value;
    for (int64_t r = 0; r < bq; ++r) {
      const int64_t c0 = std::max<int64_t>(0, w.band[r] - j0);
      const int64_t c1 = std::min<int64_t>(nb, w.lim[r] - j0);
      float* s = S + r * BK;
      if (p.causal_mode == CausalMode::add)
        for (int64_t c = c0; c < c1; ++c) s[c] += cv;
      else
        for (int64_t c = c0; c < c1; ++c) s[c] = cv;
    }
  }
}

// Online-softmax statistics (row max m, row sum l) over a row's keys, for one query
// block.  Used by backward.
void row_stats(const Params& p, const Geom& g, const MaskView& mk, const Prep& pr, int64_t n,
               int64_t i0, int64_t bq, Scratch& w) {
  const int64_t kmax = init_rows(p, g, mk, pr, n, i0, bq, w);
  for (int64_t j0 = 0; j0 < kmax; j0 += BK) {
    const int64_t nb = std::min(BK, kmax - j0);
    score_tile(p, g, mk, n, i0, bq, j0, nb, w.S.data(), w);
    for (int64_t r = 0; r < bq; ++r) {
      const int64_t cl = std::min(nb, w.lim[r] - j0);
      if (cl <= 0) continue;
      const float* s = &w.S[r * BK];
      float mx = NEG_INF;
#pragma omp simd reduction(max : mx)
      for (int64_t c = 0; c < cl; ++c) mx = s[c] > mx ? s[c] : mx;
      const float mn = std::max(w.m[r], mx);
      if (mn == NEG_INF) {  // everything so far is -inf (or NaN: the row's output is NaN)
        if (has_nan(s, cl)) w.l[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cl; ++c) sum += fast_exp(s[c] - mn);
      w.l[r] = w.l[r] * fast_exp(w.m[r] - mn) + sum;
      w.m[r] = mn;
    }
  }
}

// Whether the unfused softmax gives a probability of exactly 0 for a score d below the row
// max (d = s - max <= 0; l: the row's sum).  oneDNN's exp builds 2^n, n = floor(d·log2(e) +
// 1/2), as 2^(n-1)·2 from exponent bits, which are 0 (the value 0) for n <= -126: its result
// is 0 below about -86.99 (measured against MXNet 1.9.1's softmax: d = -86.9 gives 4.5e-39,
// d = -87.2 gives 0).  MXNet's own kernel computes expf(d) / sum, which keeps subnormal
// results, so it is 0 only where that quotient rounds to 0.
bool softmax_zero(bool onednn, float d, float l) {
  if (std::isnan(d)) return false;
  if (onednn) return std::floor(std::fma(d, 1.44269502f, 0.5f)) <= -126.f;
  const double q = std::exp(static_cast<double>(d)) / static_cast<double>(l);
  return q < std::ldexp(1.0, -150);     // below half the smallest subnormal: rounds to 0
}

// The score of query i and key j as score_tile computes it (row r of the block).
float score_at(const Params& p, const Geom& g, const MaskView& m, int64_t n, int64_t i, int64_t j,
               int64_t r, const Scratch& w) {
  const int64_t b = n / g.H, h = n % g.H;
  float s = p.scale * dot(g.q.row(b, h, i), g.k.row(b, h, j), g.D);
  if (m.kind == MaskKind::additive || m.kind == MaskKind::boolean) {
    const float mv = m.base(n)[i * m.sq + j * m.sk];
    s = m.kind == MaskKind::additive ? s + mv : (mv != 0.f ? s : p.mask_value);
  }
  if (p.causal && p.causal_mode != CausalMode::exclude && j >= w.band[r] && j < w.lim[r])
    s = p.causal_mode == CausalMode::add ? s + p.mask_value : p.mask_value;
  return s;
}

// Output columns of a finite row where v holds a non-finite value among the keys the row
// computes: the unfused product sums P_j * v_j, so the column is NaN where some such v_j is
// NaN, or is ±inf where P_j = 0 (0 * inf), or where +inf and -inf meet; ±inf otherwise.
// Which P_j are 0 depends on the final row max, which the online softmax does not know
// while it accumulates (nor does its exp flush where the unfused softmax's does), so these
// columns are recomputed from the keys themselves.
void nonfinite_values(const Params& p, const Geom& g, const MaskView& mk, const Prep& pr,
                      int64_t n, int64_t i0, int64_t bq, const Scratch& w) {
  const int64_t k0 = pr.voff[n], k1 = pr.voff[n + 1];
  if (k0 == k1) return;
  const int64_t b = n / g.H, h = n % g.H, Dv = g.Dv;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<char> seen(Dv);
  for (int64_t r = 0; r < bq; ++r) {
    if (!(w.l[r] > 0.f)) continue;  // a NaN or untouched row: written whole by finish_rows
    float* out = g.o.mrow(b, h, i0 + r);
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t t = k0; t < k1 && pr.vkeys[t] < w.lim[r]; ++t) {
      const int64_t j = pr.vkeys[t];
      const float* vr = g.v.row(b, h, j);
      const bool zero = softmax_zero(pr.onednn_softmax,
                                     score_at(p, g, mk, n, i0 + r, j, r, w) - w.m[r], w.l[r]);
      for (int64_t c = 0; c < Dv; ++c) {
        const float x = vr[c];
        if (std::isfinite(x)) continue;
        const float term = std::isnan(x) || zero ? nan : x;
        // the first non-finite term of a column replaces its finite sum; later ones add to it
        out[c] = seen[c] ? out[c] + term : term;
        seen[c] = 1;
      }
    }
  }
}

// Writes the block's output rows: untouched rows (valid length 0, empty band) give 0 as
// MXNet's softmax with lengths does; rows whose scores are all -inf, or hold a NaN or
// +inf, give NaN as softmax does.  A row that skips keys [lim, Sk) gives NaN in every
// column where v is not finite among them (0 * inf and 0 * NaN are NaN in the unfused
// product).
// Row r's values from the block's sums (out may be the row of w.O itself): O / l, or 0 for an
// untouched row and NaN for a touched one without a positive sum.
void finish_row(const Scratch& w, int64_t r, int64_t Dv, float* out) {
  const float* o = &w.O[r * Dv];
  if (w.l[r] > 0.f) {
    const float inv = 1.f / w.l[r];
    for (int64_t c = 0; c < Dv; ++c) out[c] = o[c] * inv;
  } else {
    std::fill(out, out + Dv, w.touched[r] ? std::numeric_limits<float>::quiet_NaN() : 0.f);
  }
}

void finish_rows(const Params& p, const Geom& g, const MaskView& mk, const Prep& pr, int64_t n,
                 int64_t i0, int64_t bq, const Scratch& w) {
  const int64_t b = n / g.H, h = n % g.H, Dv = g.Dv;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < bq; ++r) finish_row(w, r, Dv, g.o.mrow(b, h, i0 + r));
  nonfinite_values(p, g, mk, pr, n, i0, bq, w);
  for (int64_t r = 0; r < bq; ++r) {
    float* out = g.o.mrow(b, h, i0 + r);
    if (!pr.vbad.empty() && w.lim[r] < g.Sk) {
      const int64_t* bad = pr.vbad.data() + n * Dv;
      for (int64_t c = 0; c < Dv; ++c)
        if (bad[c] >= w.lim[r]) out[c] = nan;
    }
  }
}

// length_fill: the Sk - lim keys a row did not compute (past its length or causal band) have the
// score c = mask_value in the unfused softmax and probability 0·P in its product: they join the
// row's max and sum (c once per key), not the accumulator.  A row with no key of its own gets
// max c and sum Sk - lim: output 0 (NaN where v is not finite among those keys: finish_rows).
// A NaN row (sum NaN) stays NaN.
void fill_hidden_keys(const Params& p, const Geom& g, int64_t bq, Scratch& w) {
  const float c = p.mask_value;
  for (int64_t r = 0; r < bq; ++r) {
    const int64_t hidden = g.Sk - w.lim[r];
    if (hidden <= 0 || std::isnan(w.l[r])) continue;
    const float mn = std::max(w.m[r], c);
    const float alpha = w.m[r] == NEG_INF ? 0.f : fast_exp(w.m[r] - mn);
    if (alpha != 1.f) {
      float* o = &w.O[r * g.Dv];
      for (int64_t col = 0; col < g.Dv; ++col) o[col] *= alpha;
    }
    w.l[r] = w.l[r] * alpha + static_cast<float>(hidden) * fast_exp(c - mn);
    w.m[r] = mn;
    w.touched[r] = 1;
  }
}

// length_fill with a boolean mask (softmax(where(m, s, c)) * m): the exps of a tile, already in
// the row's sum, multiplied by the mask's values before the product with v (pb: the bfloat16
// exps of the tile, rounded again; else S in float32).
void scale_by_mask(const MaskView& mk, int64_t n, int64_t i0, int64_t bq, int64_t j0, int64_t nb,
                   float* S, uint16_t* pb, int64_t pw) {
  const float* mb = mk.base(n);
  for (int64_t r = 0; r < bq; ++r) {
    const float* mr = mb + (i0 + r) * mk.sq + j0 * mk.sk;
    if (pb) {
      uint16_t* q = pb + r * pw;
      for (int64_t c = 0; c < nb; ++c) {
        float e;
        const uint32_t bits = static_cast<uint32_t>(q[c]) << 16;
        std::memcpy(&e, &bits, sizeof e);
        e *= mr[c * mk.sk];
        to_bf16(&e, q + c, 1);
      }
    } else {
      float* s = S + r * BK;
      for (int64_t c = 0; c < nb; ++c) s[c] *= mr[c * mk.sk];
    }
  }
}

void forward_block(const Params& p, const Geom& g, const MaskView& mk, const Prep& pr, int64_t n,
                   int64_t i0, int64_t bq, Scratch& w) {
  const int64_t b = n / g.H, h = n % g.H, Dv = g.Dv;
  const bool avx512 = cpu_has_avx512();  // the softmax loops in AVX-512 (vmath_avx512.h)
  const int64_t kmax = init_rows(p, g, mk, pr, n, i0, bq, w);
  std::fill(w.O.begin(), w.O.begin() + bq * Dv, 0.f);
  for (int64_t j0 = 0; j0 < kmax; j0 += BK) {
    const int64_t nb = std::min(BK, kmax - j0);
    float* S = w.S.data();
    score_tile(p, g, mk, n, i0, bq, j0, nb, S, w, &pr.kt);
#ifdef MXF_HAVE_BF16_PATH
    // bfloat16 products (a CPU with avx512_bf16, so with AVX-512): each row's exps are rounded into
    // pb as they are computed (nb2 key pairs a row; an odd tail pairs with a zero)
    const bool bf16_pv = !pr.kt.kb.empty();
    const int64_t nb2 = (nb + 1) / 2;
    thread_local std::vector<uint16_t> pb;
    if (bf16_pv && pb.size() < static_cast<size_t>(bq * nb2 * 2)) pb.resize(bq * nb2 * 2);
#else
    const bool bf16_pv = false;
#endif
    for (int64_t r = 0; r < bq; ++r) {
      float* s = S + r * BK;
      const int64_t cl = std::max<int64_t>(0, std::min(nb, w.lim[r] - j0));
      // The reductions are written for `omp simd` so that the loops vectorize (a plain float
      // sum may not be reordered, which keeps GCC from vectorizing the exp loop at all).
      // A NaN score never becomes the max; it reaches the sum through exp and makes the
      // row NaN, as in MXNet's softmax.
      float mx = NEG_INF;
      if (avx512) {
        mx = row_max_avx512(s, cl);
      } else {
#pragma omp simd reduction(max : mx)
        for (int64_t c = 0; c < cl; ++c) mx = s[c] > mx ? s[c] : mx;
      }
      const float mn = std::max(w.m[r], mx);
      if (mn == NEG_INF) {  // no finite score yet: contributes nothing, unless one is NaN
        if (has_nan(s, cl)) w.l[r] = std::numeric_limits<float>::quiet_NaN();
        std::fill(s, s + nb, 0.f);
#ifdef MXF_HAVE_BF16_PATH
        if (bf16_pv) std::fill(pb.data() + r * nb2 * 2, pb.data() + (r + 1) * nb2 * 2, uint16_t{0});
#endif
        continue;
      }
      float sum = 0.f;
#ifdef MXF_HAVE_BF16_PATH
      if (bf16_pv) {
        sum = exp_sum_bf16(s, cl, mn, pb.data() + r * nb2 * 2, nb2 * 2);
      } else
#endif
      if (avx512) {
        sum = exp_shift_sum_avx512(s, cl, mn);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cl; ++c) s[c] = fast_exp(s[c] - mn);
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cl; ++c) sum += s[c];
      }
      if (!bf16_pv)
        for (int64_t c = cl; c < nb; ++c) s[c] = 0.f;
      const float alpha = fast_exp(w.m[r] - mn);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = mn;
      if (alpha != 1.f) {
        float* o = &w.O[r * Dv];
        for (int64_t c = 0; c < Dv; ++c) o[c] *= alpha;
      }
    }
    if (p.length_fill && mk.kind == MaskKind::boolean) {
#ifdef MXF_HAVE_BF16_PATH
      scale_by_mask(mk, n, i0, bq, j0, nb, S, bf16_pv ? pb.data() : nullptr, nb2 * 2);
#else
      scale_by_mask(mk, n, i0, bq, j0, nb, S, nullptr, 0);
#endif
    }
#ifdef MXF_HAVE_BF16_PATH
    if (bf16_pv) {
      pv_tile_bf16(pb.data(), nb2 * 2, pr.kt.vat(n, j0), Dv, bq, nb2, w.O.data(), Dv);
      continue;
    }
#endif
#ifdef MXF_HAVE_AVX512_PATH
    if (!pr.kt.data.empty()) {
      pv_tile(S, BK, g.v.row(b, h, j0), g.v.rs, bq, nb, Dv, w.O.data(), Dv);
      continue;
    }
#endif
    sgemm('N', 'N', bq, Dv, nb, 1.f, S, BK, g.v.row(b, h, j0), g.v.rs, 1.f, w.O.data(), Dv);
  }
  if (p.length_fill) fill_hidden_keys(p, g, bq, w);
  if (pr.out_bf16 && pr.voff[n] == pr.voff[n + 1] && pr.vbad.empty()) {
    // a bfloat16 output and no non-finite value of v for finish_rows to revisit: each row scaled
    // in place and rounded straight into the output (finish_rows's values, not kept in float32)
    for (int64_t r = 0; r < bq; ++r) {
      float* o = &w.O[r * Dv];
      finish_row(w, r, Dv, o);
      to_bf16(o, pr.out_bf16 + (g.o.row(b, h, i0 + r) - g.o.p), Dv);
    }
    return;
  }
  finish_rows(p, g, mk, pr, n, i0, bq, w);
  if (pr.out_bf16)
    for (int64_t r = 0; r < bq; ++r) {
      const float* row = g.o.row(b, h, i0 + r);
      to_bf16(row, pr.out_bf16 + (row - g.o.p), Dv);
    }
}

// bfloat16 q, k, v read as they are (forward_bf16_io's direct path) with at least two heads per
// thread: one task per head, whose thread lays out that head's k panels and v pairs (into its own
// buffers, kept between calls: they stay in its cache) and then runs the head's query blocks; one
// parallel region per call.  false where a value of v is not finite (the caller widens the inputs
// and runs again, writing every output).
bool forward_heads_bf16(const Params& p, const Geom& g, const MaskView& m, uint16_t* out_bf16) {
  const int64_t N = g.B * g.H;
  Prep base;
  base.onednn_softmax = softmax_nan_at_scores(p, g);
  base.voff.assign(N + 1, 0);  // no value of v is non-finite (checked per head below)
  base.out_bf16 = out_bf16;
  pair_dims(g, base.kt);
  std::atomic<bool> bad{false};
  std::string err;
#pragma omp parallel
  {
    thread_local Scratch w(0);
    w.fit(g.Dv);
    Prep pr = base;
    KT& kt = pr.kt;
    kt.kb.swap(pair_pool(0));
    kt.vb.swap(pair_pool(1));
    kt.kb.resize(static_cast<size_t>(kt.Dp) * kt.Skp);
    kt.vb.resize(static_cast<size_t>(kt.Skp) * g.Dv);
    std::vector<uint16_t> row(std::max(g.D, g.Dv));
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < N; ++n) {
      if (bad.load(std::memory_order_relaxed)) continue;
      try {
        if (pair_head(g, kt, n, kt.kb.data(), kt.vb.data(), row)) {
          bad = true;
          continue;
        }
        kt.n0 = n;
        for (int64_t i0 = 0; i0 < g.Sq; i0 += BQ) forward_block(p, g, m, pr, n, i0, std::min(BQ, g.Sq - i0), w);
      } catch (const std::exception& e) {
#pragma omp critical
        err = e.what();
      }
    }
    kt.kb.swap(pair_pool(0));
    kt.vb.swap(pair_pool(1));
  }
  if (!err.empty()) throw OpError(err);
  return !bad;
}

}  // namespace

void forward_reduced(const Params& p, const Geom& g, const MaskView& m, bool bf16_products);
bool forward_io(const Params& p, const Geom& g, const MaskView& m, bool bf16_products,
                uint16_t* out_bf16);
void forward(const Params& p, const Geom& g, const MaskView& m) { forward_reduced(p, g, m, false); }

// bf16_products: q·kᵀ and p·v in bfloat16 with float32 accumulation where the CPU has
// avx512_bf16 (float32 elsewhere); everything else as forward().
void forward_reduced(const Params& p, const Geom& g, const MaskView& m, bool bf16_products) {
  forward_io(p, g, m, bf16_products, nullptr);
}

// bfloat16 inputs and/or output.  The inputs are the values the float32 path would round to
// bfloat16 itself (precision="bfloat16"), so they are read as they are where that path would
// only round them: with the bfloat16 products (a CPU with avx512_bf16), no causal band (its
// skipping bounds read the values) and every value finite.  Otherwise they are widened to
// float32 (exactly) and the float32 path runs on them.  A bfloat16 output is the float32
// result rounded to nearest even (as a reader rounding it would), block by block.
void forward_bf16_io(const Params& p, Geom g, const MaskView& m, bool bf16_products, bool bf16_in,
                     uint16_t* out_bf16) {
  const int64_t N = g.B * g.H;
  std::vector<float> qf, kf, vf;
  // a bfloat16 output: the float32 result goes to a buffer laid out as the output, kept between
  // calls (no allocation, no page faults per call)
  thread_local std::vector<float> of;
  if (out_bf16) {
    const size_t need = static_cast<size_t>(N) * g.Sq * g.Dv;
    if (of.size() < need) of.resize(need);
    g.o.p = of.data();
  }
  if (bf16_in) {
    const bool direct = bf16_tiles(g, bf16_products) && !p.causal;
    // read as they are, unless v holds a non-finite value (seen while its pairs are laid out)
    if (direct && forward_io(p, g, m, bf16_products, out_bf16)) return;
    {  // widen q, k, v to float32, each head's rows contiguous
      auto widen = [&](const HView& src, int64_t S, int64_t D, std::vector<float>& buf) -> View {
        buf.resize(static_cast<size_t>(N) * S * D);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; ++n)
          for (int64_t j = 0; j < S; ++j)
            from_bf16(src.row(n / g.H, n % g.H, j), buf.data() + (n * S + j) * D, D);
        return View{buf.data(), g.H * S * D, S * D, D};
      };
      g.q = widen(g.qh, g.Sq, g.D, qf);
      g.k = widen(g.kh, g.Sk, g.D, kf);
      g.v = widen(g.vh, g.Sk, g.Dv, vf);
      g.qh = g.kh = g.vh = HView{};
    }
  }
  forward_io(p, g, m, bf16_products, out_bf16);
}

// false (nothing written) where bfloat16 inputs read as they are hold a non-finite v
bool forward_io(const Params& p, const Geom& g, const MaskView& m, bool bf16_products,
                uint16_t* out_bf16) {
  const int64_t nqb = (g.Sq + BQ - 1) / BQ, N = g.B * g.H, tasks = N * nqb;
  if (tasks == 0) return true;
  if (g.kh.p && g.vh.p && bf16_tiles(g, bf16_products) && N >= 2 * omp_get_max_threads())
    return forward_heads_bf16(p, g, m, out_bf16);
  Prep pr = prepare(p, g, m, true, bf16_products);
  if (pr.vh_bad) return false;
  pr.out_bf16 = out_bf16;
  std::string err;
#pragma omp parallel
  {
    Scratch w(g.Dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n = t / nqb, i0 = (t % nqb) * BQ;
      try {
        forward_block(p, g, m, pr, n, i0, std::min(BQ, g.Sq - i0), w);
      } catch (const std::exception& e) {
#pragma omp critical
        err = e.what();
      }
    }
  }
  if (!pr.kt.kb.empty()) {
    pr.kt.kb.swap(pair_pool(0));
    pr.kt.vb.swap(pair_pool(1));
  }
  if (!err.empty()) throw OpError(err);
  return true;
}

namespace {

// The vector width of MXNet's oneDNN softmax kernel (its jit code for the CPU's ISA, capped
// by DNNL_MAX_CPU_ISA / MKLDNN_MAX_CPU_ISA as oneDNN caps it): 16 floats with AVX-512, 8
// with AVX2; 0 where its lane behaviour is not modelled.
int onednn_lanes() {
  static const int lanes = [] {
    std::string cap;
    for (const char* name : {"DNNL_MAX_CPU_ISA", "MKLDNN_MAX_CPU_ISA"})
      if (const char* e = std::getenv(name))
        if (*e) { cap = e; break; }
    for (auto& ch : cap) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool avx2 = __builtin_cpu_supports("avx2");
    const bool cap512 = cap.empty() || cap == "ALL" || cap.rfind("AVX512_CORE", 0) == 0;
    const bool cap2 = cap512 || cap.rfind("AVX2", 0) == 0;
    return avx512 && cap512 ? 16 : avx2 && cap2 ? 8 : 0;
  }();
  return lanes;
}

// oneDNN's softmax on a row holding a NaN score (MXNet 1.9.1's bundled oneDNN; measured
// against its softmax on rows with NaN / ±inf scores at every length to 70, AVX-512 and
// AVX2): the row max is kept per vector lane, lane l taking scores l, l+W, ... through
// vmaxps from -FLT_MAX, which returns its second operand (the incoming score) when either
// is NaN, so a NaN stays in a lane only when it is the lane's last score (AVX2 runs the tail
// as a full vector padded with -FLT_MAX, AVX-512 masks it); the horizontal reduction (max
// with the lane W/2, W/4, ..., 1 apart, the same operand rule) carries it to lane l ^ (W-1).
// Then e_j = exp(s_j - max of j's lane), with exp(NaN) = +inf, and P_j = e_j / sum(e): NaN
// where e_j is +inf and 0 elsewhere when the sum is +inf, NaN everywhere when it is 0.
struct LaneMax {
  int W = 0;
  float v[16];
  bool inf_sum = false;  // some e_j is +inf
  void reset(int w) {
    W = w;
    inf_sum = false;
    std::fill(v, v + 16, -std::numeric_limits<float>::max());
  }
  void feed(int64_t j, float x) {
    float& m = v[j % W];
    m = std::isnan(m) || std::isnan(x) ? x : std::max(m, x);
  }
  void finish(int64_t n) {
    if (W == 8)
      for (int64_t j = n; j % W != 0; ++j) feed(j, -std::numeric_limits<float>::max());
    for (int k = W / 2; k >= 1; k /= 2) {
      float t[16];
      for (int l = 0; l < W; ++l) {
        const float a = v[l], b = v[l ^ k];
        t[l] = std::isnan(a) || std::isnan(b) ? b : std::max(a, b);
      }
      std::copy(t, t + W, v);
    }
  }
  // whether e_j = exp(s_j - lane max) is +inf (NaN difference, or exp overflows)
  bool inf_at(int64_t j, float s) const {
    const float d = s - v[j % W];
    return std::isnan(d) || d > 88.72283935546875f;  // ln(FLT_MAX)
  }
};

// Probabilities of a score tile in place: P = exp(S - m) / l for the keys a row computes
// (c < its limit), 0 after them.  A row whose softmax is NaN (l not > 0 while it sees keys:
// a NaN or +inf score, or every score -inf) has NaN probabilities where the unfused graph's
// softmax puts them: at every key it sees (MXNet's own kernel, `lanes` null), or as oneDNN's
// softmax does (see LaneMax).
void probs_tile(const Scratch& w, const float* inv, const LaneMax* lanes, int64_t bq, int64_t j0,
                int64_t nb, float* S) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int64_t r = 0; r < bq; ++r) {
    float* s = S + r * BK;
    const int64_t cl = std::max<int64_t>(0, std::min(nb, w.lim[r] - j0));
    const float m = w.m[r], il = inv[r];
    if (lanes && lanes[r].W && !(w.l[r] > 0.f)) {
      const LaneMax& lm = lanes[r];
      for (int64_t c = 0; c < cl; ++c) s[c] = !lm.inf_sum || lm.inf_at(j0 + c, s[c]) ? nan : 0.f;
    } else {
#pragma omp simd
      for (int64_t c = 0; c < cl; ++c) s[c] = fast_exp(s[c] - m) * il;
    }
    for (int64_t c = cl; c < nb; ++c) s[c] = 0.f;
  }
}

// The rows of a block whose softmax is NaN: their LaneMax (`lanes`, under oneDNN's softmax),
// over every key — the keys after a causal band too, with their add / fill, where the kernel
// skipped them (a NaN row's band may be skipped: its NaN or +inf score lies inside) — and
// dV_j = NaN for each key j after the band whose probability is NaN (every one under MXNet's
// own softmax, where P = exp(s - max) / NaN; under oneDNN's, where e_j is +inf).  W = 0 (an
// ISA whose lanes are not modelled): every probability of the row NaN.
void nan_rows(const Params& p, const Geom& g, const MaskView& mk, int64_t n, int64_t i0,
              int64_t bq, Scratch& w, LaneMax* lanes, const View& dv) {
  const int W = lanes ? onednn_lanes() : 0;
  const bool after_band = p.causal && p.causal_mode != CausalMode::exclude;
  const float cv = p.mask_value, nan = std::numeric_limits<float>::quiet_NaN();
  int64_t jend = 0;
  bool skipped = false;
  for (int64_t r = 0; r < bq; ++r) {
    if (lanes) lanes[r].reset(W);
    if (w.l[r] > 0.f || w.lim[r] == 0) continue;
    jend = std::max(jend, after_band ? g.Sk : w.lim[r]);
    skipped = skipped || w.lim[r] < g.Sk;
  }
  const bool model = W != 0;
  if (!model && !(after_band && skipped)) return;
  const int64_t b = n / g.H, h = n % g.H;
  // passes: 0 the lane maxima, 1 whether the sum is +inf, 2 the keys after a band
  for (int pass = model ? 0 : 2; pass < 3; ++pass) {
    for (int64_t j0 = 0; j0 < jend; j0 += BK) {
      const int64_t nb = std::min(BK, jend - j0);
      float* S = w.S.data();
      score_tile(p, g, mk, n, i0, bq, j0, nb, S, w);
      for (int64_t r = 0; r < bq; ++r) {
        if (w.l[r] > 0.f || w.lim[r] == 0) continue;
        float* s = S + r * BK;
        const int64_t ce = after_band ? nb : std::max<int64_t>(0, std::min(nb, w.lim[r] - j0));
        for (int64_t c = std::max<int64_t>(0, w.lim[r] - j0); c < ce; ++c)  // skipped keys' form
          s[c] = p.causal_mode == CausalMode::add ? s[c] + cv : cv;
        LaneMax* lm = lanes ? &lanes[r] : nullptr;
        for (int64_t c = 0; c < ce; ++c) {
          const int64_t j = j0 + c;
          if (pass == 0)
            lm->feed(j, s[c]);
          else if (pass == 1)
            lm->inf_sum = lm->inf_sum || lm->inf_at(j, s[c]);
          else if (j >= w.lim[r] && (!model || !lm->inf_sum || lm->inf_at(j, s[c])))
            std::fill(dv.mrow(b, h, j), dv.mrow(b, h, j) + g.Dv, nan);
        }
      }
    }
    if (pass == 0)
      for (int64_t r = 0; r < bq; ++r)
        if (!(w.l[r] > 0.f) && w.lim[r] > 0) lanes[r].finish(after_band ? g.Sk : w.lim[r]);
    if (pass == 1 && !(after_band && skipped)) break;
  }
}

// D_i = sum_j P_ij dP_ij, as the unfused softmax's backward sums it, for the rows of a block
// where rowsum(dO * O) is not finite (`redo`): over the keys the row sees when the softmax
// reads lengths (the others are not in its sum), over every key otherwise (a key after the
// causal band has P = 0, and 0 * dP is NaN where dP is not finite).  rowsum(dO * O) differs
// from it there: O holds NaN where v is not finite among skipped keys (0 * inf), and dO * O
// may give inf where the products give NaN.
void redo_row_sums(const Params& p, const Geom& g, const MaskView& mk, const View& dout, int64_t n,
                   int64_t i0, int64_t bq, const std::vector<char>& redo, const LaneMax* lanes,
                   const float* inv, Scratch& w, float* dP, float* Di) {
  const int64_t b = n / g.H, h = n % g.H, Dv = g.Dv;
  const bool lengths = softmax_with_lengths(p);
  int64_t jend = 0;
  for (int64_t r = 0; r < bq; ++r)
    if (redo[r]) {
      Di[r] = 0.f;
      jend = std::max(jend, lengths ? w.lim[r] : g.Sk);
    }
  for (int64_t j0 = 0; j0 < jend; j0 += BK) {
    const int64_t nb = std::min(BK, jend - j0);
    float* S = w.S.data();
    score_tile(p, g, mk, n, i0, bq, j0, nb, S, w);
    probs_tile(w, inv, lanes, bq, j0, nb, S);
    sgemm('N', 'T', bq, nb, Dv, 1.f, dout.row(b, h, i0), dout.rs, g.v.row(b, h, j0), g.v.rs, 0.f,
          dP, BK);
    for (int64_t r = 0; r < bq; ++r) {
      if (!redo[r]) continue;
      const int64_t ce = lengths ? std::max<int64_t>(0, std::min(nb, w.lim[r] - j0)) : nb;
      float acc = 0.f;
      for (int64_t c = 0; c < ce; ++c) acc += S[r * BK + c] * dP[r * BK + c];
      Di[r] += acc;
    }
  }
}

// The unfused products run over every key of every row: a key a row skips (after its length
// or causal band; P = 0 and dS = 0 there) still turns a non-finite value of the other operand
// into NaN, 0 * inf and 0 * NaN being NaN: dQ_i[d] where k_j[d] is not finite, dK_j[d] where
// q_i[d] is, dV_j[c] where dO_i[c] is, for each key j the row i skips.  Under causal_mode add
// the skipped scores' gradient is P * (dP - D_i) = 0 * (dP - D_i): NaN for the whole skipped
// part of a row whose D_i is not finite (`dsnan`), so dQ_i and those keys' dK_j are NaN.  The
// tile loops cover the keys up to a block's last limit; this covers them all.
void skipped_keys(const Geom& g, int64_t n, const std::vector<int64_t>& lim,
                  const std::vector<char>& dsnan, const View& dout, const View& dq, const View& dk,
                  const View& dv) {
  const int64_t b = n / g.H, h = n % g.H, D = g.D, Dv = g.Dv, Sk = g.Sk;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int64_t> kbad(D, -1), qmin(D, Sk), omin(Dv, Sk);
  int64_t dsmin = Sk, first = Sk;
  for (int64_t j = 0; j < Sk; ++j) {
    const float* kr = g.k.row(b, h, j);
    if (!any_non_finite(kr, D)) continue;
    for (int64_t d = 0; d < D; ++d)
      if (!std::isfinite(kr[d])) kbad[d] = j;
  }
  for (int64_t i = 0; i < g.Sq; ++i) {
    const int64_t l = lim[i];
    if (l >= Sk) continue;
    float* dqr = dq.mrow(b, h, i);
    for (int64_t d = 0; d < D; ++d)
      if (dsnan[i] || kbad[d] >= l) dqr[d] = nan;
    const float* qr = g.q.row(b, h, i);
    if (any_non_finite(qr, D))
      for (int64_t d = 0; d < D; ++d)
        if (!std::isfinite(qr[d])) qmin[d] = std::min(qmin[d], l), first = std::min(first, l);
    const float* orow = dout.row(b, h, i);
    if (any_non_finite(orow, Dv))
      for (int64_t c = 0; c < Dv; ++c)
        if (!std::isfinite(orow[c])) omin[c] = std::min(omin[c], l), first = std::min(first, l);
    if (dsnan[i]) dsmin = std::min(dsmin, l), first = std::min(first, l);
  }
  for (int64_t j = first; j < Sk; ++j) {
    float* dkr = dk.mrow(b, h, j);
    for (int64_t d = 0; d < D; ++d)
      if (j >= dsmin || j >= qmin[d]) dkr[d] = nan;
    float* dvr = dv.mrow(b, h, j);
    for (int64_t c = 0; c < Dv; ++c)
      if (j >= omin[c]) dvr[c] = nan;
  }
}

}  // namespace

// Gradients through the softmax: P = exp(S - m) / l recomputed per tile (m, l from
// row_stats; dividing by l rather than subtracting log(l) keeps P exact when m is huge,
// as in a row whose scores are all -1e9), dP = dO V^T, dS = P * (dP - D_i) with
// D_i = rowsum(dO * O) (see redo_row_sums where that is not finite).
// dS is the gradient of the masked scores: an additive mask receives it summed over the
// axes it broadcasts along; where a boolean mask or the causal fill replaced a score, the
// score itself gets none (where() passes the gradient to the fill).  Non-finite values
// reach the gradients as through the unfused products (see probs_tile, skipped_keys).
void backward(const Params& p, const Geom& g, const MaskView& mk, const View& dout,
              const View& dq, const View& dk, const View& dv, float* dmask) {
  const int64_t N = g.B * g.H, D = g.D, Dv = g.Dv;
  if (N == 0 || g.Sq == 0) return;
  const Prep pr = prepare(p, g, mk, false);
  const bool at_scores = softmax_nan_at_scores(p, g);
  const bool lengths = softmax_with_lengths(p);
  const bool add_band = p.causal && p.causal_mode == CausalMode::add;
  // Heads whose mask slices coincide (a broadcast mask) accumulate into a per-thread copy
  // of the slice, added to dmask when the thread moves to another slice; others write
  // their own slice directly.
  bool shared = false;
  if (dmask) {
    std::vector<int64_t> offs = mk.noff;
    std::sort(offs.begin(), offs.end());
    shared = std::adjacent_find(offs.begin(), offs.end()) != offs.end();
  }
  const int64_t mrows = mk.sq ? g.Sq : 1, mcols = mk.sk ? g.Sk : 1;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::string err;
#pragma omp parallel
  {
    Scratch w(Dv);
    std::vector<float> dP(BQ * BK), Di(BQ), inv(BQ), slice;
    std::vector<char> redo(BQ), dsnan(g.Sq);
    std::vector<LaneMax> lanes(at_scores ? BQ : 0);
    std::vector<int64_t> lim(g.Sq);  // per row of the head: the keys it computes
    int64_t slice_off = -1;
    if (dmask && shared) slice.assign(mrows * mcols, 0.f);
    auto flush = [&]() {
      if (slice_off < 0) return;
#pragma omp critical(fused_attention_dmask)
      for (int64_t ii = 0; ii < mrows; ++ii)
        for (int64_t jj = 0; jj < mcols; ++jj)
          dmask[slice_off + ii * mk.sq + jj * mk.sk] += slice[ii * mcols + jj];
      std::fill(slice.begin(), slice.end(), 0.f);
      slice_off = -1;
    };
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      try {
        const int64_t b = n / g.H, h = n % g.H;
        float* acc = nullptr;  // this head's dmask slice (or the thread's copy of it)
        int64_t asq = 0, ask = 0;
        if (dmask && shared) {
          if (mk.noff[n] != slice_off) {
            flush();
            slice_off = mk.noff[n];
          }
          acc = slice.data();
          asq = mk.sq ? mcols : 0;
          ask = mk.sk ? 1 : 0;
        } else if (dmask) {
          acc = dmask + mk.noff[n];
          asq = mk.sq;
          ask = mk.sk;
        }
        bool skips = false;
        for (int64_t i0 = 0; i0 < g.Sq; i0 += BQ) {
          const int64_t bq = std::min(BQ, g.Sq - i0);
          row_stats(p, g, mk, pr, n, i0, bq, w);
          int64_t kmax = 0;
          bool any_redo = false, any_nan = false;
          for (int64_t r = 0; r < bq; ++r) {
            kmax = std::max(kmax, w.lim[r]);
            lim[i0 + r] = w.lim[r];
            skips = skips || w.lim[r] < g.Sk;
            const float* o = g.o.row(b, h, i0 + r);
            const float* d = dout.row(b, h, i0 + r);
            float s = 0.f;
            for (int64_t c = 0; c < Dv; ++c) s += o[c] * d[c];
            Di[r] = s;
            redo[r] = !std::isfinite(s) && w.lim[r] > 0;
            any_redo = any_redo || redo[r];
            // a row whose forward output is NaN (scores all -inf, or NaN) has NaN
            // probabilities (where: see probs_tile)
            inv[r] = w.l[r] > 0.f ? 1.f / w.l[r] : nan;
            any_nan = any_nan || (!(w.l[r] > 0.f) && w.lim[r] > 0);
          }
          const LaneMax* lm = at_scores && any_nan ? lanes.data() : nullptr;
          if (any_nan && !lengths) nan_rows(p, g, mk, n, i0, bq, w, at_scores ? lanes.data() : nullptr, dv);
          if (any_redo)
            redo_row_sums(p, g, mk, dout, n, i0, bq, redo, lm, inv.data(), w, dP.data(), Di.data());
          for (int64_t r = 0; r < bq; ++r)
            dsnan[i0 + r] = add_band && w.lim[r] < g.Sk && !std::isfinite(Di[r]);
          for (int64_t j0 = 0; j0 < kmax; j0 += BK) {
            const int64_t nb = std::min(BK, kmax - j0);
            float* S = w.S.data();
            score_tile(p, g, mk, n, i0, bq, j0, nb, S, w);
            probs_tile(w, inv.data(), lm, bq, j0, nb, S);
            // dV += P^T dO
            sgemm('T', 'N', nb, Dv, bq, 1.f, S, BK, dout.row(b, h, i0), dout.rs, 1.f,
                  dv.mrow(b, h, j0), dv.rs);
            // dP = dO V^T
            sgemm('N', 'T', bq, nb, Dv, 1.f, dout.row(b, h, i0), dout.rs, g.v.row(b, h, j0),
                  g.v.rs, 0.f, dP.data(), BK);
            const bool fill = p.causal && p.causal_mode == CausalMode::fill;
            for (int64_t r = 0; r < bq; ++r) {
              float* s = S + r * BK;
              const float* d = &dP[r * BK];
              const int64_t cl = std::max<int64_t>(0, std::min(nb, w.lim[r] - j0));
              for (int64_t c = 0; c < cl; ++c) s[c] = s[c] * (d[c] - Di[r]);
              if (acc) {
                float* ar = acc + (i0 + r) * asq + j0 * ask;
                for (int64_t c = 0; c < cl; ++c) ar[c * ask] += s[c];
              }
              if (mk.kind == MaskKind::boolean) {  // where(): no gradient through masked slots
                const float* mr = mk.base(n) + (i0 + r) * mk.sq + j0 * mk.sk;
                for (int64_t c = 0; c < cl; ++c) s[c] = mr[c * mk.sk] != 0.f ? s[c] : 0.f;
              }
              if (fill)  // scores after the band were replaced by the fill value
                for (int64_t c = std::max<int64_t>(0, w.band[r] - j0); c < cl; ++c) s[c] = 0.f;
            }
            sgemm('N', 'N', bq, D, nb, p.scale, S, BK, g.k.row(b, h, j0), g.k.rs, 1.f,
                  dq.mrow(b, h, i0), dq.rs);
            sgemm('T', 'N', nb, D, bq, p.scale, S, BK, g.q.row(b, h, i0), g.q.rs, 1.f,
                  dk.mrow(b, h, j0), dk.rs);
          }
        }
        if (skips) skipped_keys(g, n, lim, dsnan, dout, dq, dk, dv);
      } catch (const std::exception& e) {
#pragma omp critical
        err = e.what();
      }
    }
    if (!slice.empty()) flush();
  }
  if (!err.empty()) throw OpError(err);
}

}  // namespace attn
}  // namespace mxf
