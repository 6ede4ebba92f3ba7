// Error messages handed to MXNet, one failure at a time.
//
// MXNet 1.9.1 reads a library's errors through two C entry points, `_msgSize` and
// `_msgGet`, right after a call into the library fails, and puts every message it gets
// into the MXNetError it raises.  lib_api.cc's own store (`MXerrorMsgs`) never forgets a
// message and allocates a new string on each read, so with it every failure repeats all
// the earlier ones (the 1000th failed shape inference raises an error a thousand
// messages long) and a process that tries many shapes grows without bound.
//
// The library therefore exports its own pair (lib_api.cc is compiled with its pair
// renamed out of the way, see fusion/native/library.py): the messages of one failure are
// handed over, and dropped when the next failure reports (those lib_api.cc itself
// adds included).
#include <mutex>
#include <string>
#include <vector>

#include "mxf_common.h"

namespace {

// The messages of the failure being reported.  MXNet asks for their count more than once
// while it reads them, so a batch stays until a new message arrives after it was read.
struct Store {
  std::mutex mu;
  std::vector<std::string> messages;
  bool read = false;        // MXNet has asked for this batch
  int lib_api_seen = 0;     // lib_api.cc's messages already taken over

  void add(std::string msg) {
    if (read) {
      messages.clear();
      read = false;
    }
    messages.push_back(std::move(msg));
  }
};

Store& store() {
  static Store* s = new Store();   // never destroyed: MXNet may ask during its own shutdown
  return *s;
}

}  // namespace

namespace mxf {

void report_error(const std::string& msg) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  s.add(msg);
}

}  // namespace mxf

extern "C" {

MX_INT_RET _msgSize() {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  mxnet::ext::MXerrorMsgs* lib_api = mxnet::ext::MXerrorMsgs::get();
  int n = lib_api->size();
  for (int i = s.lib_api_seen; i < n; ++i) {
    const std::string* m = lib_api->get(i);   // a copy it allocates for the caller
    s.add(*m);
    delete m;
  }
  s.lib_api_seen = n;
  s.read = true;
  return static_cast<int>(s.messages.size());
}

MX_VOID_RET _msgGet(int idx, const char** msg) {
  Store& s = store();
  std::lock_guard<std::mutex> lock(s.mu);
  *msg = (idx >= 0 && idx < static_cast<int>(s.messages.size())) ? s.messages[idx].c_str() : "";
}

}  // extern "C"
