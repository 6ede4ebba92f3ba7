// fused_attention: out = softmax(scale * q k^T + mask) v, for several head layouts.
// See README.md in this folder for the exact inputs, attributes and layouts.
#include <cmath>
#include <cstring>

#include "act.h"
#include "attention_geom.h"
#include "half.h"
#include "gpu_glue.h"  // the "gpu" implementations (a build with nvcc)

namespace mxf {
namespace attn {

Params parse(const Attrs& a) {
  Params p;
  const std::string lay = attr_choice(a, "layout", "plain",
                                      {"plain", "bshd", "packed_qkv", "interleaved",
                                       "interleaved_encdec"});
  p.layout = lay == "plain" ? Layout::plain
           : lay == "bshd" ? Layout::bshd
           : lay == "packed_qkv" ? Layout::packed_qkv
           : lay == "interleaved" ? Layout::interleaved : Layout::interleaved_encdec;
  const std::string mk = attr_choice(a, "mask_kind", "none",
                                     {"none", "additive", "boolean", "valid_length"});
  p.mask = mk == "none" ? MaskKind::none
         : mk == "additive" ? MaskKind::additive
         : mk == "boolean" ? MaskKind::boolean : MaskKind::valid_length;
  if (!has_attr(a, "scale")) throw OpError("attribute 'scale' is required");
  p.scale = attr_float(a, "scale", 1.f);
  p.causal = attr_bool(a, "causal", false);
  const std::string cm = attr_choice(a, "causal_mode", "exclude", {"exclude", "add", "fill"});
  p.causal_mode = cm == "exclude" ? CausalMode::exclude
                : cm == "add" ? CausalMode::add : CausalMode::fill;
  p.mask_value = attr_float(a, "mask_value", -1e18f);
  if (p.causal_mode != CausalMode::exclude) {
    if (!p.causal) throw OpError("causal_mode '" + cm + "' is only used with causal=True");
    if (p.mask != MaskKind::none)
      throw OpError("causal_mode '" + cm + "' takes no mask input (mask_kind must be none)");
    if (!has_attr(a, "mask_value"))
      throw OpError("causal_mode '" + cm + "' needs mask_value (the value " +
                    (cm == "add" ? "added to" : "used for") + " the scores after the band)");
  }
  p.nan_probs_row = attr_choice(a, "nan_probs", "auto", {"auto", "row"}) == "row";
  p.length_fill = attr_bool(a, "length_fill", false);
  if (p.length_fill) {
    if (p.mask != MaskKind::valid_length && p.mask != MaskKind::boolean)
      throw OpError("length_fill is only used with mask_kind='valid_length' or 'boolean'");
    if (p.mask == MaskKind::boolean && p.causal)
      throw OpError("length_fill with a boolean mask takes no causal band (mask it in the boolean mask)");
    if (p.causal && p.causal_mode != CausalMode::exclude)
      throw OpError("length_fill takes causal_mode 'exclude' (the keys after the band are filled too)");
    if (!has_attr(a, "mask_value") || !std::isfinite(p.mask_value))
      throw OpError("length_fill needs a finite mask_value (the score of the keys past the length)");
  }
  p.heads = attr_int(a, "heads", p.layout == Layout::plain ? 1 : 0);
  if (p.layout == Layout::plain) {
    if (p.heads != 1) throw OpError("attribute 'heads' is only used with head-aware layouts");
  } else if (p.heads <= 0) {
    throw OpError("layout '" + lay + "' needs a positive integer attribute 'heads'");
  }
  return p;
}

int num_data_inputs(Layout l) {
  switch (l) {
    case Layout::plain:
    case Layout::bshd: return 3;
    case Layout::interleaved_encdec: return 2;
    default: return 1;
  }
}

namespace {
void need_rank(const std::vector<int64_t>& s, size_t r, const char* what) {
  if (s.size() != r)
    throw OpError(std::string(what) + " must have rank " + std::to_string(r) + ", got shape " +
                  shape_str(s));
}
int64_t split_heads(int64_t width, int64_t parts, int64_t H, const char* what) {
  if (width % (parts * H) != 0)
    throw OpError(std::string(what) + ": last dimension " + std::to_string(width) +
                  " is not divisible by " + std::to_string(parts) + "*heads=" +
                  std::to_string(parts * H));
  return width / (parts * H);
}
}  // namespace

Geom geometry(const Params& p, const std::vector<std::vector<int64_t>>& s) {
  Geom g{};
  const int64_t H = p.heads;
  switch (p.layout) {
    case Layout::plain: {
      // (..., S, D) with any number of leading (batch) dims, as batch_dot / linalg_gemm2
      // take them; the last leading dim is H, the others flatten into B
      const size_t r = s[0].size();
      if (r < 2) throw OpError("q must have rank >= 2, got shape " + shape_str(s[0]));
      need_rank(s[1], r, "k");
      need_rank(s[2], r, "v");
      g.batch.assign(s[0].begin(), s[0].end() - 2);
      g.H = r >= 3 ? s[0][r - 3] : 1;
      g.B = 1;
      for (size_t i = 0; i + 3 < r; ++i) g.B *= s[0][i];
      g.Sq = s[0][r - 2]; g.D = s[0][r - 1]; g.Sk = s[1][r - 2]; g.Dv = s[2][r - 1];
      bool fits = s[1][r - 1] == g.D && s[2][r - 2] == g.Sk;
      for (size_t i = 0; i + 2 < r; ++i) fits = fits && s[1][i] == s[0][i] && s[2][i] == s[0][i];
      if (!fits)
        throw OpError("shapes do not fit q (..,Sq,D), k (..,Sk,D), v (..,Sk,Dv) with the same "
                      "leading dims: q" + shape_str(s[0]) + " k" + shape_str(s[1]) + " v" +
                      shape_str(s[2]));
      g.q = {nullptr, g.H * g.Sq * g.D, g.Sq * g.D, g.D};
      g.k = {nullptr, g.H * g.Sk * g.D, g.Sk * g.D, g.D};
      g.v = {nullptr, g.H * g.Sk * g.Dv, g.Sk * g.Dv, g.Dv};
      g.o = {nullptr, g.H * g.Sq * g.Dv, g.Sq * g.Dv, g.Dv};
      break;
    }
    case Layout::bshd: {
      need_rank(s[0], 3, "q");
      need_rank(s[1], 3, "k");
      need_rank(s[2], 3, "v");
      g.B = s[0][0]; g.H = H; g.Sq = s[0][1]; g.Sk = s[1][1];
      g.D = split_heads(s[0][2], 1, H, "q");
      g.Dv = split_heads(s[2][2], 1, H, "v");
      if (s[1][0] != g.B || s[2][0] != g.B || s[1][2] != s[0][2] || s[2][1] != g.Sk)
        throw OpError("shapes do not fit bshd q (B,Sq,H*D), k (B,Sk,H*D), v (B,Sk,H*Dv): q" +
                      shape_str(s[0]) + " k" + shape_str(s[1]) + " v" + shape_str(s[2]));
      const int64_t HD = H * g.D, HDv = H * g.Dv;
      g.q = {nullptr, g.Sq * HD, g.D, HD};
      g.k = {nullptr, g.Sk * HD, g.D, HD};
      g.v = {nullptr, g.Sk * HDv, g.Dv, HDv};
      g.o = {nullptr, g.Sq * HDv, g.Dv, HDv};
      break;
    }
    case Layout::packed_qkv: {
      need_rank(s[0], 3, "qkv");
      g.B = s[0][0]; g.H = H; g.Sq = g.Sk = s[0][1];
      g.D = g.Dv = split_heads(s[0][2], 3, H, "qkv");
      const int64_t W = s[0][2], HD = H * g.D;
      g.q = {nullptr, g.Sq * W, g.D, W};
      g.k = g.q; g.v = g.q;  // offsets are added in bind_views()
      g.o = {nullptr, g.Sq * HD, g.D, HD};
      break;
    }
    case Layout::interleaved: {
      need_rank(s[0], 3, "qkv");
      g.Sq = g.Sk = s[0][0]; g.B = s[0][1]; g.H = H;
      g.D = g.Dv = split_heads(s[0][2], 3, H, "qkv");
      const int64_t W = s[0][2], HD = H * g.D;
      g.q = {nullptr, W, 3 * g.D, g.B * W};
      g.k = g.q; g.v = g.q;
      g.o = {nullptr, HD, g.D, g.B * HD};
      break;
    }
    case Layout::interleaved_encdec: {
      need_rank(s[0], 3, "q");
      need_rank(s[1], 3, "kv");
      g.Sq = s[0][0]; g.B = s[0][1]; g.Sk = s[1][0]; g.H = H;
      g.D = g.Dv = split_heads(s[0][2], 1, H, "q");
      if (s[1][1] != g.B || s[1][2] != 2 * s[0][2])
        throw OpError("shapes do not fit interleaved_encdec q (Sq,B,H*D), kv (Sk,B,H*2*D): q" +
                      shape_str(s[0]) + " kv" + shape_str(s[1]));
      const int64_t HD = H * g.D;
      g.q = {nullptr, HD, g.D, g.B * HD};
      g.k = {nullptr, 2 * HD, 2 * g.D, g.B * 2 * HD};
      g.v = g.k;
      g.o = g.q;
      break;
    }
  }
  if (g.D <= 0 || g.Dv <= 0) throw OpError("head dimension must be positive");
  return g;
}

std::vector<int64_t> out_shape(const Params& p, const Geom& g,
                               const std::vector<std::vector<int64_t>>& s) {
  switch (p.layout) {
    case Layout::plain: {
      std::vector<int64_t> o = g.batch;
      o.push_back(g.Sq);
      o.push_back(g.Dv);
      return o;
    }
    case Layout::bshd:
    case Layout::packed_qkv: return {g.B, g.Sq, g.H * g.Dv};
    default: return {g.Sq, g.B, g.H * g.Dv};
  }
}

namespace {
// q, k, v base pointers of the data inputs d for the layout (element offsets)
template <typename T>
void bind_qkv(const Params& p, const Geom& g, const std::vector<T*>& d, T** q, T** k, T** v) {
  switch (p.layout) {
    case Layout::plain:
    case Layout::bshd:
      *q = d[0]; *k = d[1]; *v = d[2];
      break;
    case Layout::packed_qkv:
      *q = d[0]; *k = d[0] + g.H * g.D; *v = d[0] + 2 * g.H * g.D;
      break;
    case Layout::interleaved:
      *q = d[0]; *k = d[0] + g.D; *v = d[0] + 2 * g.D;
      break;
    case Layout::interleaved_encdec:
      *q = d[0]; *k = d[1]; *v = d[1] + g.D;
      break;
  }
}
}  // namespace

void bind_views(const Params& p, Geom* g, const std::vector<float*>& d, float* out) {
  g->o.p = out;
  bind_qkv(p, *g, d, &g->q.p, &g->k.p, &g->v.p);
}

void bind_views_bf16(const Params& p, Geom* g, const std::vector<const uint16_t*>& d) {
  const uint16_t *q = nullptr, *k = nullptr, *v = nullptr;
  bind_qkv(p, *g, d, &q, &k, &v);
  g->qh = {q, g->q.bs, g->q.hs, g->q.rs};
  g->kh = {k, g->k.bs, g->k.hs, g->k.rs};
  g->vh = {v, g->v.bs, g->v.hs, g->v.rs};
  g->q.p = g->k.p = g->v.p = nullptr;
}

std::vector<int64_t> scores_batch(const Params& p, const Geom& g, size_t mask_rank) {
  if (p.layout == Layout::plain) return g.batch;
  if (mask_rank == 4) return {g.B, g.H};
  return {g.B * g.H};
}

namespace {
// valid_length: row n*Sq + i of the lengths reads element src(n, i) of the input, or the
// shape is not one of the accepted ones (-1).
struct LengthIndex {
  enum { scores, heads, batch } per = scores;  // (.., Sq) over the scores' leading dims
  bool per_row = true;
};
bool length_shape(const Params& p, const Geom& g, const std::vector<int64_t>& ms,
                  LengthIndex* li) {
  const int64_t N = g.B * g.H;
  // the scores' shape without its last axis, as softmax(use_length=True) takes it
  for (size_t rank : {size_t(0), size_t(4)}) {
    if (rank == 4 && p.layout == Layout::plain) break;
    std::vector<int64_t> want = scores_batch(p, g, rank);
    want.push_back(g.Sq);
    if (ms == want) {
      li->per = LengthIndex::scores;
      li->per_row = true;
      return true;
    }
  }
  // one length per head or per batch element, for every row or per row
  if (ms.size() == 1 || (ms.size() == 2 && ms[1] == g.Sq)) {
    li->per_row = ms.size() == 2;
    if (ms[0] == N) { li->per = LengthIndex::heads; return true; }
    if (ms[0] == g.B) { li->per = LengthIndex::batch; return true; }
  }
  return false;
}
}  // namespace

bool softmax_with_lengths(const Params& p) {
  // length_fill: the unfused graph's softmax is a plain one (the keys past the length filled)
  if (p.length_fill) return false;
  return p.mask == MaskKind::valid_length || (p.causal && p.causal_mode == CausalMode::exclude);
}

bool softmax_nan_at_scores(const Params& p, const Geom& g) {
  // MXNet's SupportMKLDNNSoftmax: float32, the last axis, rank 1 to 4, no temperature; lengths
  // always go through MXNet's own kernel.  The head-aware layouts' scores have rank 3 or 4.
  if (p.nan_probs_row || softmax_with_lengths(p)) return false;
  if (p.layout == Layout::plain && g.batch.size() + 2 > 4) return false;
  return dnnl_enabled();
}

void check_mask_shape(const Params& p, const Geom& g, const std::vector<int64_t>& ms) {
  const int64_t N = g.B * g.H;
  if (p.mask == MaskKind::valid_length) {
    LengthIndex li;
    if (!length_shape(p, g, ms, &li)) {
      std::vector<int64_t> want = scores_batch(p, g, 0);
      want.push_back(g.Sq);
      throw OpError("valid_length must have the scores' shape without its last axis " +
                    shape_str(want) + ", or (N,) / (N,Sq) with N = batch*heads = " +
                    std::to_string(N) + " or N = batch = " + std::to_string(g.B) +
                    "; got " + shape_str(ms));
    }
    return;
  }
  std::vector<int64_t> tgt = scores_batch(p, g, ms.size());
  tgt.push_back(g.Sq);
  tgt.push_back(g.Sk);
  bool ok = ms.size() >= 1 && ms.size() <= tgt.size();
  for (size_t i = 0; ok && i < ms.size(); ++i) {
    const int64_t d = ms[ms.size() - 1 - i], t = tgt[tgt.size() - 1 - i];
    ok = d == 1 || d == t;
  }
  if (!ok) {
    std::string msg = "mask of shape " + shape_str(ms) + " does not broadcast to the scores " +
                      shape_str(tgt);
    if (p.layout != Layout::plain)
      msg += " (batch*heads,Sq,Sk), nor as rank 4 to " +
             shape_str(std::vector<int64_t>{g.B, g.H, g.Sq, g.Sk}) + " (B,H,Sq,Sk)";
    throw OpError(msg);
  }
}

MaskView mask_view(const Params& p, const Geom& g, const MXTensor* mask) {
  MaskView m;
  m.kind = p.mask;
  if (p.mask == MaskKind::none) return m;
  check_mask_shape(p, g, mask->shape);
  const auto& ms = mask->shape;
  const int64_t N = g.B * g.H;
  if (p.mask == MaskKind::valid_length) {
    LengthIndex li;
    length_shape(p, g, ms, &li);
    m.lengths.resize(N * g.Sq);
    for (int64_t i = 0; i < N * g.Sq; ++i) {
      const int64_t n = i / g.Sq, row = i % g.Sq;
      const int64_t nn = li.per == LengthIndex::batch ? n / g.H : n;
      const int64_t src = li.per_row ? nn * g.Sq + row : nn;
      switch (mask->dtype) {
        case mxnet::ext::kFloat32: m.lengths[i] = (int64_t)static_cast<const float*>(mask->data_ptr)[src]; break;
        case mxnet::ext::kFloat64: m.lengths[i] = (int64_t)static_cast<const double*>(mask->data_ptr)[src]; break;
        case mxnet::ext::kFloat16:
          m.lengths[i] = (int64_t)half_to_float(static_cast<const uint16_t*>(mask->data_ptr)[src]);
          break;
        case mxnet::ext::kInt32: m.lengths[i] = static_cast<const int32_t*>(mask->data_ptr)[src]; break;
        case mxnet::ext::kInt64: m.lengths[i] = static_cast<const int64_t*>(mask->data_ptr)[src]; break;
        case mxnet::ext::kUint8: m.lengths[i] = static_cast<const uint8_t*>(mask->data_ptr)[src]; break;
        default: throw OpError("valid_length must be float32/float16/float64/int32/int64/uint8");
      }
    }
    return m;
  }
  require_f32(*mask, "mask");
  m.p = static_cast<const float*>(mask->data_ptr);
  // contiguous strides of the mask, zeroed where it broadcasts; aligned from the right
  // with the scores (batch..., Sq, Sk) as MXNet's broadcasting aligns them
  const size_t r = ms.size();
  std::vector<int64_t> st(r);
  int64_t acc = 1;
  for (size_t i = r; i-- > 0;) { st[i] = ms[i] == 1 ? 0 : acc; acc *= ms[i]; }
  auto dim_stride = [&](size_t from_end) -> int64_t {
    return from_end < r ? st[r - 1 - from_end] : 0;
  };
  m.sk = dim_stride(0);
  m.sq = dim_stride(1);
  const std::vector<int64_t> sb = scores_batch(p, g, r);
  m.noff.assign(N, 0);
  for (int64_t n = 0; n < N; ++n) {
    int64_t rest = n, off = 0;
    for (size_t d = 0; d < sb.size(); ++d) {  // innermost scores dim first
      const size_t from_end = 2 + d;
      const int64_t size = sb[sb.size() - 1 - d];
      off += (rest % size) * dim_stride(from_end);
      rest /= size;
    }
    m.noff[n] = off;
  }
  return m;
}

}  // namespace attn
}  // namespace mxf

using namespace mxf;
using namespace mxf::attn;

namespace mxf {
namespace attn {
// attention_cpu.cc: forward() with q·kᵀ and p·v in bfloat16 (float32 accumulation) where the
// CPU has avx512_bf16 -- attribute precision="bfloat16", CPU only, inference (the backward
// computes in float32)
void forward_reduced(const Params& p, const Geom& g, const MaskView& m, bool bf16_products);
}  // namespace attn
}  // namespace mxf

namespace {

std::vector<std::vector<int64_t>> to64(const std::vector<Shape>& s, size_t n) {
  std::vector<std::vector<int64_t>> r;
  for (size_t i = 0; i < n; ++i) r.emplace_back(s[i].begin(), s[i].end());
  return r;
}

// precision="bfloat16": the two products in bfloat16 (fuse(..., precision="bf16")); "tf32": the GPU's
// fp32 products may run on TF32 tensor cores (the CPU computes float32 as for "float32")
bool reduced_products(const Attrs& a) {
  return attr_choice(a, "precision", "float32", {"float32", "bfloat16", "tf32"}) == "bfloat16";
}

constexpr int kBfloat16 = kBF16;

// out_dtype: float32 / float16 / bfloat16, or -1 (unset: the data inputs' dtype where it is float16,
// else float32).  "bfloat16" is the float32 result written rounded to nearest even (for readers
// that round it to bfloat16 anyway) and needs precision="bfloat16", as do bfloat16 data inputs.
int out_dtype_attr(const Attrs& a) {
  const int out = attr_dtype(a, "out_dtype", {kF32, kBF16, kF16});
  if (out == kBF16 && !reduced_products(a)) throw OpError("out_dtype='bfloat16' needs precision='bfloat16'");
  return out;
}
bool bf16_output(const Attrs& a) { return out_dtype_attr(a) == kBF16; }

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_attention", [&] {
    out_dtype_attr(a);
    Params p = parse(a);
    *nin = num_data_inputs(p.layout) + (p.mask == MaskKind::none ? 0 : 1);
    *nout = 1;
  });
}

// float16 (AMP's GPU graphs): every data input float16, the mask float16 or float32; the output
// float16, or float32 where AMP's graph had it so (its softmax runs in float32, and so does the
// product with v that reads it).  The CPU computes in float32 on widened copies and rounds once.
MXReturnValue infer_type(const Attrs& a, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_attention", [&] {
    Params p = parse(a);
    const int nd = num_data_inputs(p.layout);
    const int dt = (*in)[0];
    if (dt != kF32 && dt != kBF16 && dt != kF16)
      throw OpError("input 0 must be float32, float16 or bfloat16, got " + dtype_name(dt));
    for (int i = 0; i < nd; ++i)
      if ((*in)[i] != dt)
        throw OpError("the data inputs must have one dtype (float32, float16, or bfloat16 with "
                      "precision='bfloat16'): input 0 is " + dtype_name(dt) + ", input " + std::to_string(i) +
                      " " + dtype_name((*in)[i]));
    if (dt == kBF16 && !reduced_products(a))
      throw OpError("bfloat16 data inputs need precision='bfloat16'");
    if (p.mask == MaskKind::additive || p.mask == MaskKind::boolean)
      if ((*in)[nd] != kF32 && (*in)[nd] != kF16)
        throw OpError("additive/boolean mask must be float32 or float16 (0/1 values for boolean), got " +
                      dtype_name((*in)[nd]));
    const int o = out_dtype_attr(a);
    (*out)[0] = o >= 0 ? o : dt == kF16 ? kF16 : kF32;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_attention", [&] {
    Params p = parse(a);
    const int nd = num_data_inputs(p.layout);
    require_known_shapes(*in);
    auto s = to64(*in, in->size());
    Geom g = geometry(p, s);
    if (p.mask != MaskKind::none) check_mask_shape(p, g, s[nd]);
    auto o = out_shape(p, g, s);
    (*out)[0] = Shape(o.begin(), o.end());
  });
}

size_t dtype_bytes(int dt) {
  switch (dt) {
    case mxnet::ext::kFloat64:
    case mxnet::ext::kInt64: return 8;
    case mxnet::ext::kFloat16: return 2;
    case mxnet::ext::kUint8:
    case mxnet::ext::kInt8: return 1;
    default: return 4;
  }
}

std::vector<float*> data_ptrs(std::vector<MXTensor>& t, int nd) {
  std::vector<float*> d;
  for (int i = 0; i < nd; ++i) {
    require_f32(t[i], "attention input");
    d.push_back(t[i].data<float>());
  }
  return d;
}

void forward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out);

MXReturnValue forward_cpu(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                          const OpResource&) {
  return guarded("fused_attention", [&] {
    if (!any_f16(*in, *out)) return forward_f32(a, in, out);
    Float32Call c(*in, *out);
    forward_f32(a, &c.in, &c.out);
    c.finish();
  });
}

// The forward pass on float32 and bfloat16 tensors.
void forward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
  {
    Params p = parse(a);
    const int nd = num_data_inputs(p.layout);
    std::vector<std::vector<int64_t>> s;
    for (int i = 0; i < nd; ++i) s.push_back((*in)[i].shape);
    Geom g = geometry(p, s);
    MaskView m = mask_view(p, g, p.mask == MaskKind::none ? nullptr : &(*in)[nd]);
    const bool bf16_in = (*in)[0].dtype == kBfloat16, bf16_out = bf16_output(a);
    if (bf16_in || bf16_out) {
      if ((*out)[0].dtype != (bf16_out ? kBfloat16 : mxnet::ext::kFloat32))
        throw OpError("output dtype does not match out_dtype");
      if (bf16_in) {
        std::vector<const uint16_t*> d;
        for (int i = 0; i < nd; ++i) {
          if ((*in)[i].dtype != kBfloat16) throw OpError("data inputs must all be bfloat16 or all float32");
          d.push_back(static_cast<const uint16_t*>((*in)[i].data_ptr));
        }
        bind_views_bf16(p, &g, d);
      } else {
        bind_views(p, &g, data_ptrs(*in, nd), nullptr);
      }
      g.o.p = bf16_out ? nullptr : (*out)[0].data<float>();  // a bfloat16 one: through a buffer
      forward_bf16_io(p, g, m, reduced_products(a), bf16_in,
                      bf16_out ? static_cast<uint16_t*>((*out)[0].data_ptr) : nullptr);
      return;
    }
    bind_views(p, &g, data_ptrs(*in, nd), (*out)[0].data<float>());
    forward_reduced(p, g, m, reduced_products(a));
  }
}

// Backward inputs: [d_out, <forward inputs>, out]; outputs: grads of the forward inputs.
void backward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out);

MXReturnValue backward_cpu(const Attrs& a, std::vector<MXTensor>* in,
                           std::vector<MXTensor>* out, const OpResource&) {
  return guarded("fused_attention backward", [&] {
    if (!any_f16(*in, *out)) return backward_f32(a, in, out);
    Float32Call c(*in, *out);
    backward_f32(a, &c.in, &c.out);
    c.finish();
  });
}

void backward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
  {
    Params p = parse(a);
    const int nd = num_data_inputs(p.layout);
    const bool has_mask = p.mask != MaskKind::none;
    if (bf16_output(a) || (*in)[1].dtype == kBfloat16)
      throw OpError("bfloat16 inputs or output have no backward (reduced precision is for inference)");
    if (p.length_fill) throw OpError("length_fill has no backward (it is for inference)");
    std::vector<std::vector<int64_t>> s;
    for (int i = 0; i < nd; ++i) s.push_back((*in)[1 + i].shape);
    Geom g = geometry(p, s);
    std::vector<float*> d;
    for (int i = 0; i < nd; ++i) d.push_back((*in)[1 + i].data<float>());
    const int out_idx = 1 + nd + (has_mask ? 1 : 0);
    bind_views(p, &g, d, (*in)[out_idx].data<float>());
    MaskView m = mask_view(p, g, has_mask ? &(*in)[1 + nd] : nullptr);
    for (auto& t : *out) std::memset(t.data_ptr, 0, t.size() * dtype_bytes(t.dtype));
    View dout = g.o;
    dout.p = (*in)[0].data<float>();
    std::vector<float*> gd;
    for (int i = 0; i < nd; ++i) gd.push_back((*out)[i].data<float>());
    Geom gg = g;
    bind_views(p, &gg, gd, nullptr);
    // an additive mask gets dScores summed over the axes it was broadcast along (what
    // MXNet's broadcast_add gives it); boolean masks and lengths get zeros, as where()
    // and softmax(use_length=True) give their condition and length inputs
    float* dmask = p.mask == MaskKind::additive ? (*out)[nd].data<float>() : nullptr;
    backward(p, g, m, dout, gg.q, gg.k, gg.v, dmask);
  }
}

}  // namespace

REGISTER_OP(fused_attention)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setForward(forward_cpu, "cpu")
    .setBackward(backward_cpu, "cpu")
#if MXF_WITH_CUDA
    .setForward(mxf::gpu::attention_forward, "gpu")
    .setBackward(mxf::gpu::attention_backward, "gpu")
#endif
    ;
