// libFuzzer target: any byte string given to the checkpoint loader either loads or fails with a
// swapopt::Error, and a failure leaves the optimizer exactly as it was. The same input, read as
// byte flips of a valid file, must never load with changed content.
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

/** True when `state` loaded; aborts if a rejected one changed the optimizer. */
bool load_into(Optimizer& optimizer, const StateDict& state, const std::string& before) {
  try {
    optimizer.load_state_dict(state);
  } catch (const Error&) {
    if (serialize_state_dict(optimizer.state_dict()) != before) {
      std::fprintf(stderr, "a rejected checkpoint changed %s's state\n", optimizer.name().c_str());
      std::abort();
    }
    return false;
  }
  return true;
}

/** The input as up to 16 (3-byte position, mask) flips of one valid file (its first byte picks
 *  which): whatever loads must carry exactly the file's content, since checksums guard it. */
void flip_valid_file(Target& t, const uint8_t* data, size_t size) {
  if (size == 0) return;
  Optimizer& optimizer = data[0] % 2 ? static_cast<Optimizer&>(t.fixture.optimizer->muon()) : t.fixture.optimizer->adamw();
  const std::string& before = data[0] % 2 ? t.muon_before : t.adamw_before;
  std::string file = before;
  for (size_t i = 1; i + 4 <= size && i < 1 + 4 * 16; i += 4) {
    const size_t at = (size_t(data[i]) | size_t(data[i + 1]) << 8 | size_t(data[i + 2]) << 16) % file.size();
    file[at] = char(file[at] ^ data[i + 3]);
  }
  StateDict state;
  try {
    state = parse_state_dict(file.data(), file.size());
  } catch (const Error&) {
    return;
  }
  if (load_into(optimizer, state, before) && serialize_state_dict(optimizer.state_dict()) != before) {
    std::fprintf(stderr, "a flipped checkpoint loaded into %s with changed content\n", optimizer.name().c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Target* target = new Target();
  flip_valid_file(*target, data, size);
  StateDict state;
  try {
    state = parse_state_dict(data, size);
  } catch (const Error&) {
    return 0;
  }
  // Accepted inputs are put back to the known state for the next one.
  auto restore = [](Optimizer& o, const std::string& before) { o.load_state_dict(parse_state_dict(before.data(), before.size())); };
  if (load_into(target->fixture.optimizer->muon(), state, target->muon_before)) restore(target->fixture.optimizer->muon(), target->muon_before);
  if (load_into(target->fixture.optimizer->adamw(), state, target->adamw_before))
    restore(target->fixture.optimizer->adamw(), target->adamw_before);
  return 0;
}
