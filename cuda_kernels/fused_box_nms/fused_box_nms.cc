// fused_box_nms: MXNet's _contrib_box_nms (non-maximum suppression), the same output, computed
// without sorting every box.
//
// MXNet 1.9.1 sorts all valid boxes of the input (a stable sort by score, then by batch) and
// runs one parallel kernel launch per reference box; a detection head hands it every
// (anchor, class) pair (YOLOv3 on COCO: 851,760 rows), of which only the best `topk` take part.
// This op keeps the best `topk` of each batch in bounded heaps (one per thread, merged), in
// the order the stable sort gives (score descending, then row ascending), and suppresses
// greedily over them: each kept box in order suppresses every later one of its class (any
// class with force_suppress) whose IoU exceeds overlap_thresh -- what MXNet's kernels compute,
// with the same float arithmetic for areas and IoU.  Its second output is MXNet's hidden one
// (the input position of each kept row, batch included, -1 after them), so that a graph reading
// it, and the outputs' names, stay as they were.  See README.md.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "mxf_common.h"
#include "no_contract.h"

using namespace mxf;

namespace {

enum Format { kCorner = 0, kCenter = 1 };

struct NmsParams {
  float overlap_thresh, valid_thresh;
  int64_t topk, coord_start, score_index, id_index, background_id;
  bool force_suppress;
  Format in_format, out_format;
};

Format format(const Attrs& a, const char* name) {
  return attr_choice(a, name, "corner", {"corner", "center"}) == "center" ? kCenter : kCorner;
}

NmsParams parse(const Attrs& a) {
  NmsParams p;
  p.overlap_thresh = attr_float(a, "overlap_thresh", 0.5f);
  p.valid_thresh = attr_float(a, "valid_thresh", 0.f);
  p.topk = attr_int(a, "topk", -1);
  p.coord_start = attr_int(a, "coord_start", 2);
  p.score_index = attr_int(a, "score_index", 1);
  p.id_index = attr_int(a, "id_index", -1);
  p.background_id = attr_int(a, "background_id", -1);
  p.force_suppress = attr_bool(a, "force_suppress", false);
  p.in_format = format(a, "in_format");
  p.out_format = format(a, "out_format");
  return p;
}

// The checks of MXNet's BoxNMSShape on the row width.
void check_width(const NmsParams& p, int64_t width) {
  const int64_t expected = p.id_index >= 0 ? 6 : 5;
  if (width < expected)
    throw OpError("the last dimension must have at least " + std::to_string(expected) +
                  " elements (score, 4 coordinates" + std::string(p.id_index >= 0 ? ", class id" : "") +
                  "), got " + std::to_string(width));
  const int64_t c0 = p.coord_start, c1 = p.coord_start + 3;
  if (p.score_index < 0 || p.score_index >= width)
    throw OpError("score_index " + std::to_string(p.score_index) + " out of range [0, " + std::to_string(width) + ")");
  if (p.score_index >= c0 && p.score_index <= c1)
    throw OpError("score_index " + std::to_string(p.score_index) + " falls among the coordinates");
  if (c0 < 0 || c1 >= width)
    throw OpError("coordinates [" + std::to_string(c0) + ", " + std::to_string(c1) + "] out of range [0, " +
                  std::to_string(width) + ")");
  if (p.id_index >= 0) {
    if (p.id_index >= width)
      throw OpError("id_index " + std::to_string(p.id_index) + " out of range [0, " + std::to_string(width) + ")");
    if (p.id_index >= c0 && p.id_index <= c1)
      throw OpError("id_index " + std::to_string(p.id_index) + " falls among the coordinates");
    if (p.id_index == p.score_index) throw OpError("id_index and score_index are the same");
  }
}

MXReturnValue parse_attrs(const Attrs& a, int* nin, int* nout) {
  return guarded("fused_box_nms", [&] {
    parse(a);
    *nin = 1;
    *nout = 2;
  });
}

MXReturnValue infer_shape(const Attrs& a, std::vector<Shape>* in, std::vector<Shape>* out) {
  return guarded("fused_box_nms", [&] {
    require_known_shapes(*in);
    const Shape& s = (*in)[0];
    if (s.size() < 2) throw OpError("the input must have rank >= 2 (boxes, width), got " + shape_str(s));
    check_width(parse(a), s.back());
    (*out)[0] = s;
    Shape r = s;
    r.back() = 1;
    (*out)[1] = r;
  });
}

// A candidate box: its score and its row within the batch.  `better` is the order of MXNet's
// stable sort by descending score (equal scores keep their row order).
struct Cand {
  float score;
  int32_t row;
};
inline bool better(const Cand& a, const Cand& b) { return a.score > b.score || (a.score == b.score && a.row < b.row); }

// The best `k` valid boxes among rows [lo, hi) of one batch, as a heap whose front is the worst kept.
void select(const float* x, int64_t lo, int64_t hi, int64_t width, const NmsParams& p, int64_t k,
            std::vector<Cand>* heap) {
  heap->clear();
  const float valid = p.valid_thresh, bg = static_cast<float>(p.background_id);
  const bool cls = p.id_index >= 0;
  for (int64_t r = lo; r < hi; ++r) {
    const float* row = x + r * width;
    const float s = row[p.score_index];
    if (!(s > valid) || (cls && !(row[p.id_index] != bg))) continue;
    const Cand c{s, static_cast<int32_t>(r)};
    if (static_cast<int64_t>(heap->size()) < k) {
      heap->push_back(c);
      std::push_heap(heap->begin(), heap->end(), better);
    } else if (better(c, heap->front())) {
      std::pop_heap(heap->begin(), heap->end(), better);
      heap->back() = c;
      std::push_heap(heap->begin(), heap->end(), better);
    }
  }
}

// MXNet's BoxArea: width * height, 0 where either is negative.
inline float box_area(const float* b, Format f) {
  const float w = f == kCorner ? b[2] - b[0] : b[2];
  const float h = f == kCorner ? b[3] - b[1] : b[3];
  return (w < 0 || h < 0) ? 0.f : w * h;
}

// MXNet's nms_impl once the intersection's extents [l0, h0] x [l1, h1] are known: each side clamped
// at 0, IoU = inter / (area_ref + area_pos - inter), suppressed where IoU > thresh (NaN: not).
MXF_NO_CONTRACT inline bool overlaps(float l0, float h0, float l1, float h1, float ra, float aj, float thresh) {
  float w = h0 - l0, h = h1 - l1;
  w = w > 0 ? w : 0.f;
  h = h > 0 ? h : 0.f;
  const float inter = w * h;
  return inter / (ra + aj - inter) > thresh;
}

// Greedy suppression over the candidates of one batch in order (MXNet's NMSApply + nms_impl):
// alive[j] cleared where an earlier alive box of the same class (any, with force) overlaps it
// by IoU > thresh.  Coordinates as stored (a0, a1, a2, a3 from coord_start), MXNet's Intersect.
MXF_NO_CONTRACT void suppress(const std::vector<float>& a0, const std::vector<float>& a1,
                              const std::vector<float>& a2, const std::vector<float>& a3,
                              const std::vector<float>& area, const std::vector<int32_t>& cls, bool by_class,
                              Format f, float thresh, std::vector<uint8_t>* alive_v) {
  const int64_t k = static_cast<int64_t>(area.size());
  uint8_t* alive = alive_v->data();
  const float *X0 = a0.data(), *X1 = a1.data(), *X2 = a2.data(), *X3 = a3.data(), *A = area.data();
  const int32_t* C = cls.data();
  for (int64_t i = 0; i < k; ++i) {
    if (!alive[i]) continue;
    const float r0 = X0[i], r1 = X1[i], r2 = X2[i], r3 = X3[i], ra = A[i];
    const int32_t rc = C[i];
    if (f == kCorner) {
#pragma omp simd
      for (int64_t j = i + 1; j < k; ++j) {
        const float l0 = r0 > X0[j] ? r0 : X0[j], h0 = r2 < X2[j] ? r2 : X2[j];
        const float l1 = r1 > X1[j] ? r1 : X1[j], h1 = r3 < X3[j] ? r3 : X3[j];
        const bool hit = overlaps(l0, h0, l1, h1, ra, A[j], thresh) && (!by_class || C[j] == rc);
        alive[j] = hit ? 0 : alive[j];
      }
    } else {
      const float rw = r2 / 2, rh = r3 / 2;
      const float rl = r0 - rw, rr = r0 + rw, rt = r1 - rh, rb = r1 + rh;
#pragma omp simd
      for (int64_t j = i + 1; j < k; ++j) {
        const float bw = X2[j] / 2, bh = X3[j] / 2;
        const float bl = X0[j] - bw, br = X0[j] + bw, bt = X1[j] - bh, bb = X1[j] + bh;
        const float l0 = bl > rl ? bl : rl, h0 = br < rr ? br : rr;
        const float l1 = bt > rt ? bt : rt, h1 = bb < rb ? bb : rb;
        const bool hit = overlaps(l0, h0, l1, h1, ra, A[j], thresh) && (!by_class || C[j] == rc);
        alive[j] = hit ? 0 : alive[j];
      }
    }
  }
}

// MXNet's corner_to_center / center_to_corner on one output row (rows whose first coordinate
// is negative are left as they are, as there).
MXF_NO_CONTRACT void convert(float* b, Format to) {
  if (to == kCenter) {
    const float left = b[0];
    if (left < 0) return;
    const float top = b[1], right = b[2], bot = b[3];
    b[0] = (left + right) / 2;
    b[1] = (top + bot) / 2;
    b[2] = right - left;
    b[3] = bot - top;
  } else {
    const float x = b[0];
    if (x < 0) return;
    const float y = b[1], w = b[2] / 2, h = b[3] / 2;
    b[0] = x - w;
    b[1] = y - h;
    b[2] = x + w;
    b[3] = y + h;
  }
}

MXReturnValue forward(const Attrs& a, std::vector<MXTensor>* in, std::vector<MXTensor>* out, const OpResource&) {
  return guarded("fused_box_nms", [&] {
    const NmsParams p = parse(a);
    MXTensor& xt = (*in)[0];
    require_f32(xt, "data");
    const auto& s = xt.shape;
    const int r = static_cast<int>(s.size());
    int64_t B = 1;
    for (int d = 0; d < r - 2; ++d) B *= s[d];
    const int64_t N = s[r - 2], W = s[r - 1];
    check_width(p, W);
    const float* X = xt.data<float>();
    float* Y = (*out)[0].data<float>();
    float* R = (*out)[1].data<float>();
    const int64_t total = B * N * W;
    const int64_t k = p.topk < 0 ? N : std::min<int64_t>(N, p.topk);
    const int nt = omp_get_max_threads();
    if (k < 1) {
      std::memcpy(Y, X, sizeof(float) * total);
      for (int64_t i = 0; i < B * N; ++i) R[i] = static_cast<float>(i);
      return;
    }
    // 1. the best k valid rows of every batch: per (batch, chunk) a bounded heap, then merged
    const int64_t chunks = (N * W >= (1 << 16) && B < nt) ? (nt + B - 1) / B : 1;
    std::vector<std::vector<Cand>> heaps(B * chunks);
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::min<int64_t>(nt, B * chunks))
    for (int64_t t = 0; t < B * chunks; ++t) {
      const int64_t b = t / chunks, c = t % chunks, step = (N + chunks - 1) / chunks;
      const int64_t lo = std::min(N, c * step), hi = std::min(N, lo + step);
      heaps[t].reserve(std::min(k, hi - lo));
      select(X + b * N * W, lo, hi, W, p, k, &heaps[t]);
    }
    // 2. per batch: order the candidates, suppress, write the kept rows in order, -1 elsewhere
    const bool by_class = !p.force_suppress && p.id_index >= 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::min<int64_t>(nt, B))
    for (int64_t b = 0; b < B; ++b) {
      std::vector<Cand> cand;
      for (int64_t c = 0; c < chunks; ++c) cand.insert(cand.end(), heaps[b * chunks + c].begin(), heaps[b * chunks + c].end());
      std::sort(cand.begin(), cand.end(), better);
      if (static_cast<int64_t>(cand.size()) > k) cand.resize(k);
      const int64_t n = static_cast<int64_t>(cand.size());
      const float* xb = X + b * N * W;
      std::vector<float> a0(n), a1(n), a2(n), a3(n), area(n);
      std::vector<int32_t> cls(n, 0);
      std::vector<uint8_t> alive(n, 1);
      for (int64_t i = 0; i < n; ++i) {
        const float* row = xb + static_cast<int64_t>(cand[i].row) * W;
        const float* box = row + p.coord_start;
        a0[i] = box[0], a1[i] = box[1], a2[i] = box[2], a3[i] = box[3];
        area[i] = box_area(box, p.in_format);
        if (by_class) cls[i] = static_cast<int32_t>(row[p.id_index]);
      }
      suppress(a0, a1, a2, a3, area, cls, by_class, p.in_format, p.overlap_thresh, &alive);
      float* yb = Y + b * N * W;
      int64_t kept = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (!alive[i]) continue;
        float* dst = yb + kept * W;
        std::memcpy(dst, xb + static_cast<int64_t>(cand[i].row) * W, sizeof(float) * W);
        if (p.in_format != p.out_format) convert(dst + p.coord_start, p.out_format);
        R[b * N + kept] = static_cast<float>(b * N + cand[i].row);
        ++kept;
      }
      std::fill(yb + kept * W, yb + N * W, -1.f);
      std::fill(R + b * N + kept, R + (b + 1) * N, -1.f);
    }
  });
}

}  // namespace

REGISTER_OP(fused_box_nms)
    .setParseAttrs(parse_attrs)
    .setInferType(infer_type_float32)
    .setInferShape(infer_shape)
    .setForward(forward, "cpu")
    .setBackward(inference_only_backward, "cpu");
