// Layout handling for fused_attention: every supported layout is reduced to a
// set of base pointers and strides, so the kernels never copy or transpose.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mxf_common.h"

namespace mxf {
namespace attn {

enum class Layout { plain, bshd, packed_qkv, interleaved, interleaved_encdec };
enum class MaskKind { none, additive, boolean, valid_length };
// What a causal op does with the keys after a query's band (j > i + Sk - Sq):
// exclude them (as softmax with lengths does), add mask_value to their scores, or
// replace their scores by mask_value (the additive and where() masks of a graph).
enum class CausalMode { exclude, add, fill };

struct Params {
  Layout layout;
  MaskKind mask;
  float scale;
  bool causal;
  CausalMode causal_mode;
  int64_t heads;
  float mask_value;  // score where a boolean mask is 0; the causal add / fill value
  // nan_probs="row": a row whose softmax is NaN has every probability NaN (MXNet's own softmax
  // kernel, which a `temperature` selects), whatever softmax_nan_at_scores() would say
  bool nan_probs_row;
  // length_fill (mask_kind valid_length): the keys a row does not see (at or after its length,
  // after its causal band) keep the score mask_value in the softmax's sum and give 0 to the
  // product -- GluonNLP's softmax(where(m, s, c)) * m with m the keys before the length.
  // With mask_kind boolean, the same form for any mask m: the keys where m is 0 take the score
  // mask_value, then every probability is multiplied by m's value (0 where the key is masked).
  // Inference on the CPU only (no backward, no GPU kernel).
  bool length_fill;
};

Params parse(const Attrs& attrs);
int num_data_inputs(Layout l);  // inputs before the optional mask

// Row r of head (b, h) of tensor X starts at X + b*bs + h*hs + r*rs.
struct View {
  float* p;
  int64_t bs, hs, rs;
  const float* row(int64_t b, int64_t h, int64_t r) const { return p + b * bs + h * hs + r * rs; }
  float* mrow(int64_t b, int64_t h, int64_t r) const { return p + b * bs + h * hs + r * rs; }
};

// The same rows of a bfloat16 input (raw bits), element strides as View's.
struct HView {
  const uint16_t* p = nullptr;
  int64_t bs = 0, hs = 0, rs = 0;
  const uint16_t* row(int64_t b, int64_t h, int64_t r) const { return p + b * bs + h * hs + r * rs; }
};

// N = B*H heads of (Sq, D) queries, (Sk, D) keys, (Sk, Dv) values.  `batch` holds the
// scores' leading dims as the unfused graph has them, so that a mask broadcasts like
// MXNet's broadcast_add: plain: q's leading dims (any number, flattened row-major as
// n = b*H + h with H the last of them); other layouts: {B*H}, or {B, H} for a rank-4 mask.
struct Geom {
  int64_t B, H, Sq, Sk, D, Dv;
  View q, k, v, o;
  // bfloat16 inputs read as they are (set by bind_views_bf16; q/k/v then unset, see
  // forward_bf16_io)
  HView qh, kh, vh;
  std::vector<int64_t> batch;  // plain only (empty: the layout's {B*H} / {B, H})
};

// Shapes of the data inputs -> geometry (pointers left null).  Throws OpError.
Geom geometry(const Params& p, const std::vector<std::vector<int64_t>>& in_shapes);
std::vector<int64_t> out_shape(const Params& p, const Geom& g,
                               const std::vector<std::vector<int64_t>>& in_shapes);
// Points the views at the data of the given data-input tensors and output.
void bind_views(const Params& p, Geom* g, const std::vector<float*>& data, float* out);
// The same for bfloat16 data inputs (Geom::qh/kh/vh; q/k/v are left null).
void bind_views_bf16(const Params& p, Geom* g, const std::vector<const uint16_t*>& data);
// The scores' leading dims a mask of rank `mask_rank` is aligned with (see Geom::batch).
std::vector<int64_t> scores_batch(const Params& p, const Geom& g, size_t mask_rank);

// Mask access: element (n, i, j) of the scores at p + noff[n] + i*sq + j*sk (strides 0
// where the mask broadcasts).
struct MaskView {
  MaskKind kind = MaskKind::none;
  const float* p = nullptr;
  int64_t sq = 0, sk = 0;
  std::vector<int64_t> noff;     // offset of head n's (Sq, Sk) slice
  std::vector<int64_t> lengths;  // valid_length per (b*H + h, query row)
  const float* base(int64_t n) const { return p + noff[n]; }
};
void check_mask_shape(const Params& p, const Geom& g, const std::vector<int64_t>& ms);
// Whether the softmax reads lengths (valid_length, or the causal exclude band): MXNet's softmax
// with lengths, whose keys after a row's length get probability 0 and no gradient.
bool softmax_with_lengths(const Params& p);
// Which probabilities of a row whose softmax is NaN (a NaN or +inf score, or every score -inf)
// are NaN, as the unfused graph's softmax gives them: true — only where the score minus the
// row's max is NaN, the others 0 (oneDNN's softmax, MXNet's default for float32 scores of rank
// <= 4 without lengths or temperature); false — every key the row sees (MXNet's own kernel: with
// lengths, a temperature (nan_probs="row"), scores of rank > 4, or MXNET_MKLDNN_ENABLED=0).
bool softmax_nan_at_scores(const Params& p, const Geom& g);
MaskView mask_view(const Params& p, const Geom& g, const MXTensor* mask);

void forward(const Params& p, const Geom& g, const MaskView& m);
// forward with bfloat16 data inputs (bf16_in: Geom::qh/kh/vh bound) and/or a bfloat16 output
// (out_bf16 set: the float32 result rounded to nearest even; g.o unused), see attention_cpu.cc.
void forward_bf16_io(const Params& p, Geom g, const MaskView& m, bool bf16_products, bool bf16_in,
                     uint16_t* out_bf16);
// dq/dk/dv views share q/k/v strides; they (and dmask) must be zeroed by the caller.
// dmask: gradient of an additive mask, contiguous in the mask's shape (null: not wanted).
void backward(const Params& p, const Geom& g, const MaskView& m, const View& dout,
              const View& dq, const View& dk, const View& dv, float* dmask);

}  // namespace attn
}  // namespace mxf
