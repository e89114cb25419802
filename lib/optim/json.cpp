#include "json.h"

#include <cmath>
#include <set>
#include <vector>

#include "swapopt/core/error.h"

namespace swapopt::json {

namespace {

constexpr int kMaxDepth = 64;

[[noreturn]] void wrong_kind(const std::string& what, const char* kind) {
  SWAPOPT_FAIL("[checkpoint] metadata: " << what << " must be " << kind);
}

/** nlohmann's message without its "[json.exception.parse_error.101] parse error at line 1, column 2: " prefix. */
std::string reason_of(const nlohmann::json::exception& e) {
  const std::string text = e.what();
  const size_t colon = text.find(": ");
  if (colon != std::string::npos) return text.substr(colon + 2);
  const size_t bracket = text.find("] ");
  return bracket == std::string::npos ? text : text.substr(bracket + 2);
}

}  // namespace

Value parse(std::string_view text) {
  // The parser callback sees every object and array open and close and every key: it bounds the
  // nesting and keeps each open object's keys to reject a duplicate (nlohmann keeps the last one).
  std::vector<std::set<std::string>> open;  // one entry per open object or array
  auto callback = [&open](int, nlohmann::json::parse_event_t event, Value& parsed) {
    using Event = nlohmann::json::parse_event_t;
    if (event == Event::object_start || event == Event::array_start) {
      SWAPOPT_CHECK(open.size() < size_t(kMaxDepth), "[checkpoint] bad JSON: nesting deeper than " << kMaxDepth << " levels");
      open.emplace_back();
    } else if (event == Event::object_end || event == Event::array_end) {
      open.pop_back();
    } else if (event == Event::key) {
      const std::string& key = parsed.get_ref<const std::string&>();
      SWAPOPT_CHECK(open.back().insert(key).second, "[checkpoint] bad JSON: duplicate key '" << key << "'");
    }
    return true;
  };
  try {
    return Value::parse(text.begin(), text.end(), callback);
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
  SWAPOPT_CHECK(it != members.end(), "[checkpoint] metadata: " << what << " has no '" << key << "'");
  return it->second;
}

}  // namespace swapopt::json
