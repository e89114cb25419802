// The README's trainer loop, compiled and run here (the text between the README markers below is
// the README's block, checked verbatim): on the trainer's own buffers and stream, with a schedule,
// clipping, zero_grad and one checkpoint file; resuming that file continues bitwise.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_util.h"

using namespace swapopt;

namespace {

/** The trainer's side: its model memory, its stream, and a backward that writes the grads there. */
struct Trainer {
  std::vector<float> w_up = test::random_values(512 * 128, 1), w_down = test::random_values(128 * 512, 2),
                     w_norm = std::vector<float>(128, 1.f);
  std::vector<float> g_up = std::vector<float>(512 * 128), g_down = std::vector<float>(128 * 512),
                     g_norm = std::vector<float>(128);
  Stream your_stream{Device::cpu()};

  /** Runs the README's block from `first_step` to `last_step`. */
  void run(int first_step, int last_step) {
    // The trainer's backward: on its stream, writes this step's grads and hands them to the params.
    auto backward = [&](const std::vector<ParamPtr>& params, int step) {
      your_stream.enqueue([this, step] {
        const std::vector<float> a = test::random_values(g_up.size(), 100 + uint32_t(step));
        const std::vector<float> b = test::random_values(g_down.size(), 200 + uint32_t(step));
        const std::vector<float> c = test::random_values(g_norm.size(), 300 + uint32_t(step));
        std::copy(a.begin(), a.end(), g_up.begin());
        std::copy(b.begin(), b.end(), g_down.begin());
        std::copy(c.begin(), c.end(), g_norm.begin());
      });
      params[0]->grad = Tensor::from_blob(g_up.data(), {512, 128}, DType::f32, Device::cpu());
      params[1]->grad = Tensor::from_blob(g_down.data(), {128, 512}, DType::f32, Device::cpu());
      params[2]->grad = Tensor::from_blob(g_norm.data(), {128}, DType::f32, Device::cpu());
    };
    // README:begin
    // Your model's memory, wrapped without a copy (on a GPU: device pointers, Device::cuda(0)).
    const Device dev = Device::cpu();
    std::vector<ParamPtr> params = {
        make_param("mlp.up.weight", Tensor::from_blob(w_up.data(), {512, 128}, DType::f32, dev)),
        make_param("mlp.down.weight", Tensor::from_blob(w_down.data(), {128, 512}, DType::f32, dev)),
        make_param("final_norm.weight", Tensor::from_blob(w_norm.data(), {128}, DType::f32, dev))};
    // swapopt works on your stream (a cudaStream_t on a GPU), ordered with your own work there.
    Stream stream = Stream::borrow(your_stream.native_handle(), dev);
    MuonWithAdamW muon_adamw(stream, params);  // Muon for the matrices, AdamW for the rest
    muon_adamw.muon().set_schedule([&](int64_t step) { muon_adamw.muon().set_lr(0.02 * std::min(1.0, step / 10.0)); });
    auto opt = swap_muon_with_adamw(muon_adamw);  // state in pinned host memory: one step, one checkpoint
    if (first_step > 1) opt->load_checkpoint("run.safetensors");
    for (int step = first_step; step <= last_step; ++step) {
      backward(params, step);               // yours: sets each param->grad, its values written on your stream
      clip_grad_norm(params, 1.0, stream);  // the global norm, clipped to 1
      opt->step();                          // enqueued on your stream, after the backward
      opt->zero_grad();                     // every grad set to none: the next backward sets them again
      if (step % 10 == 0) opt->save_checkpoint("run.safetensors");  // straight from the host mirrors
    }
    opt->synchronize();  // step() is asynchronous: wait before reading the weights on the host
    // README:end
  }
};

/** This file's lines between the markers, without their indent. */
std::vector<std::string> marked_code(std::istream& in) {
  std::vector<std::string> out;
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    if (line.find("// README:" "end") != std::string::npos) break;
    if (inside) out.push_back(line.size() >= 4 ? line.substr(4) : line);
    if (line.find("// README:" "begin") != std::string::npos) inside = true;
  }
  return out;
}

/** The README's ```cpp block right after the line "<!-- tests/readme_test.cpp -->" (empty if the
 *  block is not there). */
std::vector<std::string> readme_block(std::istream& in) {
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line) && line != "<!-- tests/readme_test.cpp -->") {
  }
  if (!std::getline(in, line) || line != "```cpp") return out;
  while (std::getline(in, line) && line != "```") out.push_back(line);
  return out;
}

}  // namespace

TEST_CASE(
    "README: the trainer loop runs as shown, and resuming its checkpoint continues bitwise, also from the weights "
    "file in a trainer started anew") {
  const std::string cwd = std::filesystem::current_path().string();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "swapopt_readme_test";
  std::filesystem::create_directories(dir);
  std::filesystem::current_path(dir);
  Trainer straight, resumed;
  straight.run(1, 20);
  resumed.run(1, 10);  // writes run.safetensors at step 10 (and, resumed below, again at 20)
  // The README's weights file, saved at step 10 and put back by a trainer that starts anew in a
  // directory of its own (as a second process would, its buffers at their initial values), beside
  // a copy of the checkpoint of step 10.
  StateDict saved;
  saved.metadata = "{\"step\": 10}";
  const auto views = [](Trainer& t) {
    return std::vector<std::pair<std::string, Tensor>>{
        {"mlp.up.weight", Tensor::from_blob(t.w_up.data(), {512, 128}, DType::f32, Device::cpu())},
        {"mlp.down.weight", Tensor::from_blob(t.w_down.data(), {128, 512}, DType::f32, Device::cpu())},
        {"final_norm.weight", Tensor::from_blob(t.w_norm.data(), {128}, DType::f32, Device::cpu())}};
  };
  for (const auto& [name, data] : views(resumed)) saved.tensors.emplace(name, data.to(Device::cpu()));
  std::filesystem::create_directories(dir / "restart");
  save_state_dict(saved, (dir / "restart" / "weights.safetensors").string());
  std::filesystem::copy_file(dir / "run.safetensors", dir / "restart" / "run.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  resumed.run(11, 20);
  std::filesystem::current_path(dir / "restart");
  Trainer restarted;
  {
    StateDict w = load_state_dict("weights.safetensors");
    for (const auto& [name, data] : views(restarted)) ops::copy(restarted.your_stream, w.tensors.at(name), data);
    restarted.your_stream.synchronize();
  }
  restarted.run(11, 20);
  std::filesystem::current_path(cwd);
  CHECK(straight.w_up == resumed.w_up);
  CHECK(straight.w_down == resumed.w_down);
  CHECK(straight.w_norm == resumed.w_norm);
  CHECK(straight.w_up == restarted.w_up);
  CHECK(straight.w_down == restarted.w_down);
  CHECK(straight.w_norm == restarted.w_norm);
  CHECK(straight.w_up != test::random_values(512 * 128, 1));  // it trained
  bool finite = true;
  for (float x : straight.w_up) finite = finite && std::isfinite(x);
  CHECK(finite);
  std::filesystem::remove_all(dir);
}

TEST_CASE("README: its trainer-loop block is the code this file runs, verbatim") {
  std::ifstream source(test::test_path(SWAPOPT_SOURCE_DIR "/tests/readme_test.cpp", "../../tests/readme_test.cpp"));
  std::ifstream readme(test::test_path(SWAPOPT_SOURCE_DIR "/README.md", "../../README.md"));
  REQUIRE(source.good());
  REQUIRE(readme.good());
  const std::vector<std::string> code = marked_code(source), shown = readme_block(readme);
  REQUIRE(code.size() > 10);
  CHECK(shown == code);
}

// The README writes options as designated initializers, e.g. SwapConfig{.swap_times = 16}. GCC's
// -Wextra warns for every member without a default initializer that such a list leaves out (an
// error under a trainer's -Werror, as in this suite's werror build): every member of the option
// structs has one.
TEST_CASE("README: option structs take designated initializers without a -Wextra warning") {
  CHECK(SwapConfig{.swap_times = 4}.swap_times == 4);
  CHECK(SwapConfig{.device_budget_bytes = 1 << 20}.device_budget_bytes == size_t(1) << 20);
  CHECK(CheckpointReadOptions{.allow_missing_checksums = true}.allow_missing_checksums);
  CHECK(MuonOptions{.lr = 0.5}.lr == 0.5);
  CHECK(AdamWOptions{.lr = 0.5}.lr == 0.5);
  CHECK(HsdpOptions{.replica_count = 2}.replica_count == 2);
  CHECK(RoutingRule{.why = "an embedding"}.route == Route::adamw_decay);
  CHECK(RoutingRules{.rules = {}}.rules.empty());
  CHECK_FALSE(MuonHooks{.zeropower_fn = nullptr}.post_update_fn);
  CHECK(LaunchEnv{.rank = 1}.world_size == 1);
}
