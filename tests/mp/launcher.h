#pragma once
// Multi-process test launcher: starts N ranks of a program with torchrun-like environment
// variables, collects each rank's exit code and output, and kills them all on a timeout.

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace swapopt::test {

struct RankResult {
  int exit_code = -1;  // -1: killed (timeout) or died by a signal
  std::string output;  // stdout and stderr
};

struct LaunchResult {
  std::vector<RankResult> ranks;
  bool timed_out = false;
  double seconds = 0.0;
};

/** Runs `argv` once per rank with RANK, WORLD_SIZE, LOCAL_RANK and `env` set; waits at most
 *  `timeout`, then kills every rank still running. */
LaunchResult launch_ranks(int world_size, const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                          std::chrono::milliseconds timeout);

/** A fresh empty directory under /tmp (a FileStore rendezvous). */
std::string make_temp_dir(const std::string& prefix);

}  // namespace swapopt::test
