#include "member_checkpoint.h"

#include "../core/comma_list.h"
#include "checkpoint_part_error.h"
#include "json.h"
#include "swapopt/core/error.h"

namespace swapopt {

std::string members_metadata(const std::vector<MemberMetadata>& members, const std::string& optimizers) {
  json::Value listed = json::Value::array();
  for (const auto& [name, metadata] : members)
    listed.push_back(json::Value::object({{"name", name}, {"metadata", metadata}}));
  return json::dump(json::Value::object({{"optimizer", optimizers}, {"members", std::move(listed)}}), "the metadata");
}

std::vector<CheckpointReader> split_members(const CheckpointReader& checkpoint, const std::vector<std::string>& names,
                                            const std::string& optimizers) {
  const json::Value meta = json::parse(checkpoint.metadata);
  const std::string& named = json::optimizer_named(meta);
  SWAPOPT_CHECK(meta.contains("members"), "[checkpoint] holds the state of one "
                                              << named << " optimizer, not of a set of optimizers (" << names.size()
                                              << " members)");
  json::check_known_keys(meta, {"optimizer", "members"}, "metadata");
  const auto& listed = json::get_array(json::member(meta, "members", "metadata"), "members");
  std::vector<std::string> held;
  const auto entry = [](size_t i) { return "members[" + std::to_string(i) + "]"; };
  for (size_t i = 0; i < listed.size(); ++i) {
    json::check_known_keys(listed[i], {"name", "metadata"}, entry(i));
    held.push_back(json::get_string(json::member(listed[i], "name", entry(i)), entry(i) + ".name"));
  }
  SWAPOPT_CHECK(held == names,
                "[checkpoint] holds members [" << comma_list(held) << "], this set has [" << comma_list(names) << "]");
  SWAPOPT_CHECK(named == optimizers,
                "[checkpoint] names its members' optimizers '" << named << "', this set's are '" << optimizers << "'");

  std::vector<CheckpointReader> parts(names.size());
  for (size_t i = 0; i < names.size(); ++i)
    parts[i].metadata = json::get_string(json::member(listed[i], "metadata", entry(i)), entry(i) + ".metadata");
  for (const auto& [name, tensor] : checkpoint.tensors) {
    const size_t slash = name.find('/');
    bool placed = false;
    for (size_t i = 0; i < names.size() && slash != std::string::npos; ++i)
      if (name.compare(0, slash, names[i]) == 0 && slash == names[i].size()) {
        parts[i].tensors.emplace(name.substr(slash + 1), tensor);
        placed = true;
      }
    SWAPOPT_CHECK(placed,
                  "[checkpoint] tensor '" << name << "' belongs to no member of the set (" << comma_list(names) << ")");
  }
  return parts;
}

void load_members(const std::vector<std::string>& names, const std::vector<CheckpointReader>& parts,
                  const std::function<std::function<void()>(size_t member, const CheckpointReader& part)>& prepare) {
  std::vector<std::function<void()>> applies;
  for (size_t i = 0; i < names.size(); ++i) {
    try {
      applies.push_back(prepare(i, parts[i]));
    } catch (const Error& e) {
      fail_in_checkpoint_part("member '" + names[i] + "'", e);
    }
  }
  for (auto& apply : applies) apply();
}

}  // namespace swapopt
