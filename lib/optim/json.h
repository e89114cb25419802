#pragma once
// Checkpoint metadata as JSON (internal): nlohmann-json values, a bounded strict parser and typed
// reads that name the field, so a corrupt or hand-edited header fails with a named error.

#include <cstdint>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace swapopt::json {

/** Objects keep their keys sorted (std::map), so a dump is the same bytes for the same content. */
using Value = nlohmann::json;

/** Parses one JSON document: no trailing bytes, no duplicate key, at most 64 levels of nesting.
 *  Throws swapopt::Error "[checkpoint] bad JSON at byte N: ..." (or "... bad JSON: ...") on any fault. */
Value parse(std::string_view text);

/** Compact text of `v`; throws swapopt::Error naming `what` if a string in it is not valid UTF-8. */
std::string dump(const Value& v, const std::string& what);

/** Whether `text` is valid UTF-8, as every JSON string must be. */
bool is_utf8(const std::string& text);

/** Typed reads; each throws "[checkpoint] metadata: <what> must be <kind>" on a mismatch (for
 *  `what` "metadata", the whole of it: "[checkpoint] metadata must be <kind>", as below). */
bool get_bool(const Value& v, const std::string& what);
double get_number(const Value& v, const std::string& what);
/** An integer, or a number with an integral value within +-2^53. */
int64_t get_int(const Value& v, const std::string& what);
const std::string& get_string(const Value& v, const std::string& what);
const Value::array_t& get_array(const Value& v, const std::string& what);
const Value::object_t& get_object(const Value& v, const std::string& what);

/** Member `key` of the object `v`; throws "[checkpoint] metadata: <what> has no '<key>'" if absent. */
const Value& member(const Value& v, const std::string& key, const std::string& what);

/** Throws "[checkpoint] metadata: <what> has unknown key '<k>' (expected a, b, ...)" for a member of
 *  the object `v` that `known` does not list: a misspelt or newer field is refused, not ignored. */
void check_known_keys(const Value& v, std::initializer_list<std::string_view> known, const std::string& what);

/** check_known_keys for one optimizer's metadata (Optimizer::metadata_json writes them). */
void check_optimizer_metadata_keys(const Value& meta);

/** The optimizer a checkpoint's metadata names ("Muon", or a set's "Muon+AdamW"); throws "[checkpoint]
 *  its metadata names no optimizer: ..." when `meta` is not an object with one (a file of another
 *  StateDict, such as the weights). */
const std::string& optimizer_named(const Value& meta);

}  // namespace swapopt::json
