// ResNet-50 v1's body (stem, max pooling, 16 bottleneck blocks) run by oneDNN 3.x alone, activations
// kept in the layout oneDNN picks ("any": blocked nChw8c on AVX2) or forced ("nhwc", "8c"), BatchNorm
// assumed folded (bias), ReLU and the residual add as post-ops (sum), weights prepacked: the best a
// library op running a whole backbone could do, to set beside MXNet's default bind of the same network
// (its convolutions' time: ONEDNN_VERBOSE=1 / MKLDNN_VERBOSE=1 sums).  On the 2-core AVX2 EPYC:
// "any" 48.8-51.5 ms, "nhwc" (brgconv:avx2) 80 ms, against 46.2 ms of MXNet's own convolutions.
//
//   g++ -O2 -fopenmp -std=c++17 -I.venv/include -o /tmp/resnet_body_dnnl benchmarks/resnet_body_dnnl.cc \
//       .venv/lib/libdnnl.so.3 -Wl,-rpath,$PWD/.venv/lib
//   OMP_NUM_THREADS=2 /tmp/resnet_body_dnnl any|nhwc|8c [REPS]      (SHOW=1: each convolution's implementation)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <cstring>
#include <unordered_map>
#include <vector>
#include "oneapi/dnnl/dnnl.hpp"
using namespace dnnl;
using tag = memory::format_tag;
using dt = memory::data_type;
engine eng(engine::kind::cpu, 0);
stream strm(eng);
tag T = tag::any;
struct Conv { convolution_forward prim; memory w, b; memory::desc dst; };
Conv mk(const memory::desc& src, memory::dim O, memory::dim K, memory::dim S, bool relu, bool sum, const char* dtag=nullptr) {
  auto d = src.get_dims(); memory::dim C=d[1],H=d[2],W=d[3],P=(K-1)/2;
  memory::dim OH=(H+2*P-K)/S+1, OW=(W+2*P-K)/S+1;
  memory::desc wmd({O,C,K,K}, dt::f32, tag::any), dmd({d[0],O,OH,OW}, dt::f32, C==3? tag::any: T), bmd({O},dt::f32,tag::a);
  post_ops po; if (sum) po.append_sum(1.f); if (relu) po.append_eltwise(algorithm::eltwise_relu,0,0);
  primitive_attr a; a.set_post_ops(po);
  convolution_forward::primitive_desc pd(eng, prop_kind::forward_inference, algorithm::convolution_direct, src, wmd, bmd, dmd, {S,S},{P,P},{P,P},a);
  memory w(pd.weights_desc(), eng); memset(w.get_data_handle(), 0, pd.weights_desc().get_size());
  memory b(bmd, eng); memset(b.get_data_handle(),0,O*4);
  if(getenv("SHOW")) fprintf(stderr,"impl %s K%ld C%ld O%ld\n", pd.impl_info_str(),(long)K,(long)C,(long)O);
  return {convolution_forward(pd), w, b, pd.dst_desc()};
}
int main(int argc, char** argv) {
  if (argc>1 && std::string(argv[1])=="nhwc") T=tag::nhwc;
  if (argc>1 && std::string(argv[1])=="8c") T=tag::nChw8c;
  int reps = argc>2?atoi(argv[2]):30;
  std::vector<std::pair<primitive, std::unordered_map<int,memory>>> seq;
  memory::desc x({1,3,224,224}, dt::f32, tag::nchw);
  memory xm(x, eng);
  Conv stem = mk(x, 64, 7, 2, true, false);
  memory s(stem.dst, eng);
  seq.push_back({stem.prim, {{DNNL_ARG_SRC,xm},{DNNL_ARG_WEIGHTS,stem.w},{DNNL_ARG_BIAS,stem.b},{DNNL_ARG_DST,s}}});
  // max pool 3x3 s2 p1
  memory::desc pdst({1,64,56,56}, dt::f32, T==tag::any? tag::any: T);
  pooling_forward::primitive_desc ppd(eng, prop_kind::forward_inference, algorithm::pooling_max, stem.dst, pdst.get_format_kind()==memory::format_kind::any? memory::desc({1,64,56,56},dt::f32,tag::any):pdst, {2,2},{3,3},{0,0},{1,1},{1,1});
  memory cur(ppd.dst_desc(), eng);
  seq.push_back({pooling_forward(ppd), {{DNNL_ARG_SRC,s},{DNNL_ARG_DST,cur}}});
  int nb[4]={3,4,6,3}, wd[4]={64,128,256,512};
  for (int st=0; st<4; ++st) for (int b=0;b<nb[st];++b) {
    memory::dim S = (b==0 && st>0)?2:1, Wd=wd[st], Co=4*Wd;
    Conv c1=mk(cur.get_desc(), Wd,1,1,true,false);
    Conv c2=mk(c1.dst, Wd,3,S,true,false);
    Conv c3=mk(c2.dst, Co,1,1,true,true);
    memory t1(c1.dst,eng), t2(c2.dst,eng), out(c3.dst,eng);
    seq.push_back({c1.prim,{{DNNL_ARG_SRC,cur},{DNNL_ARG_WEIGHTS,c1.w},{DNNL_ARG_BIAS,c1.b},{DNNL_ARG_DST,t1}}});
    seq.push_back({c2.prim,{{DNNL_ARG_SRC,t1},{DNNL_ARG_WEIGHTS,c2.w},{DNNL_ARG_BIAS,c2.b},{DNNL_ARG_DST,t2}}});
    if (b==0) { Conv ds=mk(cur.get_desc(), Co,1,S,false,false);
      if (!(ds.dst==c3.dst)) { fprintf(stderr,"ds layout differs\n"); }
      seq.push_back({ds.prim,{{DNNL_ARG_SRC,cur},{DNNL_ARG_WEIGHTS,ds.w},{DNNL_ARG_BIAS,ds.b},{DNNL_ARG_DST,out}}});
    } else {
      seq.push_back({reorder(cur,out),{{DNNL_ARG_FROM,cur},{DNNL_ARG_TO,out}}});
    }
    seq.push_back({c3.prim,{{DNNL_ARG_SRC,t2},{DNNL_ARG_WEIGHTS,c3.w},{DNNL_ARG_BIAS,c3.b},{DNNL_ARG_DST,out}}});
    cur = out;
  }
  std::vector<double> t;
  for (int i=0;i<reps+5;++i){ auto t0=std::chrono::steady_clock::now(); for(auto&p:seq) p.first.execute(strm,p.second); strm.wait();
    if(i>=5) t.push_back(std::chrono::duration<double,std::milli>(std::chrono::steady_clock::now()-t0).count()); }
  std::sort(t.begin(),t.end());
  printf("%s resnet50 body: median %.2f ms [%.2f-%.2f]\n", argc>1?argv[1]:"any", t[t.size()/2], t[t.size()/10], t[t.size()*9/10]);
}
