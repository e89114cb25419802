#include <sys/stat.h>

#include <barrier>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "swapopt/optim/routing.h"
#include "test_util.h"

using namespace swapopt;

namespace {

std::vector<ParamPtr> make_model(uint32_t seed) {
  return {make_param("blocks.0.attn.w", test::random_tensor({12, 20}, DType::f32, seed)),
          make_param("blocks.0.mlp.w", test::random_tensor({3, 8, 6}, DType::f32, seed + 1)),
          make_param("embed.weight", test::random_tensor({10, 4}, DType::f32, seed + 2)),
          make_param("blocks.0.norm.weight", test::random_tensor({20}, DType::f32, seed + 3)),
          make_param("blocks.0.mlp.bias", test::random_tensor({6}, DType::f32, seed + 4))};
}

void set_grads(const std::vector<ParamPtr>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i) {
    // The attention matrix skips step 2: state and steps must survive gaps too.
    params[i]->grad = (i == 0 && step == 2) ? Tensor() : test::random_tensor(params[i]->data.shape(), DType::f32, 1000 + 17 * step + uint32_t(i));
  }
}

std::string temp_path(const char* name) { return test::temp_file(std::string(name) + ".safetensors"); }

}  // namespace

TEST_CASE("routing sends matrices to Muon and the rest to AdamW (no decay for biases and 1-D)") {
  auto params = make_model(1);
  RoutedParams r = route_params(params);
  REQUIRE(r.muon.size() == 2);
  CHECK(r.muon[0]->name == "blocks.0.attn.w");
  REQUIRE(r.adamw_decay.size() == 1);
  CHECK(r.adamw_decay[0]->name == "embed.weight");
  CHECK(r.adamw_no_decay.size() == 2);
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  CHECK(opt.adamw().param_groups().size() == 2);
  CHECK(opt.adamw().options(1).weight_decay == 0.0);
}

TEST_CASE("save, load into a fresh optimizer, continue: bitwise equal to an uninterrupted run") {
  // Uninterrupted: 5 steps.
  auto straight = make_model(7);
  MuonWithAdamW a(Stream(Device::cpu()), straight);
  for (int step = 1; step <= 5; ++step) {
    set_grads(straight, step);
    a.step();
  }
  a.muon().stream().synchronize();
  // Interrupted after 3 steps: save both optimizers, rebuild from the saved params, load, continue.
  auto first = make_model(7);
  MuonWithAdamW b(Stream(Device::cpu()), first);
  for (int step = 1; step <= 3; ++step) {
    set_grads(first, step);
    b.step();
  }
  save_state_dict(b.muon().state_dict(), temp_path("muon"));
  save_state_dict(b.adamw().state_dict(), temp_path("adamw"));
  auto resumed = make_model(99);  // different initial values: overwritten from the first run below
  for (size_t i = 0; i < resumed.size(); ++i) resumed[i]->data = first[i]->data.clone();
  MuonWithAdamW c(Stream(Device::cpu()), resumed);
  c.muon().load_state_dict(load_state_dict(temp_path("muon")));
  c.adamw().load_state_dict(load_state_dict(temp_path("adamw")));
  CHECK(c.muon().param_groups()[0].step == 3);
  for (int step = 4; step <= 5; ++step) {
    set_grads(resumed, step);
    c.step();
  }
  c.muon().stream().synchronize();
  for (size_t i = 0; i < straight.size(); ++i) CHECK(test::same_bits(straight[i]->data, resumed[i]->data));
  CHECK(c.adamw().state().at(resumed[3].get()).step == 5);
  std::remove(temp_path("muon").c_str());
  std::remove(temp_path("adamw").c_str());
}

TEST_CASE("a checkpoint that does not match fails by name and changes nothing") {
  auto params = make_model(3);
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  set_grads(params, 1);
  opt.step();
  Muon& muon = opt.muon();
  const StateDict good = muon.state_dict();
  const std::string before = serialize_state_dict(good);

  auto expect_rejected = [&](StateDict bad, const std::string& message) {
    CHECK_THROWS_WITH_AS(muon.load_state_dict(bad), message.c_str(), Error);
    CHECK(serialize_state_dict(muon.state_dict()) == before);
  };
  StateDict wrong_shape = good;
  wrong_shape.tensors["state.0.momentum_buffer"] = Tensor::zeros({20, 12}, DType::f32, Device::cpu());
  expect_rejected(wrong_shape, "[checkpoint] tensor 'state.0.momentum_buffer' has shape [20, 12], param 'blocks.0.attn.w' needs [12, 20]");
  StateDict wrong_dtype = good;
  wrong_dtype.tensors["state.0.momentum_buffer"] = Tensor::zeros({12, 20}, DType::bf16, Device::cpu());
  expect_rejected(wrong_dtype, "[checkpoint] tensor 'state.0.momentum_buffer' is bf16, Muon keeps f32");
  StateDict foreign_key = good;
  foreign_key.tensors["state.0.exp_avg"] = Tensor::zeros({12, 20}, DType::f32, Device::cpu());
  expect_rejected(foreign_key, "[checkpoint] tensor 'state.0.exp_avg': 'exp_avg' is not Muon state");
  StateDict undefined = good;
  undefined.tensors["state.0.momentum_buffer"] = Tensor();
  expect_rejected(undefined, "[checkpoint] tensor 'state.0.momentum_buffer' is undefined");
  CHECK(test::error_of([&] { serialize_state_dict(undefined); }) ==
        "[checkpoint] tensor 'state.0.momentum_buffer' is undefined");
  StateDict released = good;
  released.tensors["state.0.momentum_buffer"] = good.tensors.at("state.0.momentum_buffer").clone();
  released.tensors["state.0.momentum_buffer"].storage()->release();
  expect_rejected(released, "[checkpoint] tensor 'state.0.momentum_buffer' is released");
  StateDict no_metadata = good;
  no_metadata.metadata.clear();  // a file written from it could never load: refused on save too
  expect_rejected(no_metadata, "[checkpoint] no swapopt metadata in the state dict");
  CHECK(test::error_of([&] { serialize_state_dict(no_metadata); }) ==
        "[checkpoint] no swapopt metadata in the state dict");
  StateDict bad_index = good;
  bad_index.tensors["state.9.momentum_buffer"] = Tensor::zeros({12, 20}, DType::f32, Device::cpu());
  expect_rejected(bad_index, "[checkpoint] tensor 'state.9.momentum_buffer' names param 9 of 2");
  StateDict missing_option = good;
  const size_t at = missing_option.metadata.find("\"lr\":");
  missing_option.metadata.replace(at, 4, "\"xx\"");
  expect_rejected(missing_option, "[checkpoint] group 0: [Muon] unknown option 'xx'");
  StateDict unknown_key = good;  // refused, not ignored: a misspelt field, or one of a newer format
  unknown_key.metadata.insert(1, "\"format\":2,");
  expect_rejected(unknown_key,
                  "[checkpoint] metadata has unknown key 'format' (expected optimizer, groups, "
                  "param_steps, param_names, param_shards, param_kept)");
  StateDict unknown_group_key = good;
  unknown_group_key.metadata.insert(unknown_group_key.metadata.find("\"params\":"), "\"frozen\":true,");
  expect_rejected(unknown_group_key,
                  "[checkpoint] metadata: groups[0] has unknown key 'frozen' (expected options, step, params)");
  StateDict huge_steps = good;
  const size_t ns = huge_steps.metadata.find("\"ns_steps\":5");
  REQUIRE(ns != std::string::npos);
  huge_steps.metadata.replace(ns, 12, "\"ns_steps\":4294967301");
  expect_rejected(huge_steps, "[checkpoint] group 0: [Muon] ns_steps must be <= 1000, got 4294967301");
  StateDict fractional_steps = good;
  fractional_steps.metadata.replace(ns, 12, "\"ns_steps\":5.5");
  expect_rejected(fractional_steps, "[checkpoint] group 0: metadata: ns_steps must be an integer");
  StateDict twice = good;  // param 1 listed twice, param 0 not at all
  const size_t listed = twice.metadata.find("\"params\":[0,1]");
  REQUIRE(listed != std::string::npos);
  twice.metadata.replace(listed, 14, "\"params\":[1,1]");
  expect_rejected(twice,
                  "[checkpoint] group 0 lists param 1 at position 0, where param 0 belongs (each param once, "
                  "numbered across the groups in order)");
  StateDict fp8 = good;
  const size_t d = fp8.metadata.find("\"ns_dtype\":null");
  REQUIRE(d != std::string::npos);
  fp8.metadata.replace(d, 15, "\"ns_dtype\":\"fp8\"");
  expect_rejected(fp8, "[checkpoint] group 0: [dtype] unknown dtype 'fp8' (expected f32, bf16 or f16)");
  StateDict other = opt.adamw().state_dict();
  expect_rejected(other, "[checkpoint] holds AdamW state, this optimizer is Muon");
  StateDict bad_option = good;
  const size_t m = bad_option.metadata.find("\"momentum\":0.95");
  REQUIRE(m != std::string::npos);
  bad_option.metadata.replace(m, 15, "\"momentum\":1.5");
  expect_rejected(bad_option, "[checkpoint] group 0: [Muon] momentum must be in [0, 1), got 1.5");

  std::string bytes = serialize_state_dict(good);
  CHECK_THROWS_WITH_AS(parse_state_dict(bytes.data(), 5), "[checkpoint] file of 5 bytes is too short for a safetensors header",
                       Error);
  std::string truncated = bytes.substr(0, bytes.size() - 4);
  CHECK_THROWS_WITH_AS(
      parse_state_dict(truncated.data(), truncated.size()),
      "[checkpoint] tensor 'state.1.momentum_buffer' data_offsets [960, 1536) outside 1532 data bytes (is the file "
      "cut short?)",
      Error);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  const std::string header_only = bytes.substr(0, 8 + header_bytes);  // cut where the data starts
  const std::string cut = test::error_of([&] { parse_state_dict(header_only.data(), header_only.size()); });
  CAPTURE(cut);
  CHECK(cut.find("' has dim ") != std::string::npos);
  CHECK(cut.find(", more than the 0 data bytes of the file (is it cut short?)") != std::string::npos);
  std::string corrupt = bytes;
  corrupt[8] = 'x';  // first byte of the JSON header
  CHECK_THROWS_WITH_AS(parse_state_dict(corrupt.data(), corrupt.size()), "[checkpoint] bad JSON at byte 0: syntax error while parsing value - invalid literal; last read: 'x'",
                       Error);
  CHECK_THROWS_WITH_AS(load_state_dict("/nonexistent/x.safetensors"),
                       "[checkpoint] cannot open '/nonexistent/x.safetensors': No such file or directory", Error);
}

TEST_CASE("a file of the weights loaded as a checkpoint says it is not an optimizer's, and changes nothing") {
  auto params = make_model(3);
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  set_grads(params, 1);
  opt.step();
  const std::string before = serialize_state_dict(opt.state_dict());
  // The README's weights file: a StateDict of the params with metadata of the trainer's own.
  for (const char* metadata : {"{\"step\": 10}", "[10]"}) {
    CAPTURE(metadata);
    StateDict weights;
    weights.metadata = metadata;
    for (const ParamPtr& p : params) weights.tensors.emplace(p->name, p->data.to(Device::cpu()));
    const std::string path = temp_path("weights");
    save_state_dict(weights, path);
    const std::string says =
        "[checkpoint] its metadata names no optimizer: not an optimizer's checkpoint (a file of another StateDict, "
        "such "
        "as the weights?)";
    CHECK(test::error_of([&] { opt.load_checkpoint(path); }) == says);            // a set's file expected
    CHECK(test::error_of([&] { opt.muon().load_state_dict(weights); }) == says);  // one optimizer's
    CHECK(serialize_state_dict(opt.state_dict()) == before);
    std::remove(path.c_str());
  }
}

TEST_CASE("every single-byte flip of a valid file is rejected or loads the same content") {
  // Muon and AdamW state of a small model, each file flipped at every byte with two masks: a flip
  // either fails to parse or load (leaving the optimizer as it was), or changes nothing that loads
  // (e.g. padding whitespace).
  auto params = make_model(3);
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  for (int step = 1; step <= 2; ++step) {
    set_grads(params, step);
    opt.step();
  }
  size_t flips = 0, loaded = 0;
  for (Optimizer* o : std::vector<Optimizer*>{&opt.muon(), &opt.adamw()}) {
    const std::string file = serialize_state_dict(o->state_dict());
    for (size_t at = 0; at < file.size(); ++at)
      for (unsigned char mask : {0x01, 0x5a}) {
        std::string flipped = file;
        flipped[at] = char(flipped[at] ^ mask);
        ++flips;
        try {
          o->load_state_dict(parse_state_dict(flipped.data(), flipped.size()));
        } catch (const Error&) {
          continue;
        }
        ++loaded;
        CAPTURE(at);
        CHECK(serialize_state_dict(o->state_dict()) == file);
      }
    CHECK(serialize_state_dict(o->state_dict()) == file);
  }
  MESSAGE(flips << " flips, " << loaded << " loaded with unchanged content");
}

TEST_CASE("the file reader and writer agree with the in-memory format on every flip and truncation") {
  // save_state_dict streams each tensor to the file and load_state_dict reads each one from it:
  // the file is serialize_state_dict's bytes, and a damaged file gives what parsing its bytes
  // gives (the same error text, or the same content).
  auto params = make_model(5);
  AdamW opt(Stream(Device::cpu()));
  opt.add_param_group(params);
  set_grads(params, 1);
  opt.step();
  const std::string path = temp_path("reader");
  const StateDict state = opt.state_dict();
  save_state_dict(state, path);
  const std::string file = serialize_state_dict(state);
  auto file_bytes = [&] { return test::file_bytes(path); };
  REQUIRE(file_bytes() == file);
  auto outcome = [](const std::function<StateDict()>& read) {
    try {
      return "loaded " + serialize_state_dict(read());
    } catch (const Error& e) {
      return std::string("error ") + e.what();
    }
  };
  size_t cases = 0, agreed = 0;
  for (size_t at = 0; at <= file.size(); at += 3)
    for (int kind = 0; kind < 2; ++kind) {
      std::string damaged = kind == 0 ? file.substr(0, at) : file;
      if (kind == 1 && at < file.size()) damaged[at] = char(damaged[at] ^ 0x21);
      {
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out.write(damaged.data(), std::streamsize(damaged.size()));
      }
      ++cases;
      const std::string from_file = outcome([&] { return load_state_dict(path); });
      const std::string from_memory = outcome([&] { return parse_state_dict(damaged.data(), damaged.size()); });
      CAPTURE(at);
      CAPTURE(kind);
      CHECK(from_file == from_memory);
      agreed += from_file == from_memory;
    }
  std::remove(path.c_str());
  MESSAGE(cases << " damaged files, " << agreed << " read the same from the file as from memory");
}

TEST_CASE("checkpoints carry param names: a reordered or renamed model is a named error listing the differences") {
  auto blocks = [](bool swapped_order, const std::string& renamed) {
    std::vector<ParamPtr> out = {make_param("blocks.0.w", test::random_tensor({16, 16}, DType::f32, 1)),
                                 make_param("blocks.1.w", test::random_tensor({16, 16}, DType::f32, 2)),
                                 make_param("blocks.2.w", test::random_tensor({16, 16}, DType::f32, 3))};
    if (swapped_order) std::swap(out[0], out[1]);
    if (!renamed.empty()) out[2]->name = renamed;
    return out;
  };
  auto saved_params = blocks(false, "");
  Muon saver(Stream(Device::cpu()));
  saver.add_param_group(saved_params);
  for (const ParamPtr& p : saved_params) p->grad = test::random_tensor(p->data.shape(), DType::f32, 9);
  saver.step();
  const StateDict saved = saver.state_dict();
  CHECK(saved.metadata.find("\"param_names\":[\"blocks.0.w\",\"blocks.1.w\",\"blocks.2.w\"]") != std::string::npos);

  auto reordered_params = blocks(true, "");  // same shapes: only the names tell them apart
  Muon reordered(Stream(Device::cpu()));
  reordered.add_param_group(reordered_params);
  const std::string before = serialize_state_dict(reordered.state_dict());
  CHECK(test::error_of([&] { reordered.load_state_dict(saved); }) ==
        "[checkpoint] its params are not this optimizer's (renamed, reordered, added or removed), by index: "
        "0: 'blocks.0.w' in the checkpoint, 'blocks.1.w' here; 1: 'blocks.1.w' in the checkpoint, 'blocks.0.w' here");
  CHECK(serialize_state_dict(reordered.state_dict()) == before);

  auto renamed_params = blocks(false, "blocks.2.mlp.w");
  Muon renamed(Stream(Device::cpu()));
  renamed.add_param_group(renamed_params);
  CHECK(test::error_of([&] { renamed.load_state_dict(saved); }) ==
        "[checkpoint] its params are not this optimizer's (renamed, reordered, added or removed), by index: "
        "2: 'blocks.2.w' in the checkpoint, 'blocks.2.mlp.w' here");

  auto fewer_params = blocks(false, "");
  fewer_params.pop_back();
  Muon fewer(Stream(Device::cpu()));
  fewer.add_param_group(fewer_params);
  CHECK(test::error_of([&] { fewer.load_state_dict(saved); }) ==
        "[checkpoint] its params are not this optimizer's (renamed, reordered, added or removed), by index: "
        "2: 'blocks.2.w' in the checkpoint, (none) here");
}

TEST_CASE("a checkpoint without param names (swapopt 0.2) still loads, by index") {
  auto params = make_model(3);
  MuonWithAdamW opt(Stream(Device::cpu()), params);
  set_grads(params, 1);
  opt.step();
  StateDict old = opt.muon().state_dict();
  const size_t at = old.metadata.find(",\"param_names\":[");
  REQUIRE(at != std::string::npos);
  old.metadata.erase(at, old.metadata.find(']', at) + 1 - at);
  REQUIRE(old.metadata.find("param_names") == std::string::npos);
  auto fresh_params = make_model(3);
  MuonWithAdamW fresh(Stream(Device::cpu()), fresh_params);
  const StateDict reloaded = parse_state_dict(serialize_state_dict(old).data(), serialize_state_dict(old).size());
  fresh.muon().load_state_dict(reloaded);
  CHECK(serialize_state_dict(fresh.muon().state_dict()) == serialize_state_dict(opt.muon().state_dict()));
}

TEST_CASE("an optimizer driven by its update pieces alone saves checkpoints that load and resume bitwise") {
  // The pieces count each param's step; its group's step follows the most-stepped param, so a
  // param never has more steps than its group (which a load requires).
  for (uint32_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    auto model = [&] {
      std::vector<ParamPtr> params;
      for (int i = 0; i < 6; ++i)
        params.push_back(make_param(std::string("w") + std::to_string(i),
                                    test::random_tensor({8 + i, 12}, DType::f32, 40 + uint32_t(i))));
      return params;
    };
    std::vector<ParamPtr> a = model(), b = model();
    Stream stream(Device::cpu());
    AdamW adamw_a(stream);
    Muon muon_a(stream);
    adamw_a.add_param_group({a[0], a[1]});
    adamw_a.add_param_group({a[2]}, AdamWOptions{.amsgrad = true});
    muon_a.add_param_group({a[3], a[4], a[5]});
    // Each round updates a random subset through a random piece, on both models alike.
    auto round = [&](std::vector<ParamPtr>& params, AdamW& adamw, Muon& muon, uint32_t round_seed) {
      std::mt19937 pick(round_seed);
      for (size_t i = 0; i < params.size(); ++i)
        params[i]->grad = test::random_tensor(params[i]->data.shape(), DType::f32, 1000 * round_seed + uint32_t(i));
      if (pick() % 2) adamw.update_param(0, *params[pick() % 2]);
      if (pick() % 2) {
        Param* both[] = {params[0].get(), params[1].get()};
        adamw.update_params(0, both);
      }
      if (pick() % 2) {
        const int64_t n = params[2]->data.numel(), cut = 1 + int64_t(pick() % uint32_t(n - 1));
        adamw.update_param_chunk(1, *params[2], 0, cut, {});
        adamw.update_param_chunk(1, *params[2], cut, n, {});
      }
      std::vector<Param*> muon_params;
      for (size_t i = 3; i < 6; ++i)
        if (pick() % 2) muon_params.push_back(params[i].get());
      if (!muon_params.empty()) muon.update_params(0, muon_params);
    };
    const int before = 1 + int(rng() % 4), after = 1 + int(rng() % 3);
    for (int r = 0; r < before; ++r) round(a, adamw_a, muon_a, seed * 100 + uint32_t(r));
    for (Optimizer* o : {static_cast<Optimizer*>(&adamw_a), static_cast<Optimizer*>(&muon_a)})
      for (const ParamGroup& g : o->param_groups()) {
        int64_t most = 0;
        for (const ParamPtr& p : g.params)
          if (o->state().count(p.get())) most = std::max(most, o->state().at(p.get()).step);
        CHECK(g.step == most);
      }
    // b, a copy of a's weights, resumes from a's checkpoints in fresh optimizers (AdamW's through
    // a swap wrapper).
    stream.synchronize();
    for (size_t i = 0; i < a.size(); ++i)
      std::memcpy(b[i]->data.data_ptr(), a[i]->data.data_ptr(), a[i]->data.nbytes());
    AdamW adamw_c(stream);
    Muon muon_c(stream);
    adamw_c.add_param_group({b[0], b[1]});
    adamw_c.add_param_group({b[2]}, AdamWOptions{.amsgrad = true});
    muon_c.add_param_group({b[3], b[4], b[5]});
    SwapConfig config;
    config.min_numel = 1;
    auto swapped_c = swap_adamw(adamw_c, config);
    REQUIRE_NOTHROW(swapped_c->load_state_dict(adamw_a.state_dict()));
    REQUIRE_NOTHROW(muon_c.load_state_dict(muon_a.state_dict()));
    swapped_c.reset();  // the pieces run on an unwrapped optimizer
    for (int r = 0; r < after; ++r) {
      round(a, adamw_a, muon_a, seed * 100 + 50 + uint32_t(r));
      round(b, adamw_c, muon_c, seed * 100 + 50 + uint32_t(r));
    }
    stream.synchronize();
    for (size_t i = 0; i < a.size(); ++i) CHECK(test::same_bits(a[i]->data, b[i]->data));
    CHECK(serialize_state_dict(adamw_a.state_dict()) == serialize_state_dict(adamw_c.state_dict()));
    CHECK(serialize_state_dict(muon_a.state_dict()) == serialize_state_dict(muon_c.state_dict()));
  }
}

TEST_CASE("a state dict no load would take is refused by the save, which writes nothing; a FIFO is no checkpoint") {
  const std::string path = temp_path("unloadable");
  std::remove(path.c_str());
  auto with = [](const std::string& name, const Tensor& t, std::string metadata = "{}") {
    StateDict s;
    s.metadata = std::move(metadata);
    s.tensors.emplace(name, t);
    return s;
  };
  const Tensor x = test::random_tensor({3}, DType::f32, 1);
  struct Case {
    const char* what;
    StateDict state;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"the metadata's name", with("__metadata__", x),
       "[checkpoint] a tensor cannot be named '__metadata__': the format keeps that name for the metadata"},
      {"the metadata's name, no elements", with("__metadata__", Tensor::zeros({0}, DType::f32, Device::cpu())),
       "[checkpoint] a tensor cannot be named '__metadata__': the format keeps that name for the metadata"},
      {"65 dims", with("t", Tensor::zeros(Shape(65, 1), DType::f32, Device::cpu())),
       "[checkpoint] tensor 't' has 65 dims: a checkpoint holds at most 64"},
      {"no elements, huge dims", with("t", Tensor::zeros({0, int64_t(1) << 33}, DType::f32, Device::cpu())),
       "[checkpoint] tensor 't' has no elements but dims [0, 8589934592] beyond 4294967296 together"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    CHECK(test::error_of([&] { save_state_dict(c.state, path); }) == c.want);
    CHECK(test::error_of([&] { serialize_state_dict(c.state); }) == c.want);
    CHECK_FALSE(std::filesystem::exists(path));
  }
  const std::string header_error =
      test::error_of([&] { save_state_dict(with("t", x, std::string(101u << 20, 'm')), path); });
  CHECK(header_error.rfind("[checkpoint] the header would take ", 0) == 0);
  CHECK(header_error.find("bytes (metadata 105906176, 1 tensor names): a checkpoint holds at most 104857600") !=
        std::string::npos);
  CHECK_FALSE(std::filesystem::exists(path));

  // What the save takes, the load takes: 64 dims, and no elements up to the bound.
  for (const Shape& shape : {Shape(64, 1), Shape{0, int64_t(1) << 32}, Shape{9, 1, 1, 1, 1, 1, 1, 1, 2}}) {
    const StateDict state = with("t", Tensor::zeros(shape, DType::f32, Device::cpu()));
    save_state_dict(state, path);
    CHECK(serialize_state_dict(load_state_dict(path)) == serialize_state_dict(state));
    std::remove(path.c_str());
  }

  // What the save refuses, a load refuses in the same words (a header another tool wrote).
  const auto file_of_shape = [](const std::string& shape) {
    const std::string header = "{\"t\":{\"dtype\":\"F32\",\"shape\":" + shape +
                               ",\"data_offsets\":[0,0]},\"__metadata__\":{\"swapopt\":\"{}\"}}";
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
    return file + header;
  };
  std::string ones = "[1";
  for (int i = 1; i < 65; ++i) ones += ",1";
  CheckpointReadOptions trust;
  trust.allow_missing_checksums = true;
  for (const auto& [shape, want] :
       std::vector<std::pair<std::string, std::string>>{{ones + "]", cases[2].want},
                                                        {"[0,8589934592]", cases[3].want},
                                                        {"[0,-1]", "[checkpoint] tensor 't' has negative dim -1"}}) {
    CAPTURE(shape);
    const std::string file = file_of_shape(shape);
    CHECK(test::error_of([&] { parse_state_dict(file.data(), file.size(), trust); }) == want);
  }

  // Opening a FIFO waited for a writer; it is refused at once.
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
  CHECK(test::error_of([&] { load_state_dict(path); }) ==
        "[checkpoint] cannot read '" + path + "': not a regular file");
  std::remove(path.c_str());
}

TEST_CASE("two writers saving to one path at once take turns: every save commits a whole file") {
  // Each thread saves its own state to the same path in rounds started together; the temporary is
  // locked from its creation to its rename, so neither commit fails and the file is one state.
  const std::string path = temp_path("two_writers");
  std::remove(path.c_str());
  std::vector<StateDict> states(2);
  std::vector<std::string> bytes;
  for (uint32_t i = 0; i < 2; ++i) {
    states[i].metadata = "{\"writer\":" + std::to_string(i) + "}";
    states[i].tensors.emplace("t", test::random_tensor({1 << 18}, DType::f32, 7 + i));
    bytes.push_back(serialize_state_dict(states[i]));
  }
  constexpr int kRounds = 24;
  std::barrier start(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> writers;
  std::vector<std::string> seen;  // the file after each round
  std::mutex seen_mutex;
  for (size_t i = 0; i < 2; ++i) {
    writers.emplace_back([&, i] {
      for (int round = 0; round < kRounds; ++round) {
        start.arrive_and_wait();
        const std::string error = test::error_of([&] { save_state_dict(states[i], path); });
        if (!error.empty() && errors[i].empty()) errors[i] = error;
        start.arrive_and_wait();
        if (i == 0) {
          std::lock_guard<std::mutex> lock(seen_mutex);
          seen.push_back(test::file_bytes(path));
        }
      }
    });
  }
  for (std::thread& t : writers) t.join();
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
  REQUIRE(seen.size() == size_t(kRounds));
  for (const std::string& file : seen) CHECK((file == bytes[0] || file == bytes[1]));
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  std::remove(path.c_str());
}

TEST_CASE("a temporary a dead writer left behind, longer than the new file, is emptied before the save") {
  const std::string path = temp_path("stale_tmp");
  StateDict state;
  state.metadata = "{}";
  state.tensors.emplace("t", test::random_tensor({16}, DType::f32, 3));
  { std::ofstream(path + ".tmp", std::ios::binary) << std::string(4096, 'x'); }
  save_state_dict(state, path);
  CHECK(test::file_bytes(path) == serialize_state_dict(state));
  CHECK_FALSE(std::filesystem::exists(path + ".tmp"));
  std::remove(path.c_str());
}
