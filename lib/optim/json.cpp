#include "json.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "../core/comma_list.h"
#include "swapopt/core/error.h"

namespace swapopt::json {

namespace {

constexpr int kMaxDepth = 64;

/** What an error names: "metadata" for the whole of it, else "metadata: <what>" (the part). */
std::string subject(const std::string& what) { return what == "metadata" ? what : "metadata: " + what; }

[[noreturn]] void wrong_kind(const std::string& what, const char* kind) {
  SWAPOPT_FAIL("[checkpoint] " << subject(what) << " must be " << kind);
}

/** nlohmann's message without its "[json.exception.parse_error.101] " prefix and, for a parse
 *  error, without "parse error at line 1, column 2: " (the caller gives the byte offset). */
std::string reason_of(const nlohmann::json::exception& e) {
  std::string text = e.what();
  const size_t bracket = text.find("] ");
  if (text.rfind("[json.exception.", 0) == 0 && bracket != std::string::npos) text = text.substr(bracket + 2);
  if (text.rfind("parse error", 0) == 0) {
    const size_t colon = text.find(": ");
    if (colon != std::string::npos) text = text.substr(colon + 2);
  }
  return text;
}

/** A first pass over the text that only checks what nlohmann accepts and a checkpoint must not:
 *  nesting deeper than kMaxDepth and a key twice in one object (nlohmann keeps the last). A SAX
 *  pass, not a parser callback: with a callback nlohmann 3.11 rescans an object's siblings each
 *  time one closes, quadratic in the tensor count of a header. */
class BoundsCheck final : public nlohmann::json_sax<Value> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open(); }
  bool key(string_t& key) override {
    SWAPOPT_CHECK(open_.back().insert(key).second, "[checkpoint] bad JSON: duplicate key '" << key << "'");
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(); }
  bool end_array() override { return close(); }
  /** A syntax error: stop here; the parse that follows reports it with its byte offset. */
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  bool open() {
    SWAPOPT_CHECK(open_.size() < size_t(kMaxDepth), "[checkpoint] bad JSON: nesting deeper than " << kMaxDepth << " levels");
    open_.emplace_back();
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }
  std::vector<std::set<std::string>> open_;  // the keys of each open object (empty for arrays)
};

}  // namespace

Value parse(std::string_view text) {
  try {
    BoundsCheck bounds;
    Value::sax_parse(text.begin(), text.end(), &bounds);
    return Value::parse(text.begin(), text.end());
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte counts the bytes read, the offending one included: report its 0-based offset.
    SWAPOPT_FAIL("[checkpoint] bad JSON at byte " << (e.byte > 0 ? e.byte - 1 : 0) << ": " << reason_of(e));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number out of a double's range
    SWAPOPT_FAIL("[checkpoint] bad JSON: " << reason_of(e));
  }
}

std::string dump(const Value& v, const std::string& what) {
  try {
    return v.dump();
  } catch (const nlohmann::json::type_error& e) {
    SWAPOPT_FAIL("[checkpoint] cannot write " << what << ": " << reason_of(e));
  }
}

bool is_utf8(const std::string& text) {
  try {
    (void)Value(text).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

bool get_bool(const Value& v, const std::string& what) {
  if (!v.is_boolean()) wrong_kind(what, "a boolean");
  return v.get<bool>();
}

double get_number(const Value& v, const std::string& what) {
  if (!v.is_number()) wrong_kind(what, "a number");
  return v.get<double>();
}

int64_t get_int(const Value& v, const std::string& what) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > uint64_t(INT64_MAX)) wrong_kind(what, "an integer of 64 bits");
    return int64_t(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  const double d = get_number(v, what);
  if (!(d >= -9007199254740992.0 && d <= 9007199254740992.0) || d != std::floor(d)) wrong_kind(what, "an integer");
  return int64_t(d);
}

const std::string& get_string(const Value& v, const std::string& what) {
  if (!v.is_string()) wrong_kind(what, "a string");
  return v.get_ref<const std::string&>();
}

const Value::array_t& get_array(const Value& v, const std::string& what) {
  if (!v.is_array()) wrong_kind(what, "an array");
  return v.get_ref<const Value::array_t&>();
}

const Value::object_t& get_object(const Value& v, const std::string& what) {
  if (!v.is_object()) wrong_kind(what, "an object");
  return v.get_ref<const Value::object_t&>();
}

const Value& member(const Value& v, const std::string& key, const std::string& what) {
  const Value::object_t& members = get_object(v, what);
  const auto it = members.find(key);
  SWAPOPT_CHECK(it != members.end(), "[checkpoint] " << subject(what) << " has no '" << key << "'");
  return it->second;
}

void check_known_keys(const Value& v, std::initializer_list<std::string_view> known, const std::string& what) {
  for (const auto& [key, value] : get_object(v, what)) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    SWAPOPT_FAIL("[checkpoint] " << subject(what) << " has unknown key '" << key << "' (expected "
                                 << comma_list(std::vector<std::string>(known.begin(), known.end())) << ")");
  }
}

void check_optimizer_metadata_keys(const Value& meta) {
  check_known_keys(meta, {"optimizer", "groups", "param_steps", "param_names", "param_shards", "param_kept"},
                   "metadata");
}

const std::string& optimizer_named(const Value& meta) {
  SWAPOPT_CHECK(meta.is_object() && meta.contains("optimizer"),
                "[checkpoint] its metadata names no optimizer: not an optimizer's checkpoint (a file of another "
                "StateDict, such as the weights?)");
  return get_string(meta.at("optimizer"), "optimizer");
}

}  // namespace swapopt::json
