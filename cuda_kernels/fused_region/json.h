// A strict JSON reader for fused_region's `program` attribute.
//
// lib_api.h's JsonVal cannot be used: it reads numbers as unsigned integers (no sign, no fraction,
// no exponent: an eps of 1e-5 or a clip bound of -1 would be lost) and has no null/true/false.
// This one reads RFC 8259 JSON into a small tree and fails with a one-line message naming the
// character position.  Objects keep their keys in order (duplicates are an error).
#pragma once

#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace mxf {
namespace json {

struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  double num = 0;
  bool integral = false;  // written without fraction or exponent (an integer in the text)
  std::string str;
  std::vector<Value> arr;
  std::vector<std::pair<std::string, Value>> obj;

  const Value* find(const std::string& key) const {
    for (const auto& kv : obj)
      if (kv.first == key) return &kv.second;
    return nullptr;
  }
  static const char* kind_name(Kind k) {
    static const char* names[] = {"null", "a boolean", "a number", "a string", "a list", "an object"};
    return names[k];
  }
};

class Reader {
 public:
  explicit Reader(const std::string& text) : s_(text) {}

  Value document() {
    Value v = value(0);
    ws();
    if (i_ != s_.size()) fail("unexpected text after the end of the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw std::runtime_error("program is not valid JSON at character " + std::to_string(i_) + ": " + why);
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool literal(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(i_, n, word) != 0) return false;
    i_ += n;
    return true;
  }
  Value value(int depth) {
    if (depth > 64) fail("nested too deeply");
    ws();
    if (i_ >= s_.size()) fail("a value is missing");
    Value v;
    const char c = s_[i_];
    if (c == '{') {
      v.kind = Value::Object;
      ++i_;
      ws();
      if (i_ < s_.size() && s_[i_] == '}') return ++i_, v;
      while (true) {
        ws();
        if (i_ >= s_.size() || s_[i_] != '"') fail("an object key (a string) is expected");
        std::string key = string();
        if (v.find(key)) fail("the key '" + key + "' appears twice");
        ws();
        if (i_ >= s_.size() || s_[i_] != ':') fail("':' is expected after a key");
        ++i_;
        v.obj.emplace_back(key, value(depth + 1));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
        if (i_ < s_.size() && s_[i_] == '}') { ++i_; return v; }
        fail("',' or '}' is expected in an object");
      }
    }
    if (c == '[') {
      v.kind = Value::Array;
      ++i_;
      ws();
      if (i_ < s_.size() && s_[i_] == ']') return ++i_, v;
      while (true) {
        v.arr.push_back(value(depth + 1));
        ws();
        if (i_ < s_.size() && s_[i_] == ',') { ++i_; continue; }
        if (i_ < s_.size() && s_[i_] == ']') { ++i_; return v; }
        fail("',' or ']' is expected in a list");
      }
    }
    if (c == '"') {
      v.kind = Value::String;
      v.str = string();
      return v;
    }
    if (literal("null")) return v;
    if (literal("true")) { v.kind = Value::Bool; v.b = true; return v; }
    if (literal("false")) { v.kind = Value::Bool; return v; }
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail(std::string("unexpected character '") + c + "'");
  }
  Value number() {
    const size_t start = i_;
    bool integral = true;
    if (s_[i_] == '-') ++i_;
    auto digits = [&] {
      size_t d = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == d) fail("a digit is expected in a number");
    };
    digits();
    if (i_ < s_.size() && s_[i_] == '.') { ++i_; integral = false; digits(); }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      integral = false;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    Value v;
    v.kind = Value::Number;
    v.integral = integral;
    v.num = std::strtod(s_.substr(start, i_ - start).c_str(), nullptr);
    return v;
  }
  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("a string is not closed");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character inside a string");
      if (c != '\\') { out += c; continue; }
      if (i_ >= s_.size()) fail("a string is not closed");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {  // the program's strings are ASCII names; a \u escape is kept as '?'
          if (i_ + 4 > s_.size()) fail("a \\u escape needs four hex digits");
          i_ += 4;
          out += '?';
          break;
        }
        default: fail(std::string("unknown escape '\\") + e + "'");
      }
    }
  }

  const std::string& s_;
  size_t i_ = 0;
};

inline Value parse(const std::string& text) { return Reader(text).document(); }

}  // namespace json
}  // namespace mxf
