#pragma once
/** Optimizer state as named host tensors plus JSON metadata, and its safetensors file format. */

#include <cstddef>
#include <map>
#include <string>

#include "swapopt/core/tensor.h"

namespace swapopt {

/** Tensors are named "state.<param_index>.<key>" (param_index counts over all groups in order) and
 *  live on the host; `metadata` is JSON: {"optimizer", "groups": [{"options", "step", "params"}],
 *  "param_steps"}. */
struct StateDict {
  std::map<std::string, Tensor> tensors;
  std::string metadata;
};

/** Writes a safetensors file atomically: to `path`.tmp, fsync, then rename over `path`. */
void save_state_dict(const StateDict& state, const std::string& path);

/** Reads a safetensors file written by save_state_dict; throws a named swapopt::Error on a short,
 *  corrupt or inconsistent file. */
StateDict load_state_dict(const std::string& path);

/** The safetensors bytes of `state`. */
std::string serialize_state_dict(const StateDict& state);

/** Parses safetensors bytes (the fuzzed entry point). */
StateDict parse_state_dict(const void* data, size_t size);

}  // namespace swapopt
