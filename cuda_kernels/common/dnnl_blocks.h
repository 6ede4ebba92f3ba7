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

#include "dnnl_api.h"

namespace mxf {

// MXFUSION_NO_DNNL_CONV=1: the block ops run their direct loops (a test switch).
inline bool dnnl_conv_disabled() {
  const char* off = std::getenv("MXFUSION_NO_DNNL_CONV");
  return off && *off && std::string(off) != "0";
}

// A block per input shape (the key), built on the shape's first call by Block::create(params,
// geometry); null where oneDNN is missing or switched off, where it could not be built, or past
// kMax shapes: the op then runs its direct loops.
template <class Block>
class BlockCache {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t>;

  template <class Params, class Geometry>
  Block* get(const Key& key, const Params& p, const Geometry& g) {
    if (dnnl_conv_disabled() || !dnnl().engine) return nullptr;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) {
      if (blocks_.size() >= kMax) return nullptr;
      auto made = std::make_unique<Block>();
      if (!made->create(p, g)) made.reset();
      it = blocks_.emplace(key, std::move(made)).first;
    }
    return it->second.get();
  }

 private:
  static constexpr size_t kMax = 16;
  std::mutex mu_;
  std::map<Key, std::unique_ptr<Block>> blocks_;
};

}  // namespace mxf
