// fused_elemwise: one pass over N broadcast inputs evaluating an expression program.
//
// attrs: expr (required, see README.md), num_args (optional; default max input index+1)
// The output has the NumPy broadcast shape of all inputs.  The program is parsed at
// bind time (parse_attrs) so a bad expression fails when the symbol is created.
// CPU: OpenMP over blocks of kBlock output elements; each instruction is a vector loop
// over the block; inputs with the output's shape are read in place, broadcast inputs
// are gathered run by run along the innermost dimension.
// Backward: reverse mode over the same bytecode, block by block; gradients of
// broadcast inputs are reduced through per-thread accumulators.
// bfloat16 (inference): any input may be bfloat16 -- widened to float32 a block at a time
// (a broadcast one once, whole), the program runs in float32.  float16 (AMP's GPU graphs): any
// input, the output and, in the backward pass, the gradients may be float16 -- the call runs
// in float32 on widened copies and its results are rounded once (half.h; correct, not fast).
// The output's dtype is the inputs' when they all have one, float32 otherwise (the widest), or
// the attribute out_dtype (float32 / float16 / bfloat16) where the graph had another.
#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "dnnl_matmul.h"  // to_bf16 / from_bf16
#include "elemwise_avx512.h"
#include "elemwise_eval.h"
#include "half.h"
#include "mxf_common.h"
#include "gpu_glue.h"  // the "gpu" implementations (a build with nvcc)

using namespace mxf;
using namespace mxf::expr;

namespace {

const Program& program_for(const Attrs& a) {
  // Programs are cached by text: parse once, reuse on every call.
  static std::mutex mu;
  static std::map<std::pair<std::string, int64_t>, std::unique_ptr<Program>> cache;
  if (!has_attr(a, "expr")) throw OpError("attribute 'expr' is required");
  const std::string text = attr_str(a, "expr", "");
  const int64_t n = attr_int(a, "num_args", -1);
  if (has_attr(a, "num_args") && n < 1) throw OpError("num_args must be >= 1");
  std::lock_guard<std::mutex> lk(mu);
  auto key = std::make_pair(text, n);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  try {
    auto p = std::make_unique<Program>(compile(text, static_cast<int>(n)));
    return *cache.emplace(key, std::move(p)).first->second;
  } catch (const ExprError& e) {
    throw OpError(e.what());
  }
}

std::vector<int64_t> broadcast_shape(const std::vector<std::vector<int64_t>>& shapes) {
  size_t r = 0;
  for (auto& s : shapes) r = std::max(r, s.size());
  std::vector<int64_t> out(r, 1);
  for (size_t k = 0; k < shapes.size(); ++k) {
    const auto& s = shapes[k];
    for (size_t i = 0; i < s.size(); ++i) {
      int64_t& o = out[r - s.size() + i];
      if (s[i] == o || s[i] == 1) continue;
      if (o == 1) { o = s[i]; continue; }
      std::string all;
      for (auto& t : shapes) all += shape_str(t) + " ";
      throw OpError("inputs do not broadcast together: " + all);
    }
  }
  return out;
}

// Reads/writes an input that broadcasts against the output, for a range of output
// elements, walking runs along the innermost dimension.
struct BView {
  std::vector<int64_t> oshape, stride;  // stride in input elements per output dim (0 = bcast)
  bool full;                            // same shape as output: plain offset
  BView(const std::vector<int64_t>& os, const std::vector<int64_t>& is) : oshape(os) {
    const size_t r = os.size();
    stride.assign(r, 0);
    int64_t acc = 1;
    for (size_t i = r; i-- > 0;) {
      const size_t j = i + is.size();  // index in is, offset by r
      if (j >= r) {
        const int64_t d = is[j - r];
        stride[i] = d == 1 ? 0 : acc;
        acc *= d;
      }
    }
    full = numel(os) == numel(is);
  }
  template <class F>
  void runs(int64_t start, int64_t n, F&& f) const {  // f(out_off, in_off, len, in_step)
    const size_t r = oshape.size();
    if (r == 0) { f(0, 0, n, 0); return; }
    std::vector<int64_t> idx(r);
    int64_t rem = start, in_off = 0;
    for (size_t i = r; i-- > 0;) {
      idx[i] = rem % oshape[i];
      rem /= oshape[i];
      in_off += idx[i] * stride[i];
    }
    int64_t done = 0;
    const int64_t last = oshape[r - 1];
    while (done < n) {
      const int64_t len = std::min(n - done, last - idx[r - 1]);
      f(done, in_off, len, stride[r - 1]);
      done += len;
      in_off += len * stride[r - 1];
      idx[r - 1] += len;
      for (size_t i = r - 1; i > 0 && idx[i] == oshape[i]; --i) {
        in_off -= idx[i] * stride[i];
        idx[i] = 0;
        ++idx[i - 1];
        in_off += stride[i - 1];
      }
    }
  }
  void gather(const float* src, int64_t start, int64_t n, float* dst) const {
    runs(start, n, [&](int64_t o, int64_t i, int64_t len, int64_t st) {
      if (st == 1) std::memcpy(dst + o, src + i, len * sizeof(float));
      else if (st == 0) std::fill(dst + o, dst + o + len, src[i]);
      else for (int64_t k = 0; k < len; ++k) dst[o + k] = src[i + k * st];
    });
  }
  void scatter_add(const float* g, int64_t start, int64_t n, float* acc) const {
    runs(start, n, [&](int64_t o, int64_t i, int64_t len, int64_t st) {
      if (st == 0) {
        float s = 0.f;
        for (int64_t k = 0; k < len; ++k) s += g[o + k];
        acc[i] += s;
      } else {
        for (int64_t k = 0; k < len; ++k) acc[i + k * st] += g[o + k];
      }
    });
  }
};

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_elemwise", [&] {
    const Program& p = program_for(a);
    attr_dtype(a, "out_dtype", {kF32, kF16, kBF16});
    *nin = p.num_inputs;
    *nout = 1;
  });
}

constexpr int kBfloat16 = kBF16;

// The output's dtype: out_dtype, else the inputs' one dtype, else float32.
int output_dtype(const Attrs& a, const std::vector<int>& in) {
  const int o = attr_dtype(a, "out_dtype", {kF32, kF16, kBF16});
  if (o >= 0) return o;
  for (int t : in)
    if (t != in.front()) return kF32;
  return in.empty() ? kF32 : in.front();
}

MXReturnValue infer_type(const Attrs& a, std::vector<int>* in, std::vector<int>* out) {
  return guarded("fused_elemwise", [&] {
    for (size_t i = 0; i < in->size(); ++i) {
      const int t = (*in)[i];
      if (t != kF32 && t != kF16 && t != kBF16)
        throw OpError("input x" + std::to_string(i) + " must be float32, float16 or bfloat16, got " +
                      dtype_name(t));
    }
    (*out)[0] = output_dtype(a, *in);
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_elemwise", [&] {
    require_known_shapes(*in);
    std::vector<std::vector<int64_t>> s;
    for (auto& x : *in) s.emplace_back(x.begin(), x.end());
    auto o = broadcast_shape(s);
    (*out)[0] = Shape(o.begin(), o.end());
  });
}

struct Bound {
  const Program* prog;
  std::vector<int64_t> oshape;
  int64_t total;
  std::vector<BView> views;
  std::vector<const float*> data;
  // bfloat16 inputs read in place (full views), widened per block; null for the others.  A
  // broadcast bfloat16 input is widened once into `widened` and read from `data`.
  std::vector<const uint16_t*> half;
  std::vector<std::vector<float>> widened;
  // The program's `code` and forward plan with resolve() applied: each value's rank (its
  // inputs' largest, as MXNet's ops give it) decides the ops MXNet runs through oneDNN.
  std::vector<Instr> code, fwd;
  bool avx512 = cpu_has_avx512();
};

Bound bind_inputs(const Attrs& a, std::vector<MXTensor>& in, size_t first) {
  static const bool dnnl = mxnet_dnnl_enabled();
  Bound b;
  b.prog = &program_for(a);
  std::vector<std::vector<int64_t>> s;
  for (int i = 0; i < b.prog->num_inputs; ++i) {
    s.push_back(in[first + i].shape);
    if (in[first + i].dtype == kBfloat16) {
      b.data.push_back(nullptr);
      b.half.push_back(static_cast<const uint16_t*>(in[first + i].data_ptr));
    } else {
      require_f32(in[first + i], "fused_elemwise input");
      b.data.push_back(in[first + i].data<float>());
      b.half.push_back(nullptr);
    }
  }
  b.oshape = broadcast_shape(s);
  b.total = numel(b.oshape);
  for (auto& x : s) b.views.emplace_back(b.oshape, x);
  b.widened.resize(s.size());
  for (size_t k = 0; k < s.size(); ++k)
    if (b.half[k] && !b.views[k].full) {
      b.widened[k].resize(numel(s[k]));
      from_bf16(b.half[k], b.widened[k].data(), numel(s[k]));
      b.data[k] = b.widened[k].data();
      b.half[k] = nullptr;
    }
  b.code = b.prog->code;
  b.fwd = b.prog->fwd;
  std::vector<int> rank(b.code.size(), 0);
  for (size_t i = 0; i < b.code.size(); ++i) {
    const Instr& c = b.code[i];
    if (c.op == LOAD) rank[i] = static_cast<int>(s[c.input].size());
    for (int k : {c.a, c.b, c.c})
      if (k >= 0) rank[i] = std::max(rank[i], rank[k]);
    b.code[i].op = resolve(c.op, rank[i], dnnl);
    b.fwd[i].op = resolve(b.fwd[i].op, rank[i], dnnl);
  }
  return b;
}

// Evaluates instructions [0, code.size()) for one block; vals[i] points at value i.
// `result` (optional) receives the last instruction's value directly.  `slot` maps a
// value to its scratch buffer: the forward pass passes the program's reuse plan (a
// few buffers stay in L1), the backward pass null (every value keeps its own buffer,
// since the adjoints read them all).
void eval_block(const Bound& b, int64_t start, int64_t n, float* scratch,
                std::vector<const float*>& vals, float* result = nullptr,
                const int* slot = nullptr) {
  const auto& code = slot ? b.fwd : b.code;
  for (size_t i = 0; i < code.size(); ++i) {
    const Instr& in = code[i];
    const int64_t si = slot ? slot[i] : static_cast<int64_t>(i);
    if (si < 0) continue;  // dead value
    float* o = (result && i + 1 == code.size()) ? result : scratch + si * kSlot;
    switch (in.op) {
      case LOAD:
        if (b.half[in.input]) {  // a bfloat16 input of the output's shape
          from_bf16(b.half[in.input] + start, o, n);
          vals[i] = o;
        } else if (b.views[in.input].full) {
          vals[i] = b.data[in.input] + start;
        } else {
          b.views[in.input].gather(b.data[in.input], start, n, o);
          vals[i] = o;
        }
        continue;
      case CONST:
        vals[i] = scratch + si * kSlot;  // filled once per thread (see fill_consts)
        continue;
      default:
        if (arity(in.op) == 3) {
          eval_ternary(in.op, vals[in.a], vals[in.b], vals[in.c], o, n);
        } else if (arity(in.op) == 1) {
          if (b.avx512 && eval_unary_avx512(in.op, vals[in.a], in.s, in.t, o, n)) break;
          const float* x = vals[in.a];
          if (in.pre_affine() || in.op == AFFINE) {
            eval_affine(x, in.s, in.t, o, n);
            x = o;
          }
          if (in.op != AFFINE) eval_unary(in.op, x, o, n);
        }
        else eval_binary(in.op, vals[in.a], code[in.a].op == CONST, vals[in.b],
                         code[in.b].op == CONST, o, n);
    }
    vals[i] = o;
  }
}

void fill_consts(const Program& p, float* scratch, const int* slot = nullptr) {
  for (size_t i = 0; i < p.code.size(); ++i) {
    const int64_t si = slot ? slot[i] : static_cast<int64_t>(i);
    if (p.code[i].op == CONST && si >= 0)
      std::fill(scratch + si * kSlot, scratch + si * kSlot + kBlock, p.code[i].imm);
  }
}

// Outputs at least this large are written with non-temporal stores: they cannot stay in
// the last-level cache anyway, and a normal store would first read every output line
// from memory (one extra memory transfer per element, a third more traffic).
int64_t stream_threshold_bytes() {
  static const int64_t t = [] {
    long l3 = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
    l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
    return static_cast<int64_t>(l3 > 0 ? l3 : 32L << 20);
  }();
  return t;
}

// Inputs read in place are streamed from memory a block at a time between long runs
// of arithmetic; the hardware prefetcher alone leaves each block's first loads waiting
// on memory.  Touch the block kPrefetchBlocks ahead instead.
constexpr int64_t kPrefetchBlocks = 8;
inline void prefetch_inputs(const Bound& b, int64_t start) {
  if (start >= b.total) return;
  const int64_t n = std::min(kBlock, b.total - start);
  for (size_t k = 0; k < b.data.size(); ++k) {
    if (!b.views[k].full || !b.data[k]) continue;  // (a bfloat16 input is widened as it is read)
    const char* p = reinterpret_cast<const char*>(b.data[k] + start);
    for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(float)); off += 64)
      _mm_prefetch(p + off, _MM_HINT_T0);
  }
}

// dst[0, n) = src[0, n) with streaming stores where dst is 32-byte aligned.
void stream_copy(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31)) { dst[i] = src[i]; ++i; }
  for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

void forward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out);

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                      const OpResource&) {
  return guarded("fused_elemwise", [&] {
    if (!any_f16(*in, *out)) return forward_f32(a, in, out);
    Float32Call c(*in, *out);
    forward_f32(a, &c.in, &c.out);
    c.finish();
  });
}

// The forward pass on float32 and bfloat16 tensors.
void forward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
  {
    Bound b = bind_inputs(a, *in, 0);
    const bool half_out = (*out)[0].dtype == kBfloat16;
    float* Y = half_out ? nullptr : (*out)[0].data<float>();
    uint16_t* Yh = half_out ? static_cast<uint16_t*>((*out)[0].data_ptr) : nullptr;
    const int64_t nblk = (b.total + kBlock - 1) / kBlock;
    const size_t ni = b.prog->code.size();
    const int* slot = b.prog->slot.data();
    const bool streaming = b.total * static_cast<int64_t>(sizeof(float)) >= stream_threshold_bytes();
#pragma omp parallel if (nblk > 1)
    {
      std::vector<float> scratch(static_cast<size_t>(b.prog->num_slots) * kSlot);
      std::vector<const float*> vals(ni);
      fill_consts(*b.prog, scratch.data(), slot);
#pragma omp for schedule(dynamic, kChunk)
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t s = blk * kBlock, n = std::min(kBlock, b.total - s);
        prefetch_inputs(b, s + kPrefetchBlocks * kBlock);
        if (half_out) {  // the result stays in L1, then is rounded to bfloat16
          eval_block(b, s, n, scratch.data(), vals, nullptr, slot);
          to_bf16(vals[ni - 1], Yh + s, n);
        } else if (streaming) {  // the result stays in L1, then streams out
          eval_block(b, s, n, scratch.data(), vals, nullptr, slot);
          stream_copy(Y + s, vals[ni - 1], n);
        } else {
          eval_block(b, s, n, scratch.data(), vals, Y + s, slot);
          if (vals[ni - 1] != Y + s) std::memcpy(Y + s, vals[ni - 1], n * sizeof(float));
        }
      }
      if (streaming && !half_out) _mm_sfence();  // order the streaming stores before the op returns
    }
  }
}

// MXNet's hard_sigmoid backward: g * alpha where alpha x + beta (rounded as the forward
// rounds it) lies strictly inside (0, 1), else 0; also the gradients of alpha and beta.
MXF_NO_CONTRACT void hard_sigmoid_backprop(const float* x, const float* al, const float* be,
                                           const float* g, float* gx, float* gal, float* gbe,
                                           int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float o = al[i] * x[i] + be[i];
    const bool inside = o > 0.f && o < 1.f;
    if (gx) gx[i] += inside ? g[i] * al[i] : 0.f;
    if (gal) gal[i] += inside ? g[i] * x[i] : 0.f;
    if (gbe) gbe[i] += inside ? g[i] : 0.f;
  }
}

// Adds the adjoint of instruction `in` (value y, adjoint g) into its operands' adjoints,
// as MXNet's backward of the op computes it: g * grad(x or y) in MXNet's own arrangement
// (e.g. log: g * (1 / x), div: g * (-a / (b * b))), so that inf * 0 gives NaN where it does
// there.  `b_const`: operand b is a constant (a scalar op in MXNet: x / c backpropagates
// g / c, x / y backpropagates g * (1 / y)).
void backprop(const Instr& in, const std::vector<const float*>& v, const float* y, const float* g,
              std::vector<float*>& adj, const std::vector<char>& wants, bool b_const, int64_t n) {
  auto A = [&](int k) { return k >= 0 && wants[k] ? adj[k] : nullptr; };
  float* ga = A(in.a);
  float* gb = A(in.b);
  float* gc = A(in.c);
  const float* a = in.a >= 0 ? v[in.a] : nullptr;
  const float* b = in.b >= 0 ? v[in.b] : nullptr;
  const float* c = in.c >= 0 ? v[in.c] : nullptr;
#define MXF_GA(EXPR) if (ga) for (int64_t i = 0; i < n; ++i) ga[i] += (EXPR)
#define MXF_GB(EXPR) if (gb) for (int64_t i = 0; i < n; ++i) gb[i] += (EXPR)
#define MXF_GC(EXPR) if (gc) for (int64_t i = 0; i < n; ++i) gc[i] += (EXPR)
  switch (in.op) {
    case NEG: MXF_GA(-g[i]); break;
    case ABS: MXF_GA(g[i] * (a[i] < 0.f ? -1.f : (a[i] > 0.f ? 1.f : 0.f))); break;
    case EXP: MXF_GA(g[i] * y[i]); break;
    case LOG: MXF_GA(g[i] * (1.f / a[i])); break;
    case SQRT: MXF_GA(g[i] * (0.5f / y[i])); break;
    case RSQRT: MXF_GA(g[i] * (-0.5f / (std::sqrt(a[i]) * a[i]))); break;
    case TANH: MXF_GA(g[i] * (1.f - y[i] * y[i])); break;
    case SIGMOID: MXF_GA(g[i] * (y[i] * (1.f - y[i]))); break;
    case RELU: MXF_GA(g[i] * (y[i] != y[i] ? y[i] : (y[i] > 0.f ? 1.f : 0.f))); break;
    case RELU_DNNL: MXF_GA(g[i] * (y[i] > 0.f ? 1.f : 0.f)); break;
    case ERF: MXF_GA(g[i] * erf_grad(a[i])); break;
    case SQUARE: MXF_GA(g[i] * (2.f * a[i])); break;
    case SOFTRELU: MXF_GA(g[i] * -std::expm1(-y[i])); break;
    case SOFTSIGN: {
      if (ga) for (int64_t i = 0; i < n; ++i) {
        const float d = 1.f + std::fabs(a[i]);
        ga[i] += g[i] * (1.f / (d * d));
      }
      break;
    }
    case LOG_SIGMOID: MXF_GA(g[i] * fast_sigmoid(-a[i])); break;
    case MISH:
      if (ga) for (int64_t i = 0; i < n; ++i) {
        const float t = fast_tanh(softrelu(a[i]));
        ga[i] += g[i] * (t + a[i] * (1.f - t * t) * fast_sigmoid(a[i]));
      }
      break;
    case LOG1P: MXF_GA(g[i] * (1.f / (1.f + a[i]))); break;
    case EXPM1: MXF_GA(g[i] * exp_full(a[i])); break;
    case GELU:
    case GELU_DNNL: MXF_GA(g[i] * gelu_erf_grad(a[i])); break;
    case ADD: MXF_GA(g[i]); MXF_GB(g[i]); break;
    case SUB: MXF_GA(g[i]); MXF_GB(-g[i]); break;
    case MUL: MXF_GA(g[i] * b[i]); MXF_GB(g[i] * a[i]); break;
    case DIV:
      if (b_const) {
        MXF_GA(g[i] / b[i]);
      } else {
        MXF_GA(g[i] * (1.f / b[i]));
      }
      MXF_GB(g[i] * (-a[i] / (b[i] * b[i])));
      break;
    case POW:
      MXF_GA(g[i] * (std::pow(a[i], b[i] - 1.f) * b[i]));
      MXF_GB(g[i] * (y[i] * std::log(a[i])));
      break;
    case MAX:  // MXNet: the left operand on ties (a >= b), neither where a NaN decides
      MXF_GA(g[i] * (a[i] >= b[i] ? 1.f : 0.f));
      MXF_GB(g[i] * (a[i] < b[i] ? 1.f : 0.f));
      break;
    case MIN:
      MXF_GA(g[i] * (a[i] <= b[i] ? 1.f : 0.f));
      MXF_GB(g[i] * (a[i] > b[i] ? 1.f : 0.f));
      break;
    case LEAKY:  // MXNet: g * (y > 0 ? 1 : slope), from the output
      MXF_GA(g[i] * (y[i] > 0.f ? 1.f : b[i]));
      MXF_GB(y[i] > 0.f ? 0.f : g[i] * a[i]);
      break;
    case LEAKY_DNNL:  // oneDNN: x <= 0 ? g * slope : g (NaN takes g), from the input
      MXF_GA(a[i] <= 0.f ? g[i] * b[i] : g[i]);
      MXF_GB(a[i] <= 0.f ? g[i] * a[i] : 0.f);
      break;
    case WHERE:  // MXNet writes 0 (not g * 0) to the branch not taken
      MXF_GB(a[i] != 0.f ? g[i] : 0.f);
      MXF_GC(a[i] != 0.f ? 0.f : g[i]);
      break;
    case CLIP:  // MXNet: 0 where x > hi or x < lo, else g (NaN passes)
      MXF_GA((a[i] > c[i] || a[i] < b[i]) ? 0.f : g[i]);
      MXF_GB(!(a[i] > c[i]) && a[i] < b[i] ? g[i] : 0.f);
      MXF_GC(a[i] > c[i] ? g[i] : 0.f);
      break;
    case HARD_SIGMOID: hard_sigmoid_backprop(a, b, c, g, ga, gb, gc, n); break;
    default: break;  // comparisons, loads, constants: nothing flows further
  }
#undef MXF_GA
#undef MXF_GB
#undef MXF_GC
}

// inputs: [dy, x0..x{n-1}, y]; outputs: [dx0..dx{n-1}]
void backward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out);

MXReturnValue backward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out,
                       const OpResource&) {
  return guarded("fused_elemwise backward", [&] {
    for (const auto& t : *in)
      if (t.dtype == kBfloat16)
        throw OpError("bfloat16 values have no backward on the CPU (reduced precision is for inference)");
    if (!any_f16(*in, *out)) return backward_f32(a, in, out);
    Float32Call c(*in, *out);
    backward_f32(a, &c.in, &c.out);
    c.finish();
  });
}

void backward_f32(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out) {
  {
    Bound b = bind_inputs(a, *in, 1);
    const Program& p = *b.prog;
    const std::vector<Instr>& code = b.code;
    const float* dY = (*in)[0].data<float>();
    const size_t ni = code.size();
    const int nin = p.num_inputs;
    // which instructions carry a gradient back to some input
    std::vector<char> wants(ni, 0);
    for (size_t i = 0; i < ni; ++i) {
      const Instr& c = code[i];
      if (c.op == LOAD) wants[i] = 1;
      else if (c.op != CONST && !is_comparison(c.op)) {
        for (int k : {c.a, c.b, c.c})
          if (k >= 0 && wants[k]) wants[i] = 1;
      }
    }
    // values whose adjoint receives something (a comparison passes nothing back, nor does
    // where to its condition): an input no gradient reaches gets +0, as MXNet's zeros
    std::vector<char> flows(ni, 0);
    flows[ni - 1] = wants[ni - 1];
    for (size_t i = ni; i-- > 0;) {
      const Instr& c = code[i];
      if (!flows[i] || c.op == LOAD || c.op == CONST || is_comparison(c.op)) continue;
      const int ops[3] = {c.a, c.b, c.c};
      for (int j = 0; j < 3; ++j)
        if (ops[j] >= 0 && wants[ops[j]] && !(c.op == WHERE && j == 0)) flows[ops[j]] = 1;
    }
    const int nt = omp_get_max_threads();
    std::vector<std::vector<float>> acc(nin);  // per-thread accumulators for broadcast inputs
    for (int k = 0; k < nin; ++k) {
      float* dx = (*out)[k].data<float>();
      std::fill(dx, dx + (*out)[k].size(), 0.f);
      if (!b.views[k].full) acc[k].assign(static_cast<size_t>(nt) * (*out)[k].size(), 0.f);
    }
    const int64_t nblk = (b.total + kBlock - 1) / kBlock;
#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num();
      std::vector<float> scratch(ni * kSlot), gbuf(ni * kSlot);
      std::vector<const float*> vals(ni);
      std::vector<float*> adj(ni);
      for (size_t i = 0; i < ni; ++i) adj[i] = gbuf.data() + i * kSlot;
      fill_consts(p, scratch.data());
#pragma omp for schedule(dynamic, kChunk)
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int64_t s = blk * kBlock, n = std::min(kBlock, b.total - s);
        eval_block(b, s, n, scratch.data(), vals);
        // adjoints start at -0, the neutral addend: a value with one reader gets exactly
        // MXNet's gradient, the sign of a zero included
        for (size_t i = 0; i < ni; ++i)
          if (wants[i]) std::fill(adj[i], adj[i] + n, -0.f);
        if (wants[ni - 1]) std::memcpy(adj[ni - 1], dY + s, n * sizeof(float));
        // only values an adjoint reaches backpropagate: one no gradient reaches (a comparison's
        // operand) passes nothing on, not 0 times its local derivative (0 · NaN would be NaN)
        for (size_t i = ni; i-- > 0;)
          if (flows[i] && code[i].op != LOAD)
            backprop(code[i], vals, vals[i], adj[i], adj, wants,
                     code[i].b >= 0 && code[code[i].b].op == CONST, n);
        for (int k = 0; k < nin; ++k) {
          const int li = p.load_of[k];
          if (li < 0) continue;
          if (b.views[k].full) {
            if (flows[li]) std::memcpy((*out)[k].data<float>() + s, adj[li], n * sizeof(float));
            else std::fill((*out)[k].data<float>() + s, (*out)[k].data<float>() + s + n, 0.f);
          } else if (flows[li]) {
            b.views[k].scatter_add(adj[li], s, n, acc[k].data() + static_cast<size_t>(t) * (*out)[k].size());
          }
        }
      }
    }
    for (int k = 0; k < nin; ++k) {
      if (b.views[k].full || p.load_of[k] < 0) continue;
      float* dx = (*out)[k].data<float>();
      const int64_t sz = (*out)[k].size();
      for (int t = 0; t < nt; ++t)
        for (int64_t i = 0; i < sz; ++i) dx[i] += acc[k][static_cast<size_t>(t) * sz + i];
    }
  }
}

}  // namespace

REGISTER_OP(fused_elemwise)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(backward, "cpu")
#if MXF_WITH_CUDA
    .setForward(mxf::gpu::elemwise_forward, "gpu")
    .setBackward(mxf::gpu::elemwise_backward, "gpu")
#endif
    ;
