#pragma once
/** HSDP Muon's plan: a group's distributed params split into assignments, each param owned by one
 *  replica (chosen greedily by load) and, when sharded, its Newton-Schulz computed by one rank of
 *  the shard group. Built from logical shapes only, so every rank builds the same plan. */

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/optim/param.h"

namespace swapopt {

/** Options of Muon::enable_hsdp. */
struct HsdpOptions {
  /** Soft cap of an assignment's logical bytes, per replica (the cap is cap_bytes x replicas). */
  int64_t cap_bytes = 512LL << 20;
  /** The reference's hsdp_replica_count: the R replicas of a param are cut into R / k blocks of k
   *  consecutive replicate coordinates; each block shares the work of one full update and
   *  broadcasts within itself (k = 1: every replica computes everything, no broadcast). Unset: all
   *  R replicas form one block. Must divide every R it applies to (R < k: all R). */
  std::optional<int64_t> replica_count{};
  /** The replicate broadcast packs each owner's params into buffers of at most this many bytes
   *  (a larger param gets one of its own). */
  int64_t broadcast_buffer_bytes = 512LL << 20;
  /** Prefix of the sub-groups' rendezvous names, unique per optimizer of a job. Empty: "hsdp<n>",
   *  n counting enable_hsdp calls in this process (the same on every rank when each creates its
   *  optimizers in the same order; ranks that share a process need names of their own). */
  std::string name{};

  /** Throws "[Muon] <option> ..." for a bad value. */
  void validate() const;
};

/** One batch of one group's params of one communication domain (the same replicate and shard
 *  mesh dims). */
struct HsdpAssignment {
  size_t group = 0;  ///< The optimizer's param group the params belong to.
  std::vector<Param*> params;    ///< in schedule order (largest logical numel first)
  std::vector<int64_t> owners;   ///< replica (coordinate within this rank's block) updating params[i]
  std::vector<int64_t> ns_ranks;  ///< rank of the shard group computing Newton-Schulz of params[i] (0 unsharded)
  int64_t local_coordinate = 0;  ///< this rank's replica coordinate within its block
  /** This rank's replica block: owners broadcast their updated local params here. Null when the
   *  block is one rank. */
  std::shared_ptr<Communicator> replicas;
  /** Sharded params only: the ranks holding the other shards (this rank's shard group). Null
   *  when the params are not split across ranks. */
  std::shared_ptr<Communicator> shards;
  /** With `shards`: the mesh coordinate of each of its ranks, by rank there; empty otherwise. */
  std::vector<std::vector<int64_t>> shard_coordinates;

  /** Whether the params are split across ranks (`shards` is set). */
  bool sharded() const { return shards != nullptr; }
  /** The params this rank updates (a sharded param: its local shard). */
  std::vector<Param*> owned() const;
  /** Whether this rank updates `param`: it is in `params` and its owner is local_coordinate. */
  bool owns(const Param* param) const;
  /** Logical bytes of every param (rank-independent partition cost). */
  int64_t logical_bytes() const;
};

/** `elements` of `dtype` rounded up to a multiple of 512 bytes: where the next tensor starts in a
 *  packed HSDP buffer. */
int64_t align_to_512_bytes(int64_t elements, DType dtype);

/** Splits `params` (one group, one domain) into assignments of at most `cap_bytes` x `replicas`
 *  logical bytes (soft cap: a param is appended, then the batch closes once it reaches the cap),
 *  largest first. Owners: params by (-numel, index) to the replica with the smallest (load,
 *  coordinate); then, per owner, NS ranks the same way over `shard_ranks`. Communicators are left
 *  to the caller. */
std::vector<HsdpAssignment> make_hsdp_assignments(size_t group, const std::vector<Param*>& params, int64_t replicas,
                                                  int64_t local_coordinate, int64_t cap_bytes, int64_t shard_ranks = 1);

}  // namespace swapopt
