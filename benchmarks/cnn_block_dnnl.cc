// One CNN block run end to end by oneDNN 3.x, activations kept in oneDNN's blocked layout
// between the convolutions (post-ops for BatchNorm-folded bias, hard-swish / relu, the residual
// add), NCHW reorders only at the block's input and output: the figure that decides whether a
// block-level op can beat MXNet's default bind of the same block (benchmarks/bench_cnn_block_op.py
// times MXNet's side).
//
//   g++ -O2 -fopenmp -std=c++17 -I.venv/include -o /tmp/cnn_block_dnnl benchmarks/cnn_block_dnnl.cc \
//       .venv/lib/libdnnl.so.3 -Wl,-rpath,$PWD/.venv/lib
//   OMP_NUM_THREADS=2 /tmp/cnn_block_dnnl mbv3 CIN H EXP COUT K STRIDE SE ACT [REPS]
//     MobileNetV3's ResUnit: [1x1 expand + act] -> KxK depthwise + act -> [SE: pool, 1x1, relu,
//     1x1, hard-sigmoid, scale] -> 1x1 project [+ x]   (ACT: relu | hswish; SE: 0 | 1)
//   OMP_NUM_THREADS=2 /tmp/cnn_block_dnnl mbv3-nchw ...   the same, every op reading and writing NCHW
//     (what an op per layer in the MXNet graph would pay)
//   OMP_NUM_THREADS=2 /tmp/cnn_block_dnnl resnext CIN H WIDTH COUT GROUPS STRIDE DOWNSAMPLE [REPS]
//     ResNeXt's SE bottleneck: 1x1 + relu -> grouped 3x3 + relu -> 1x1 -> SE (sigmoid) scale
//     -> + x | + 1x1 strided downsample(x) -> relu
//   OMP_NUM_THREADS=2 /tmp/cnn_block_dnnl densenet C0 H LAYERS [REPS]
//     DenseNet's dense block (growth 32, bottleneck 128), the concatenation one NHWC buffer
// Prints the median and p10-p90 of REPS calls (ms).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"

using namespace dnnl;
using tag = memory::format_tag;
using dt = memory::data_type;

namespace {
engine eng(engine::kind::cpu, 0);
stream strm(eng);

memory::desc md4(memory::dim n, memory::dim c, memory::dim h, memory::dim w, tag t) {
  return memory::desc({n, c, h, w}, dt::f32, t);
}

memory filled(const memory::desc& d, float v) {
  memory m(d, eng);
  float* p = static_cast<float*>(m.get_data_handle());
  const size_t n = d.get_size() / sizeof(float);
  for (size_t i = 0; i < n; ++i) p[i] = v * (1.f + 0.001f * static_cast<float>(i % 97));
  return m;
}

struct Conv {
  convolution_forward prim;
  memory w, b;
  memory::desc dst;
};

// conv [+ bias] [-> eltwise] [+ binary add of `add_md`] ; weights reordered once (prepacked)
Conv make_conv(const memory::desc& src, memory::dim O, memory::dim K, memory::dim S, memory::dim G,
               algorithm act, bool nchw, const memory::desc* add_md) {
  const auto d = src.get_dims();
  const memory::dim C = d[1], H = d[2], W = d[3], P = (K - 1) / 2;
  const memory::dim OH = (H + 2 * P - K) / S + 1, OW = (W + 2 * P - K) / S + 1;
  memory::desc wmd = G == 1 ? memory::desc({O, C, K, K}, dt::f32, tag::any)
                            : memory::desc({G, O / G, C / G, K, K}, dt::f32, tag::any);
  memory::desc dmd = md4(d[0], O, OH, OW, nchw ? tag::nchw : tag::any);
  memory::desc bmd({O}, dt::f32, tag::a);
  post_ops po;
  if (act == algorithm::eltwise_hardswish) po.append_eltwise(act, 1.f / 6.f, 0.5f);
  else if (act == algorithm::eltwise_relu) po.append_eltwise(act, 0.f, 0.f);
  if (add_md) po.append_binary(algorithm::binary_add, *add_md);
  primitive_attr attr;
  attr.set_post_ops(po);
  convolution_forward::primitive_desc pd(eng, prop_kind::forward_inference, algorithm::convolution_direct, src,
                                         wmd, bmd, dmd, {S, S}, {P, P}, {P, P}, attr);
  memory::desc uw = G == 1 ? memory::desc({O, C, K, K}, dt::f32, tag::oihw)
                           : memory::desc({G, O / G, C / G, K, K}, dt::f32, tag::goihw);
  memory wu = filled(uw, 0.01f), w(pd.weights_desc(), eng);
  reorder(wu, w).execute(strm, wu, w);
  return {convolution_forward(pd), w, filled(bmd, 0.1f), pd.dst_desc()};
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `warm` untimed calls of run(), then `reps` timed ones: {median, p10, p90} in ms.
struct Timing {
  double median, p10, p90;
};
template <class F>
Timing time_runs(F&& run, int warm, int reps) {
  for (int i = 0; i < warm; ++i) run();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_ms();
    run();
    t.push_back(now_ms() - t0);
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t[t.size() / 10], t[t.size() * 9 / 10]};
}

// ResNeXt's SE bottleneck: relu(SE(conv1x1(relu(gconv3x3(relu(conv1x1(x)))))) + [conv1x1_s(x)] x), NHWC inside.
int resnext(int argc, char** argv) {
  const memory::dim Cin = atoi(argv[2]), H = atoi(argv[3]), D = atoi(argv[4]), Cout = atoi(argv[5]),
                    G = atoi(argv[6]), S = atoi(argv[7]);
  const bool down = atoi(argv[8]) != 0;
  const int reps = argc > 9 ? atoi(argv[9]) : 300;
  const memory::dim OH = (H - 1) / S + 1, M = Cout / 16;
  memory::desc x_user = md4(1, Cin, H, H, tag::nchw), x_n = md4(1, Cin, H, H, tag::nhwc);
  memory x_u = filled(x_user, 0.5f), x_b(x_n, eng);
  Conv c1 = make_conv(x_n, D, 1, 1, 1, algorithm::eltwise_relu, false, nullptr);
  Conv c2 = make_conv(c1.dst, D, 3, S, G, algorithm::eltwise_relu, false, nullptr);
  Conv c3 = make_conv(c2.dst, Cout, 1, 1, 1, algorithm::undef, false, nullptr);
  Conv ds;
  if (down) ds = make_conv(x_n, Cout, 1, S, 1, algorithm::undef, false, nullptr);
  for (const auto* c : {&c1, &c2, &c3})
    if (!(c->dst.get_format_kind() == memory::format_kind::blocked) ||
        !(c->dst == md4(1, c->dst.get_dims()[1], c->dst.get_dims()[2], c->dst.get_dims()[3], tag::nhwc))) {
      std::fprintf(stderr, "a convolution's output is not NHWC\n");
      return 1;
    }
  memory t1(c1.dst, eng), t2(c2.dst, eng), t3(c3.dst, eng), r(down ? ds.dst : x_n, eng);
  memory y_n(md4(1, Cout, OH, OH, tag::nhwc), eng), y_u(md4(1, Cout, OH, OH, tag::nchw), eng);
  reorder rin(x_u, x_b), rout(y_n, y_u);
  std::vector<float> w1(M * Cout, 0.01f), b1(M, 0.1f), w2(Cout * M, 0.01f), b2(Cout, 0.1f), pooled(Cout), hid(M),
      gate(Cout);
  auto run = [&] {
    rin.execute(strm, x_u, x_b);
    c1.prim.execute(strm, {{DNNL_ARG_SRC, x_b}, {DNNL_ARG_WEIGHTS, c1.w}, {DNNL_ARG_BIAS, c1.b}, {DNNL_ARG_DST, t1}});
    c2.prim.execute(strm, {{DNNL_ARG_SRC, t1}, {DNNL_ARG_WEIGHTS, c2.w}, {DNNL_ARG_BIAS, c2.b}, {DNNL_ARG_DST, t2}});
    c3.prim.execute(strm, {{DNNL_ARG_SRC, t2}, {DNNL_ARG_WEIGHTS, c3.w}, {DNNL_ARG_BIAS, c3.b}, {DNNL_ARG_DST, t3}});
    if (down)
      ds.prim.execute(strm, {{DNNL_ARG_SRC, x_b}, {DNNL_ARG_WEIGHTS, ds.w}, {DNNL_ARG_BIAS, ds.b}, {DNNL_ARG_DST, r}});
    strm.wait();
    const float* t = static_cast<const float*>(t3.get_data_handle());
    const float* rr = static_cast<const float*>((down ? r : x_b).get_data_handle());
    float* y = static_cast<float*>(y_n.get_data_handle());
    const int64_t hw = OH * OH;
    std::fill(pooled.begin(), pooled.end(), 0.f);
    for (int64_t i = 0; i < hw; ++i)
      for (int64_t c = 0; c < Cout; ++c) pooled[c] += t[i * Cout + c];
    for (int64_t m = 0; m < M; ++m) {
      float a = b1[m];
      for (int64_t c = 0; c < Cout; ++c) a += w1[m * Cout + c] * pooled[c] / hw;
      hid[m] = a > 0 ? a : 0;
    }
    for (int64_t c = 0; c < Cout; ++c) {
      float a = b2[c];
      for (int64_t m = 0; m < M; ++m) a += w2[c * M + m] * hid[m];
      gate[c] = 1.f / (1.f + std::exp(-a));
    }
#pragma omp parallel for
    for (int64_t i = 0; i < hw; ++i)
      for (int64_t c = 0; c < Cout; ++c) {
        const float v = t[i * Cout + c] * gate[c] + rr[i * Cout + c];
        y[i * Cout + c] = v > 0 ? v : 0;
      }
    rout.execute(strm, y_n, y_u);
    strm.wait();
  };
  const Timing tt = time_runs(run, 20, reps);
  std::printf("resnext cin=%ld h=%ld width=%ld cout=%ld groups=%ld s=%ld down=%d: median %.4f ms [%.4f-%.4f]\n",
              (long)Cin, (long)H, (long)D, (long)Cout, (long)G, (long)S, down ? 1 : 0, tt.median, tt.p10, tt.p90);
  return 0;
}

// DenseNet's dense block: L layers of BN-ReLU -> 1x1 (4k) + BN-ReLU -> 3x3 (k), each appending k
// channels to one NHWC buffer (the concatenation is never copied); the pre-activation BN-ReLU has
// no oneDNN pre-op, so it is one pass into a scratch NHWC tensor per layer.
int densenet(int argc, char** argv) {
  const memory::dim C0 = atoi(argv[2]), H = atoi(argv[3]), L = atoi(argv[4]), k = 32, B = 4 * k;
  const int reps = argc > 5 ? atoi(argv[5]) : 100;
  const memory::dim Ct = C0 + L * k, HW = H * H;
  memory::desc x_user = md4(1, C0, H, H, tag::nchw);
  memory x_u = filled(x_user, 0.5f);
  memory cat(md4(1, Ct, H, H, tag::nhwc), eng), y_u(md4(1, Ct, H, H, tag::nchw), eng);
  auto slice = [&](memory::dim c0, memory::dim c) {  // channels [c0, c0 + c) of cat
    return cat.get_desc().submemory_desc({1, c, H, H}, {0, c0, 0, 0});
  };
  memory x_in(slice(0, C0), eng, cat.get_data_handle());
  reorder rin(x_u, x_in), rout(cat, y_u);
  std::vector<Conv> c1, c2;
  std::vector<memory> dst2;
  std::vector<std::vector<float>> sc, sh;
  memory tmp(md4(1, Ct, H, H, tag::nhwc), eng);
  memory t1(md4(1, B, H, H, tag::nhwc), eng);
  for (memory::dim l = 0; l < L; ++l) {
    const memory::dim Cin = C0 + l * k;
    c1.push_back(make_conv(md4(1, Cin, H, H, tag::nhwc), B, 1, 1, 1, algorithm::eltwise_relu, false, nullptr));
    // the 3x3 convolution's k channels are copied into the concatenation (a strided destination
    // gets oneDNN's reference kernel)
    memory::desc out = md4(1, k, H, H, tag::nhwc);
    memory::desc wmd({k, B, 3, 3}, dt::f32, tag::any), bmd({k}, dt::f32, tag::a);
    convolution_forward::primitive_desc pd(eng, prop_kind::forward_inference, algorithm::convolution_direct,
                                           md4(1, B, H, H, tag::nhwc), wmd, bmd, out, {1, 1}, {1, 1}, {1, 1});
    memory wu = filled(memory::desc({k, B, 3, 3}, dt::f32, tag::oihw), 0.01f), w(pd.weights_desc(), eng);
    reorder(wu, w).execute(strm, wu, w);
    c2.push_back({convolution_forward(pd), w, filled(bmd, 0.1f), out});
    dst2.emplace_back(out, eng);
    sc.emplace_back(Cin, 0.9f);
    sh.emplace_back(Cin, 0.1f);
    if (l == 0 || l == L - 1) std::printf("layer %ld 3x3 impl: %s\n", (long)l, pd.impl_info_str());
  }
  auto run = [&] {
    rin.execute(strm, x_u, x_in);
    strm.wait();
    for (memory::dim l = 0; l < L; ++l) {
      const memory::dim Cin = C0 + l * k;
      const float* src = static_cast<const float*>(cat.get_data_handle());
      memory tl(md4(1, Cin, H, H, tag::nhwc), eng, tmp.get_data_handle());
      float* dst = static_cast<float*>(tmp.get_data_handle());
      const float *s = sc[l].data(), *t = sh[l].data();
#pragma omp parallel for
      for (int64_t i = 0; i < HW; ++i)
        for (int64_t c = 0; c < Cin; ++c) {
          const float v = src[i * Ct + c] * s[c] + t[c];
          dst[i * Cin + c] = v > 0 ? v : 0;
        }
      c1[l].prim.execute(strm, {{DNNL_ARG_SRC, tl}, {DNNL_ARG_WEIGHTS, c1[l].w}, {DNNL_ARG_BIAS, c1[l].b},
                                {DNNL_ARG_DST, t1}});
      c2[l].prim.execute(strm, {{DNNL_ARG_SRC, t1}, {DNNL_ARG_WEIGHTS, c2[l].w}, {DNNL_ARG_BIAS, c2[l].b},
                                {DNNL_ARG_DST, dst2[l]}});
      strm.wait();
      const float* n = static_cast<const float*>(dst2[l].get_data_handle());
      float* catp = static_cast<float*>(cat.get_data_handle());
      for (int64_t i = 0; i < HW; ++i) std::memcpy(catp + i * Ct + Cin, n + i * k, k * sizeof(float));
    }
    rout.execute(strm, cat, y_u);
    strm.wait();
  };
  const Timing tt = time_runs(run, 5, reps);
  std::printf("densenet block c0=%ld h=%ld layers=%ld: median %.4f ms [%.4f-%.4f]\n", (long)C0, (long)H, (long)L,
              tt.median, tt.p10, tt.p90);
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  if (argc >= 9 && std::string(argv[1]) == "resnext") return resnext(argc, argv);
  if (argc >= 5 && std::string(argv[1]) == "densenet") return densenet(argc, argv);
  if (argc < 10) {
    std::fprintf(stderr, "usage: %s mbv3|mbv3-nchw CIN H EXP COUT K STRIDE SE ACT [REPS]\n", argv[0]);
    return 2;
  }
  const bool nchw = std::string(argv[1]) == "mbv3-nchw";
  const memory::dim Cin = atoi(argv[2]), H = atoi(argv[3]), E = atoi(argv[4]), Cout = atoi(argv[5]),
                    K = atoi(argv[6]), S = atoi(argv[7]);
  const bool se = atoi(argv[8]) != 0;
  const algorithm act = std::string(argv[9]) == "relu" ? algorithm::eltwise_relu : algorithm::eltwise_hardswish;
  const int reps = argc > 10 ? atoi(argv[10]) : 300;
  const bool expand = E != Cin, residual = Cin == Cout && S == 1;

  memory::desc x_user = md4(1, Cin, H, H, tag::nchw);
  memory x_u = filled(x_user, 0.5f);
  // the block's input layout: the expand conv's (or the depthwise conv's) preferred one
  Conv c1, c2, c3;
  memory::desc x_blk = x_user;
  if (!nchw) {
    // ask the first conv for its preferred src layout
    memory::desc any = md4(1, Cin, H, H, tag::any);
    convolution_forward::primitive_desc pd(
        eng, prop_kind::forward_inference, algorithm::convolution_direct, any,
        memory::desc({expand ? E : Cin, Cin, 1, 1}, dt::f32, tag::any), memory::desc(),
        md4(1, expand ? E : Cin, H, H, tag::any), {1, 1}, {0, 0}, {0, 0});
    x_blk = pd.src_desc();
    if (!expand) x_blk = md4(1, Cin, H, H, Cin % 16 == 0 ? tag::nChw16c : tag::nChw8c);
  }
  memory x_b(x_blk, eng);
  memory::desc cur = x_blk;
  if (expand) {
    c1 = make_conv(cur, E, 1, 1, 1, act, nchw, nullptr);
    cur = c1.dst;
  }
  c2 = make_conv(cur, E, K, S, E, act, nchw, nullptr);
  memory t1 = expand ? memory(c1.dst, eng) : memory(), t2(c2.dst, eng);
  // SE on t2: global average pool -> (1, E); fc1 + relu; fc2 + hard-sigmoid; scale t2 in place
  const memory::dim M = ((E / 4 + 7) / 8) * 8;
  const auto od = c2.dst.get_dims();
  memory::desc pooled_md = md4(1, E, 1, 1, tag::nchw);
  inner_product_forward fc1, fc2;
  binary scale;
  memory pooled, h1, gate, w1, b1, w2, b2;
  if (se) {
    if (!(c2.dst == md4(1, E, od[2], od[3], tag::nhwc))) { std::fprintf(stderr, "depthwise output not NHWC\n"); return 1; }
    pooled = memory(pooled_md, eng);
    memory::desc in2({1, E}, dt::f32, tag::nc), mid({1, M}, dt::f32, tag::nc);
    post_ops p1, p2;
    p1.append_eltwise(algorithm::eltwise_relu, 0.f, 0.f);
    p2.append_eltwise(algorithm::eltwise_hardsigmoid, 1.f / 6.f, 0.5f);
    primitive_attr a1, a2;
    a1.set_post_ops(p1);
    a2.set_post_ops(p2);
    inner_product_forward::primitive_desc f1(eng, prop_kind::forward_inference, in2,
                                              memory::desc({M, E}, dt::f32, tag::oi), memory::desc({M}, dt::f32, tag::a),
                                              mid, a1);
    inner_product_forward::primitive_desc f2(eng, prop_kind::forward_inference, mid,
                                              memory::desc({E, M}, dt::f32, tag::oi), memory::desc({E}, dt::f32, tag::a),
                                              in2, a2);
    fc1 = inner_product_forward(f1);
    fc2 = inner_product_forward(f2);
    w1 = filled(f1.weights_desc(), 0.01f);
    b1 = filled(f1.bias_desc(), 0.1f);
    w2 = filled(f2.weights_desc(), 0.01f);
    b2 = filled(f2.bias_desc(), 0.1f);
    h1 = memory(mid, eng);
    gate = memory(md4(1, E, 1, 1, tag::nchw), eng);
    scale = binary(binary::primitive_desc(eng, algorithm::binary_mul, c2.dst, md4(1, E, 1, 1, tag::nchw), c2.dst));
  }
  c3 = make_conv(c2.dst, Cout, 1, 1, 1, algorithm::undef, nchw, residual ? &x_blk : nullptr);
  memory y_b(c3.dst, eng), y_u(md4(1, Cout, (H + 2 * ((K - 1) / 2) - K) / S + 1, (H + 2 * ((K - 1) / 2) - K) / S + 1, tag::nchw), eng);
  const bool r_in = !(x_blk == x_user), r_out = !(c3.dst == y_u.get_desc());
  reorder rin = r_in ? reorder(x_u, x_b) : reorder(), rout = r_out ? reorder(y_b, y_u) : reorder();

  auto run = [&] {
    memory& xin = r_in ? x_b : x_u;
    if (r_in) rin.execute(strm, x_u, x_b);
    if (expand)
      c1.prim.execute(strm, {{DNNL_ARG_SRC, xin}, {DNNL_ARG_WEIGHTS, c1.w}, {DNNL_ARG_BIAS, c1.b}, {DNNL_ARG_DST, t1}});
    c2.prim.execute(strm, {{DNNL_ARG_SRC, expand ? t1 : xin}, {DNNL_ARG_WEIGHTS, c2.w}, {DNNL_ARG_BIAS, c2.b},
                           {DNNL_ARG_DST, t2}});
    if (se) {
      {  // global average pool of the NHWC (acdb) tensor: oneDNN's pooling/reduction for it is the reference loop
        const float* src = static_cast<const float*>(t2.get_data_handle());
        float* dst = static_cast<float*>(pooled.get_data_handle());
        const int64_t hw = od[2] * od[3];
        std::fill(dst, dst + E, 0.f);
        for (int64_t i = 0; i < hw; ++i)
          for (int64_t c = 0; c < E; ++c) dst[c] += src[i * E + c];
        for (int64_t c = 0; c < E; ++c) dst[c] /= static_cast<float>(hw);
      }
      memory p2d(memory::desc({1, E}, dt::f32, tag::nc), eng, pooled.get_data_handle());
      memory g2d(memory::desc({1, E}, dt::f32, tag::nc), eng, gate.get_data_handle());
      fc1.execute(strm, {{DNNL_ARG_SRC, p2d}, {DNNL_ARG_WEIGHTS, w1}, {DNNL_ARG_BIAS, b1}, {DNNL_ARG_DST, h1}});
      fc2.execute(strm, {{DNNL_ARG_SRC, h1}, {DNNL_ARG_WEIGHTS, w2}, {DNNL_ARG_BIAS, b2}, {DNNL_ARG_DST, g2d}});
      scale.execute(strm, {{DNNL_ARG_SRC_0, t2}, {DNNL_ARG_SRC_1, gate}, {DNNL_ARG_DST, t2}});
    }
    std::unordered_map<int, memory> a3 = {
        {DNNL_ARG_SRC, t2}, {DNNL_ARG_WEIGHTS, c3.w}, {DNNL_ARG_BIAS, c3.b}, {DNNL_ARG_DST, r_out ? y_b : y_u}};
    if (residual) a3[DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1] = xin;
    c3.prim.execute(strm, a3);
    if (r_out) rout.execute(strm, y_b, y_u);
    strm.wait();
  };
  const Timing t = time_runs(run, 20, reps);
  std::printf("%s cin=%ld h=%ld exp=%ld cout=%ld k=%ld s=%ld se=%d %s: median %.4f ms [%.4f-%.4f]\n", argv[1],
              (long)Cin, (long)H, (long)E, (long)Cout, (long)K, (long)S, se ? 1 : 0, argv[9], t.median, t.p10,
              t.p90);
  return 0;
}
