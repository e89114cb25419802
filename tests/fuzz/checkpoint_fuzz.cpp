// libFuzzer target: any byte string given to the checkpoint loader either loads or fails with a
// swapopt::Error, and a failure leaves the optimizer exactly as it was.
#include <cstdio>
#include <cstdlib>

#include "checkpoint_fixture.h"

using namespace swapopt;

namespace {

struct Target {
  fuzz::CheckpointFixture fixture;
  std::string muon_before = serialize_state_dict(fixture.optimizer->muon().state_dict());
  std::string adamw_before = serialize_state_dict(fixture.optimizer->adamw().state_dict());
};

void load_into(Optimizer& optimizer, const StateDict& state, const std::string& before) {
  try {
    optimizer.load_state_dict(state);
  } catch (const Error&) {
    if (serialize_state_dict(optimizer.state_dict()) != before) {
      std::fprintf(stderr, "a rejected checkpoint changed %s's state\n", optimizer.name().c_str());
      std::abort();
    }
    return;
  }
  // Accepted: put the known state back for the next input.
  optimizer.load_state_dict(parse_state_dict(before.data(), before.size()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Target* target = new Target();
  StateDict state;
  try {
    state = parse_state_dict(data, size);
  } catch (const Error&) {
    return 0;
  }
  load_into(target->fixture.optimizer->muon(), state, target->muon_before);
  load_into(target->fixture.optimizer->adamw(), state, target->adamw_before);
  return 0;
}
