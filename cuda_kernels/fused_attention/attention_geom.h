// Layout handling for fused_attention: every supported layout is reduced to a
// set of base pointers and strides, so the kernels never copy or transpose.
#pragma once
#include <string>
#include <vector>

#include "mxf_common.h"

namespace mxf {
namespace attn {

enum class Layout { plain, bshd, packed_qkv, interleaved, interleaved_encdec };
enum class MaskKind { none, additive, boolean, valid_length };

struct Params {
  Layout layout;
  MaskKind mask;
  float scale;
  bool causal;
  int64_t heads;
  float mask_value;  // score used where a boolean mask is 0
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

struct Geom {
  int64_t B, H, Sq, Sk, D, Dv;
  View q, k, v, o;
};

// Shapes of the data inputs -> geometry (pointers left null).  Throws OpError.
Geom geometry(const Params& p, const std::vector<std::vector<int64_t>>& in_shapes);
std::vector<int64_t> out_shape(const Params& p, const Geom& g,
                               const std::vector<std::vector<int64_t>>& in_shapes);
// Points the views at the data of the given data-input tensors and output.
void bind_views(const Params& p, Geom* g, const std::vector<float*>& data, float* out);

// Mask access broadcast to (B*H, Sq, Sk) (rank <= 3) or (B, H, Sq, Sk) (rank 4).
struct MaskView {
  MaskKind kind = MaskKind::none;
  const float* p = nullptr;
  int64_t sb = 0, sh = 0, sq = 0, sk = 0;  // strides for b, h, row, col
  std::vector<int64_t> lengths;             // valid_length per (b*H + h, query row)
  const float* base(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};
void check_mask_shape(const Params& p, const Geom& g, const std::vector<int64_t>& ms);
MaskView mask_view(const Params& p, const Geom& g, const MXTensor* mask);

void forward(const Params& p, const Geom& g, const MaskView& m);
// dq/dk/dv views share q/k/v strides; they must be zeroed by the caller.
void backward(const Params& p, const Geom& g, const MaskView& m, const View& dout,
              const View& dq, const View& dk, const View& dv);

}  // namespace attn
}  // namespace mxf
