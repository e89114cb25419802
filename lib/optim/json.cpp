#include "json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "swapopt/core/error.h"

namespace swapopt::json {

Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::boolean;
  v.bool_ = b;
  return v;
}
Value Value::number(double d) {
  Value v;
  v.kind_ = Kind::number;
  v.number_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::string;
  v.string_ = std::move(s);
  return v;
}
Value Value::array(std::vector<Value> items) {
  Value v;
  v.kind_ = Kind::array;
  v.array_ = std::move(items);
  return v;
}
Value Value::object(std::map<std::string, Value> members) {
  Value v;
  v.kind_ = Kind::object;
  v.object_ = std::move(members);
  return v;
}

namespace {
[[noreturn]] void wrong_kind(const std::string& what, const char* kind) {
  SWAPOPT_FAIL("[checkpoint] metadata: " << what << " must be " << kind);
}
}  // namespace

bool Value::as_bool(const std::string& what) const {
  if (kind_ != Kind::boolean) wrong_kind(what, "a boolean");
  return bool_;
}
double Value::as_number(const std::string& what) const {
  if (kind_ != Kind::number) wrong_kind(what, "a number");
  return number_;
}
int64_t Value::as_int(const std::string& what) const {
  const double d = as_number(what);
  if (!(d >= -9007199254740992.0 && d <= 9007199254740992.0) || d != std::floor(d)) wrong_kind(what, "an integer");
  return int64_t(d);
}
const std::string& Value::as_string(const std::string& what) const {
  if (kind_ != Kind::string) wrong_kind(what, "a string");
  return string_;
}
const std::vector<Value>& Value::as_array(const std::string& what) const {
  if (kind_ != Kind::array) wrong_kind(what, "an array");
  return array_;
}
const std::map<std::string, Value>& Value::as_object(const std::string& what) const {
  if (kind_ != Kind::object) wrong_kind(what, "an object");
  return object_;
}
const Value& Value::at(const std::string& key, const std::string& what) const {
  const auto& members = as_object(what);
  const auto it = members.find(key);
  SWAPOPT_CHECK(it != members.end(), "[checkpoint] metadata: " << what << " has no '" << key << "'");
  return it->second;
}
bool Value::contains(const std::string& key) const { return kind_ == Kind::object && object_.count(key) != 0; }

namespace {

void dump_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  out += '"';
}

void dump_value(const Value& v, std::string& out) {
  switch (v.kind()) {
    case Value::Kind::null: out += "null"; break;
    case Value::Kind::boolean: out += v.as_bool("") ? "true" : "false"; break;
    case Value::Kind::number: {
      const double d = v.as_number("");
      SWAPOPT_CHECK(std::isfinite(d), "[json] cannot write the non-finite number " << d);
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", d);
      out += buf;
      break;
    }
    case Value::Kind::string: dump_string(v.as_string(""), out); break;
    case Value::Kind::array: {
      out += '[';
      bool first = true;
      for (const Value& item : v.as_array("")) {
        if (!first) out += ',';
        first = false;
        dump_value(item, out);
      }
      out += ']';
      break;
    }
    case Value::Kind::object: {
      out += '{';
      bool first = true;
      for (const auto& [key, item] : v.as_object("")) {
        if (!first) out += ',';
        first = false;
        dump_string(key, out);
        out += ':';
        dump_value(item, out);
      }
      out += '}';
      break;
    }
  }
}

constexpr int kMaxDepth = 64;

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  Value document() {
    Value v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("trailing bytes");
    return v;
  }

 private:
  [[noreturn]] void fail(const char* why) { SWAPOPT_FAIL("[checkpoint] bad JSON at byte " << pos_ << ": " << why); }

  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' || text_[pos_] == '\r' || text_[pos_] == '\t'))
      ++pos_;
  }

  bool take(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }

  bool take_word(std::string_view word) {
    if (text_.substr(pos_, word.size()) == word) {
      pos_ += word.size();
      return true;
    }
    return false;
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nesting too deep");
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end");
    const char c = text_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return Value::string(string());
    if (take_word("true")) return Value::boolean(true);
    if (take_word("false")) return Value::boolean(false);
    if (take_word("null")) return Value();
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    fail("unexpected character");
  }

  Value object(int depth) {
    ++pos_;  // '{'
    std::map<std::string, Value> members;
    if (take('}')) return Value::object(std::move(members));
    do {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] != '"') fail("expected a key");
      std::string key = string();
      if (!take(':')) fail("expected ':'");
      if (members.count(key)) fail("duplicate key");
      members.emplace(std::move(key), value(depth + 1));
    } while (take(','));
    if (!take('}')) fail("expected '}'");
    return Value::object(std::move(members));
  }

  Value array(int depth) {
    ++pos_;  // '['
    std::vector<Value> items;
    if (take(']')) return Value::array(std::move(items));
    do {
      items.push_back(value(depth + 1));
    } while (take(','));
    if (!take(']')) fail("expected ']'");
    return Value::array(std::move(items));
  }

  std::string string() {
    ++pos_;  // '"'
    std::string out;
    while (pos_ < text_.size()) {
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) break;
      const char e = text_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (pos_ + 4 > text_.size()) fail("short \\u escape");
          unsigned code = 0;
          for (int i = 0; i < 4; ++i) {
            const char h = text_[pos_++];
            code <<= 4;
            if (h >= '0' && h <= '9') code |= unsigned(h - '0');
            else if (h >= 'a' && h <= 'f') code |= unsigned(h - 'a' + 10);
            else if (h >= 'A' && h <= 'F') code |= unsigned(h - 'A' + 10);
            else fail("bad \\u escape");
          }
          if (code >= 0x80) fail("non-ASCII \\u escape");  // metadata is ASCII
          out += char(code);
          break;
        }
        default: fail("bad escape");
      }
    }
    fail("unterminated string");
  }

  Value number() {
    const size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ > from;
    };
    if (!digits()) fail("bad number");
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      if (!digits()) fail("bad number");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (!digits()) fail("bad number");
    }
    const std::string literal(text_.substr(start, pos_ - start));
    const double d = std::strtod(literal.c_str(), nullptr);
    if (!std::isfinite(d)) fail("number out of range");
    return Value::number(d);
  }

  std::string_view text_;
  size_t pos_ = 0;
};

}  // namespace

std::string Value::dump() const {
  std::string out;
  dump_value(*this, out);
  return out;
}

Value parse(std::string_view text) { return Parser(text).document(); }

}  // namespace swapopt::json
