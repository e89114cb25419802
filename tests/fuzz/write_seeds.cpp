// Writes valid Muon and AdamW checkpoints into the directory given as argv[1]: the fuzzer's seeds.
#include <cstdio>
#include <string>

#include "checkpoint_fixture.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  swapopt::fuzz::CheckpointFixture fixture;
  const std::string dir = argv[1];
  swapopt::save_state_dict(fixture.optimizer->muon().state_dict(), dir + "/muon.safetensors");
  swapopt::save_state_dict(fixture.optimizer->adamw().state_dict(), dir + "/adamw.safetensors");
  return 0;
}
