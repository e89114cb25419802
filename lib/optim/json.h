#pragma once
// A small JSON value, writer and strict parser for checkpoint metadata (internal). The parser
// bounds nesting depth and rejects trailing bytes, so a corrupt header fails with a named error.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace swapopt::json {

class Value {
 public:
  enum class Kind { null, boolean, number, string, array, object };

  Value() = default;
  static Value boolean(bool b);
  static Value number(double d);
  static Value string(std::string s);
  static Value array(std::vector<Value> items = {});
  static Value object(std::map<std::string, Value> members = {});

  Kind kind() const { return kind_; }
  /** Typed reads; each throws "[checkpoint] metadata: <what> must be <kind>" on a mismatch. */
  bool as_bool(const std::string& what) const;
  double as_number(const std::string& what) const;
  int64_t as_int(const std::string& what) const;
  const std::string& as_string(const std::string& what) const;
  const std::vector<Value>& as_array(const std::string& what) const;
  const std::map<std::string, Value>& as_object(const std::string& what) const;
  /** Member `key` of an object; throws naming `what` if absent. */
  const Value& at(const std::string& key, const std::string& what) const;
  bool contains(const std::string& key) const;

  std::vector<Value>& items() { return array_; }
  std::map<std::string, Value>& members() { return object_; }

  std::string dump() const;

 private:
  Kind kind_ = Kind::null;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Value> array_;
  std::map<std::string, Value> object_;
};

/** Parses one JSON document; throws swapopt::Error "[checkpoint] bad JSON at byte N: ..." on any fault. */
Value parse(std::string_view text);

}  // namespace swapopt::json
