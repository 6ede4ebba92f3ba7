// The oneDNN 3.x "blocks" of the CNN block ops (fused_inverted_residual, fused_dense_block):
// primitives and packed weights built for one input shape, kept in the op's state.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "dnnl_api.h"

#define MXF_OK(call) ((call) == dnnl_success)

namespace mxf {

// MXFUSION_NO_DNNL_CONV=1: the block ops run their direct loops (a test switch).
inline bool dnnl_conv_disabled() {
  const char* off = std::getenv("MXFUSION_NO_DNNL_CONV");
  return off && *off && std::string(off) != "0";
}

// The oneDNN objects a block owns (destroyed with it), and the calls that create them: memory
// descriptors (by tag or strides), memories, primitives, and reorders (none where two layouts
// agree).  Every create returns null on failure.
struct DnnlObjects {
  const DnnlApi& api = dnnl();
  std::vector<dnnl_memory_desc_t> mds;
  std::vector<dnnl_primitive_desc_t> pds;
  std::vector<dnnl_primitive_t> prims;
  std::vector<dnnl_memory_t> mems;

  DnnlObjects() = default;
  DnnlObjects(const DnnlObjects&) = delete;
  DnnlObjects& operator=(const DnnlObjects&) = delete;
  ~DnnlObjects() {
    for (auto p : prims) api.dnnl_primitive_destroy(p);
    for (auto p : pds) api.dnnl_primitive_desc_destroy(p);
    for (auto m : mems) api.dnnl_memory_destroy(m);
    for (auto m : mds) api.dnnl_memory_desc_destroy(m);
  }
  const_dnnl_memory_desc_t md(int nd, const dnnl_dims_t d, dnnl_format_tag_t tag, dnnl_data_type_t dt = dnnl_f32) {
    dnnl_memory_desc_t m = nullptr;
    if (!MXF_OK(api.dnnl_memory_desc_create_with_tag(&m, nd, d, dt, tag))) return nullptr;
    mds.push_back(m);
    return m;
  }
  const_dnnl_memory_desc_t strided(const dnnl_dims_t d, const dnnl_dims_t st) {
    dnnl_memory_desc_t m = nullptr;
    if (!MXF_OK(api.dnnl_memory_desc_create_with_strides(&m, 4, d, dnnl_f32, st))) return nullptr;
    mds.push_back(m);
    return m;
  }
  dnnl_memory_t mem(const_dnnl_memory_desc_t d, void* handle) {
    dnnl_memory_t m = nullptr;
    if (!d || !MXF_OK(api.dnnl_memory_create(&m, d, api.engine, handle))) return nullptr;
    mems.push_back(m);
    return m;
  }
  // a primitive of `pd`; null where oneDNN has only its reference code for it (dnnl_reference_impl:
  // the op then takes another layout or its direct loops), unless `reference_ok` (reorders)
  dnnl_primitive_t prim(dnnl_primitive_desc_t pd, bool reference_ok = false) {
    dnnl_primitive_t p = nullptr;
    if (!pd || (!reference_ok && dnnl_reference_impl(pd))) return nullptr;
    if (!MXF_OK(api.dnnl_primitive_create(&p, pd))) return nullptr;
    prims.push_back(p);
    return p;
  }
  // reorder from -> to; *out stays null when the layouts agree (no primitive needed)
  bool reorder(const_dnnl_memory_desc_t from, const_dnnl_memory_desc_t to, dnnl_primitive_t* out) {
    *out = nullptr;
    if (api.dnnl_memory_desc_equal(from, to)) return true;
    dnnl_primitive_desc_t pd = nullptr;
    if (!MXF_OK(api.dnnl_reorder_primitive_desc_create(&pd, from, api.engine, to, api.engine, nullptr))) return false;
    pds.push_back(pd);
    *out = prim(pd, true);
    return *out != nullptr;
  }
};

// A block per input shape (the key), built on the shape's first call by Block::create(params,
// geometry); null where oneDNN is missing or switched off, where it could not be built, or past
// kMax shapes: the op then runs its direct loops.  An op whose only path is its block (fused_region)
// calls get_or_throw() instead, and keys its blocks by whatever identifies a build (Key).
template <class Block, class Key = std::tuple<int64_t, int64_t, int64_t, int64_t>>
class BlockCache {
 public:
  static constexpr size_t kMax = 16;

  template <class Params, class Geometry>
  Block* get(const Key& key, const Params& p, const Geometry& g) {
    if (dnnl_conv_disabled() || !dnnl().engine) return nullptr;
    return find_or_build(key, [&](Block& b) { return b.create(p, g); });
  }

  // The block of `key`, built by Block::create(p, g), which throws where it cannot build (the
  // exception reaches the caller and nothing is cached, so a later call tries again).
  // MXFUSION_NO_DNNL_CONV does not apply (there are no direct loops to switch to); null past kMax
  // shapes.
  template <class Params, class Geometry>
  Block* get_or_throw(const Key& key, const Params& p, const Geometry& g) {
    return find_or_build(key, [&](Block& b) { b.create(p, g); return true; });
  }

 private:
  template <class Build>
  Block* find_or_build(const Key& key, Build build) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) {
      if (blocks_.size() >= kMax) return nullptr;
      auto made = std::make_unique<Block>();
      if (!build(*made)) made.reset();  // a failed build is remembered: the op's direct loops run
      it = blocks_.emplace(key, std::move(made)).first;
    }
    return it->second.get();
  }

  std::mutex mu_;
  std::map<Key, std::unique_ptr<Block>> blocks_;
};

}  // namespace mxf
