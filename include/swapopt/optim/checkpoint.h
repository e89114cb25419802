#pragma once
/** Optimizer state as named host tensors plus JSON metadata, and its safetensors file format. */

#include <cstddef>
#include <map>
#include <string>

#include "swapopt/core/tensor.h"

namespace swapopt {

/** Tensors are named "state.<param_index>.<key>" (param_index counts over all groups in order) and
 *  live on the host; `metadata` is JSON: {"optimizer", "groups": [{"options", "step", "params"}],
 *  "param_steps", "param_names", "param_shards", "param_kept"} ("param_names" absent in files
 *  written before swapopt 0.3; "param_shards" only with distributed params, each one's shard
 *  offset; "param_kept" only where a rank keeps some params' state, HSDP's owners). A load refuses
 *  any other key. A set's (and a bare MuonWithAdamW's) metadata is {"optimizer": "Muon+AdamW",
 *  "members": [{"name", "metadata"}]}, each member's tensors prefixed "<name>/". A param's step
 *  counts its updates: it holds state exactly when that step is positive (Muon files from before
 *  0.4 hold 0 for every param step). */
struct StateDict {
  /** The state tensors by name, on the host. */
  std::map<std::string, Tensor> tensors;
  /** The metadata JSON text. */
  std::string metadata;
};

/** How a checkpoint file is read. */
struct CheckpointReadOptions {
  /** Load a file that carries no checksums (written before swapopt 0.2, or by another tool)
   *  without verifying its bytes. A file that has them is always verified. */
  bool allow_missing_checksums = false;
};

/** Writes a safetensors file atomically: to `path`.tmp, fsync, then rename over `path`. What no
 *  load would take is a named error before anything is written: a tensor named "__metadata__",
 *  one of more than 64 dims, one without elements whose other dims multiply past 2^32, a header
 *  (names, shapes, metadata) past 100 MiB. Saves to one path at once on one host (threads or
 *  processes) take turns on an flock of `path`.tmp, held until the rename: each commits a whole
 *  file, and a save waits, without a timeout, while another holds the lock. Across hosts (a
 *  network file system) keep one writer per path: flock may not reach the other host. */
void save_state_dict(const StateDict& state, const std::string& path);

/** Reads a safetensors file written by save_state_dict; throws a named swapopt::Error on a short,
 *  corrupt or inconsistent file, on one whose bytes do not match its checksums, and on a path
 *  that is not a regular file (a FIFO is refused, not waited on). */
StateDict load_state_dict(const std::string& path, const CheckpointReadOptions& options = {});

/** The safetensors bytes of `state`. The header's `__metadata__` holds the metadata JSON as
 *  "swapopt" and, as "swapopt.crc32", a JSON object of CRC-32s (zlib's): "__metadata__" for the
 *  metadata text and one per tensor name for its bytes. */
std::string serialize_state_dict(const StateDict& state);

/** Parses safetensors bytes (the fuzzed entry point), verifying the checksums: every tensor and
 *  the metadata must have one and match it, and every checksum must name a tensor of the file. */
StateDict parse_state_dict(const void* data, size_t size, const CheckpointReadOptions& options = {});

}  // namespace swapopt
