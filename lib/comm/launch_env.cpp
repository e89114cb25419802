#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

/** A variable of decimal digits only (no sign, no spaces), at least `least` and below 2^30. */
int int_var(const char* name, bool required, int fallback, int least = 0) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    SWAPOPT_CHECK(!required, "[comm] environment variable " << name << " is not set");
    return fallback;
  }
  const std::string_view digits(text);
  SWAPOPT_CHECK(std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }),
                "[comm] environment variable " << name << "='" << text << "' is not a non-negative integer");
  constexpr long kMost = (1L << 30) - 1;
  const long value = digits.size() > 10 ? kMost + 1 : std::strtol(text, nullptr, 10);
  SWAPOPT_CHECK(value >= least && value <= kMost, "[comm] environment variable " << name << "='" << text
                                                                                 << "' is outside [" << least << ", "
                                                                                 << kMost << "]");
  return int(value);
}

}  // namespace

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv env;
  env.rank = int_var("RANK", true, 0);
  env.world_size = int_var("WORLD_SIZE", true, 1);
  env.local_rank = int_var("LOCAL_RANK", false, env.rank);
  env.timeout = std::chrono::milliseconds(int_var("SWAPOPT_TIMEOUT_MS", false, 30000, 1));
  env.rendezvous_timeout = std::chrono::milliseconds(int_var("SWAPOPT_RENDEZVOUS_TIMEOUT_MS", false, 0));
  if (const char* id = std::getenv("SWAPOPT_RUN_ID")) env.run_id = id;
  if (const char* redis = std::getenv("SWAPOPT_REDIS")) env.redis = redis;
  if (const char* dir = std::getenv("SWAPOPT_RENDEZVOUS")) env.rendezvous_dir = dir;
  if (const char* host = std::getenv("SWAPOPT_HOSTNAME"); host != nullptr && *host != '\0') env.hostname = host;
  SWAPOPT_CHECK(env.world_size >= 1 && env.rank < env.world_size,
                "[comm] RANK " << env.rank << " is outside WORLD_SIZE " << env.world_size);
  SWAPOPT_CHECK(!env.redis.empty() || !env.rendezvous_dir.empty(),
                "[comm] set SWAPOPT_RENDEZVOUS (a shared directory) or SWAPOPT_REDIS (host:port) for the rendezvous");
  return env;
}

Device LaunchEnv::device() const {
  const int count = cuda_device_count();
  if (count == 0) return Device::cpu();
  SWAPOPT_CHECK(local_rank < count, "[comm] LOCAL_RANK " << local_rank << " has no GPU: " << count << " visible");
  return Device::cuda(local_rank);
}

}  // namespace swapopt
