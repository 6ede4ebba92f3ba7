// fused_attention CPU kernels: blockwise attention with an online softmax.
// Each OpenMP task owns one (batch*head, query block); the score tile never exceeds
// BQ x BK.  Forward tile products: AVX-512 register-blocked loops where the CPU has
// them (qk_tile / pv_tile), single-threaded dnnl_sgemm calls otherwise and in backward.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "attention_geom.h"
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

// Number of keys row `i` of head `n` may see: valid length and causal limit combined.
inline int64_t row_limit(const Params& p, const Geom& g, const MaskView& m, int64_t n, int64_t i) {
  int64_t kend = g.Sk;
  if (m.kind == MaskKind::valid_length)
    kend = std::max<int64_t>(0, std::min<int64_t>(g.Sk, m.lengths[n * g.Sq + i]));
  if (!p.causal) return kend;
  int64_t lim = i + (g.Sk - g.Sq) + 1;  // bottom-right aligned causal band
  return std::max<int64_t>(0, std::min(kend, lim));
}


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
};

// S[r, c] = scale * q_i . k_j, then mask; excluded columns (c >= lim[r]) untouched.
void score_tile(const Params& p, const Geom& g, const MaskView& m, int64_t b, int64_t h,
                int64_t i0, int64_t bq, int64_t j0, int64_t nb, float* S,
                const KT* kt = nullptr) {
#ifdef MXF_HAVE_AVX512_PATH
  if (kt && !kt->data.empty())
    qk_tile(g.q.row(b, h, i0), g.q.rs, kt->at(b * g.H + h, j0), g.D, bq, nb, p.scale, S, BK);
  else
#endif
    sgemm('N', 'T', bq, nb, g.D, p.scale, g.q.row(b, h, i0), g.q.rs, g.k.row(b, h, j0), g.k.rs,
          0.f, S, BK);
  if (m.kind == MaskKind::additive || m.kind == MaskKind::boolean) {
    const float* mb = m.base(b, h);
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
}

struct Scratch {
  std::vector<float> S, O, m, l;
  std::vector<int64_t> lim;
  std::vector<char> touched;
  Scratch(int64_t Dv) : S(BQ * BK), O(BQ * std::max<int64_t>(Dv, 1)), m(BQ), l(BQ),
                        lim(BQ), touched(BQ) {}
};

// Resets the running statistics of a query block; returns how many keys any row sees.
static int64_t init_rows(const Params& p, const Geom& g, const MaskView& mk, int64_t n, int64_t i0,
                         int64_t bq, Scratch& w) {
  int64_t kmax = 0;
  for (int64_t r = 0; r < bq; ++r) {
    w.lim[r] = row_limit(p, g, mk, n, i0 + r);
    w.m[r] = NEG_INF;
    w.l[r] = 0.f;
    w.touched[r] = w.lim[r] > 0;
    kmax = std::max(kmax, w.lim[r]);
  }
  return kmax;
}

// Online-softmax statistics (row max m, row sum l) over all keys, for one query block.
// Also used by backward.  touched[r] says whether row r saw at least one key.
void row_stats(const Params& p, const Geom& g, const MaskView& mk, int64_t n, int64_t i0,
               int64_t bq, Scratch& w) {
  const int64_t b = n / g.H, h = n % g.H;
  const int64_t kmax = init_rows(p, g, mk, n, i0, bq, w);
  for (int64_t j0 = 0; j0 < kmax; j0 += BK) {
    const int64_t nb = std::min(BK, kmax - j0);
    score_tile(p, g, mk, b, h, i0, bq, j0, nb, w.S.data());
    for (int64_t r = 0; r < bq; ++r) {
      const int64_t cl = std::min(nb, w.lim[r] - j0);
      if (cl <= 0) continue;
      const float* s = &w.S[r * BK];
      float mx = NEG_INF;
#pragma omp simd reduction(max : mx)
      for (int64_t c = 0; c < cl; ++c) mx = s[c] > mx ? s[c] : mx;
      const float mn = std::max(w.m[r], mx);
      if (mn == NEG_INF) continue;  // everything so far is -inf
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < cl; ++c) sum += fast_exp(s[c] - mn);
      w.l[r] = w.l[r] * fast_exp(w.m[r] - mn) + sum;
      w.m[r] = mn;
    }
  }
}

void forward_block(const Params& p, const Geom& g, const MaskView& mk, int64_t n, int64_t i0,
                   int64_t bq, Scratch& w, const KT& kt) {
  const int64_t b = n / g.H, h = n % g.H, Dv = g.Dv;
  const bool avx512 = cpu_has_avx512();  // the softmax loops in AVX-512 (vmath_avx512.h)
  const int64_t kmax = init_rows(p, g, mk, n, i0, bq, w);
  std::fill(w.O.begin(), w.O.begin() + bq * Dv, 0.f);
  for (int64_t j0 = 0; j0 < kmax; j0 += BK) {
    const int64_t nb = std::min(BK, kmax - j0);
    float* S = w.S.data();
    score_tile(p, g, mk, b, h, i0, bq, j0, nb, S, &kt);
    for (int64_t r = 0; r < bq; ++r) {
      float* s = S + r * BK;
      const int64_t cl = std::max<int64_t>(0, std::min(nb, w.lim[r] - j0));
      // The reductions are written for `omp simd` so that the loops vectorize (a plain float
      // sum may not be reordered, which keeps GCC from vectorizing the exp loop at all).
      float mx = NEG_INF;
      if (avx512) {
        mx = row_max_avx512(s, cl);
      } else {
#pragma omp simd reduction(max : mx)
        for (int64_t c = 0; c < cl; ++c) mx = s[c] > mx ? s[c] : mx;
      }
      const float mn = std::max(w.m[r], mx);
      if (mn == NEG_INF) {  // no finite score yet: contributes nothing
        std::fill(s, s + nb, 0.f);
        continue;
      }
      float sum = 0.f;
      if (avx512) {
        sum = exp_shift_sum_avx512(s, cl, mn);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < cl; ++c) s[c] = fast_exp(s[c] - mn);
#pragma omp simd reduction(+ : sum)
        for (int64_t c = 0; c < cl; ++c) sum += s[c];
      }
      for (int64_t c = cl; c < nb; ++c) s[c] = 0.f;
      const float alpha = fast_exp(w.m[r] - mn);
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = mn;
      if (alpha != 1.f) {
        float* o = &w.O[r * Dv];
        for (int64_t c = 0; c < Dv; ++c) o[c] *= alpha;
      }
    }
#ifdef MXF_HAVE_AVX512_PATH
    if (!kt.data.empty()) {
      pv_tile(S, BK, g.v.row(b, h, j0), g.v.rs, bq, nb, Dv, w.O.data(), Dv);
      continue;
    }
#endif
    sgemm('N', 'N', bq, Dv, nb, 1.f, S, BK, g.v.row(b, h, j0), g.v.rs, 1.f, w.O.data(), Dv);
  }
  for (int64_t r = 0; r < bq; ++r) {
    float* out = g.o.mrow(b, h, i0 + r);
    const float* o = &w.O[r * Dv];
    if (w.l[r] > 0.f) {
      const float inv = 1.f / w.l[r];
      for (int64_t c = 0; c < Dv; ++c) out[c] = o[c] * inv;
    } else {
      // untouched rows (valid_length 0, empty causal band) give 0 like MXNet's
      // softmax with length; rows whose scores are all -inf give NaN like softmax.
      const float fill = w.touched[r] ? std::numeric_limits<float>::quiet_NaN() : 0.f;
      for (int64_t c = 0; c < Dv; ++c) out[c] = fill;
    }
  }
}

}  // namespace

void forward(const Params& p, const Geom& g, const MaskView& m) {
  const int64_t nqb = (g.Sq + BQ - 1) / BQ, N = g.B * g.H, tasks = N * nqb;
  if (tasks == 0) return;
  KT kt;  // k transposed once per call, read by every query block
  if (cpu_has_avx512() && BK % 32 == 0 && g.Sk > 0 && g.D > 0) {
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
  std::string err;
#pragma omp parallel
  {
    Scratch w(g.Dv);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n = t / nqb, i0 = (t % nqb) * BQ;
      try {
        forward_block(p, g, m, n, i0, std::min(BQ, g.Sq - i0), w, kt);
      } catch (const std::exception& e) {
#pragma omp critical
        err = e.what();
      }
    }
  }
  if (!err.empty()) throw OpError(err);
}

void backward(const Params& p, const Geom& g, const MaskView& mk, const View& dout,
              const View& dq, const View& dk, const View& dv) {
  const int64_t N = g.B * g.H, D = g.D, Dv = g.Dv;
  std::string err;
#pragma omp parallel
  {
    Scratch w(Dv);
    std::vector<float> dP(BQ * BK), Di(BQ);
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < N; ++n) {
      try {
        const int64_t b = n / g.H, h = n % g.H;
        for (int64_t i0 = 0; i0 < g.Sq; i0 += BQ) {
          const int64_t bq = std::min(BQ, g.Sq - i0);
          row_stats(p, g, mk, n, i0, bq, w);
          int64_t kmax = 0;
          for (int64_t r = 0; r < bq; ++r) {
            kmax = std::max(kmax, w.lim[r]);
            const float* o = g.o.row(b, h, i0 + r);
            const float* d = dout.row(b, h, i0 + r);
            float s = 0.f;
            for (int64_t c = 0; c < Dv; ++c) s += o[c] * d[c];
            Di[r] = s;
            // lse; rows with no finite score contribute nothing
            w.m[r] = (w.l[r] > 0.f) ? w.m[r] + std::log(w.l[r]) : INFINITY;
          }
          for (int64_t j0 = 0; j0 < kmax; j0 += BK) {
            const int64_t nb = std::min(BK, kmax - j0);
            float* S = w.S.data();
            score_tile(p, g, mk, b, h, i0, bq, j0, nb, S);
            for (int64_t r = 0; r < bq; ++r) {
              float* s = S + r * BK;
              const int64_t cl = std::max<int64_t>(0, std::min(nb, w.lim[r] - j0));
              const float lse = w.m[r];
#pragma omp simd
              for (int64_t c = 0; c < cl; ++c) s[c] = fast_exp(s[c] - lse);
              for (int64_t c = cl; c < nb; ++c) s[c] = 0.f;
            }
            // dV += P^T dO
            sgemm('T', 'N', nb, Dv, bq, 1.f, S, BK, dout.row(b, h, i0), dout.rs, 1.f,
                  dv.mrow(b, h, j0), dv.rs);
            // dP = dO V^T
            sgemm('N', 'T', bq, nb, Dv, 1.f, dout.row(b, h, i0), dout.rs, g.v.row(b, h, j0),
                  g.v.rs, 0.f, dP.data(), BK);
            for (int64_t r = 0; r < bq; ++r) {
              float* s = S + r * BK;
              const float* d = &dP[r * BK];
              for (int64_t c = 0; c < nb; ++c) s[c] = s[c] * (d[c] - Di[r]);
              if (mk.kind == MaskKind::boolean) {  // where(): no gradient through masked slots
                const float* mr = mk.base(b, h) + (i0 + r) * mk.sq + j0 * mk.sk;
                for (int64_t c = 0; c < nb; ++c) s[c] = mr[c * mk.sk] != 0.f ? s[c] : 0.f;
              }
            }
            sgemm('N', 'N', bq, D, nb, p.scale, S, BK, g.k.row(b, h, j0), g.k.rs, 1.f,
                  dq.mrow(b, h, i0), dq.rs);
            sgemm('T', 'N', nb, D, bq, p.scale, S, BK, g.q.row(b, h, i0), g.q.rs, 1.f,
                  dk.mrow(b, h, j0), dk.rs);
          }
        }
      } catch (const std::exception& e) {
#pragma omp critical
        err = e.what();
      }
    }
  }
  if (!err.empty()) throw OpError(err);
}

}  // namespace attn
}  // namespace mxf
