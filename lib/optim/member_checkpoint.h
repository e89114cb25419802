#pragma once
// The checkpoint of several named optimizers stepped as one (internal): a SwapOptimizerSet's and a
// bare MuonWithAdamW's, so that either loads the other's file. Each member's tensors are named
// "<member>/<its own name>"; the metadata is {"optimizer": "Muon+AdamW", "members": [{"name":
// "muon", "metadata": "<Muon's own metadata>"}, ...]}.

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint_stream.h"
#include "swapopt/optim/checkpoint.h"

namespace swapopt {

/** A member's name and its own metadata, in member order. */
using MemberMetadata = std::pair<std::string, std::string>;

/** The metadata of members `members` whose optimizers' names, joined by '+', are `optimizers`. */
std::string members_metadata(const std::vector<MemberMetadata>& members, const std::string& optimizers);

/** One checkpoint (a StateDict or a CheckpointSource) of members `names`: `part_of(i)` is member
 *  i's own, its tensors renamed "<name>/<tensor>"; `optimizers` as members_metadata takes it. */
template <typename Checkpoint, typename PartOf>
Checkpoint join_members(const std::vector<std::string>& names, const PartOf& part_of, const std::string& optimizers) {
  Checkpoint out;
  std::vector<MemberMetadata> metadata;
  for (size_t i = 0; i < names.size(); ++i) {
    Checkpoint part = part_of(i);
    for (auto& [name, tensor] : part.tensors) out.tensors.emplace(names[i] + "/" + name, std::move(tensor));
    metadata.emplace_back(names[i], std::move(part.metadata));
  }
  out.metadata = members_metadata(metadata, optimizers);
  return out;
}

/** Checks that `checkpoint` holds the members `names` (in order) of optimizers `optimizers`,
 *  and splits it into each member's own checkpoint; throws a named error otherwise. */
std::vector<CheckpointReader> split_members(const CheckpointReader& checkpoint, const std::vector<std::string>& names,
                                            const std::string& optimizers);

/** Loads `parts` into the members: `prepare(i, part)` checks member i's part and returns the
 *  change that loads it; every member is checked before any changes, and a member's error
 *  names it ("[checkpoint] member 'adamw': ..."). */
void load_members(const std::vector<std::string>& names, const std::vector<CheckpointReader>& parts,
                  const std::function<std::function<void()>(size_t member, const CheckpointReader& part)>& prepare);

}  // namespace swapopt
