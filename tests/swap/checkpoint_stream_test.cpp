// save_checkpoint / load_checkpoint: the files and the loads of the StateDict path, bit for bit,
// for bare, swapped and set optimizers, without a copy of the state in between.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>

#include "swap_fixture.h"
#include "swapopt/optim/routing.h"
#include "swapopt/swap/swap_optimizer_set.h"

using namespace swapopt;

namespace {

using test::file_bytes;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

/** One optimizer under test (bare, swapped or a set) on its own copy of the model. */
struct Subject {
  std::vector<ParamPtr> params;
  std::function<void()> step;
  std::function<StateDict()> state_dict;
  std::function<void(const StateDict&)> load_state_dict;
  std::function<void(const std::string&)> save_checkpoint;
  std::function<void(const std::string&)> load_checkpoint;
  std::function<void(const std::string&)> save_async;  // swapped kinds only
  std::function<void()> wait_save;
  std::vector<std::shared_ptr<void>> keep;  // what the functions above refer to, wrappers after what they wrap

  Subject() = default;
  Subject(Subject&&) = default;
  ~Subject() {  // a wrapper goes before the optimizer it wraps
    while (!keep.empty()) keep.pop_back();
  }
};

/** The kinds of optimizer that save and load checkpoints. */
const std::vector<std::string> kKinds = {"Muon",          "AdamW",         "swapped Muon", "swapped Muon per-tensor",
                                         "swapped AdamW", "swapped Muon chunked", "swapped AdamW chunked",
                                         "swapped Muon+AdamW set"};

Subject make_subject(const std::string& kind) {
  Subject s;
  s.params = test::swap_model(11);
  const Stream stream(Device::cpu());
  SwapConfig config;
  config.swap_times = 3;
  config.min_numel = 64;  // "gate" (32 elements) stays on the device: both kinds of state are saved
  config.packed = kind != "swapped Muon per-tensor";
  auto bind = [&s](auto& opt) {
    if constexpr (requires { opt.save_async(std::string()); }) {
      s.save_async = [&opt](const std::string& path) { opt.save_async(path); };
      s.wait_save = [&opt] { opt.wait_save(); };
    }
    s.step = [&opt] { opt.step(); };
    s.state_dict = [&opt] { return opt.state_dict(); };
    s.load_state_dict = [&opt](const StateDict& state) { opt.load_state_dict(state); };
    s.save_checkpoint = [&opt](const std::string& path) { opt.save_checkpoint(path); };
    s.load_checkpoint = [&opt](const std::string& path) { opt.load_checkpoint(path); };
  };
  if (kind == "Muon" || kind == "swapped Muon" || kind == "swapped Muon per-tensor" || kind == "swapped Muon chunked") {
    auto muon = std::make_shared<Muon>(stream);
    muon->add_param_group(s.params);
    s.keep.push_back(muon);
    if (kind == "Muon") {
      bind(*muon);
    } else {
      if (kind == "swapped Muon chunked") {  // 1 KiB beside the largest workspace: the larger units stream in chunks
        int64_t workspace = 0;
        for (const UpdateUnit& u : MuonSwapAdapter(*muon).plan_units(true)) workspace = std::max(workspace, u.workspace_bytes);
        config.device_budget_bytes = size_t(workspace) + 1024;
      }
      std::shared_ptr<SwapOptimizer> swapped = swap_muon(*muon, config);
      s.keep.push_back(swapped);
      bind(*swapped);
    }
  } else if (kind == "AdamW" || kind == "swapped AdamW" || kind == "swapped AdamW chunked") {
    auto adamw = std::make_shared<AdamW>(stream);
    adamw->add_param_group(s.params);
    s.keep.push_back(adamw);
    if (kind == "AdamW") {
      bind(*adamw);
    } else {
      if (kind == "swapped AdamW chunked") config.device_budget_bytes = 4096;  // every unit of 1 KiB elements and more chunked
      std::shared_ptr<SwapOptimizer> swapped = swap_adamw(*adamw, config);
      s.keep.push_back(swapped);
      bind(*swapped);
    }
  } else {
    auto both = std::make_shared<MuonWithAdamW>(stream, s.params);
    s.keep.push_back(both);
    std::shared_ptr<SwapOptimizerSet> set = swap_muon_with_adamw(*both, config);
    s.keep.push_back(set);
    bind(*set);
  }
  return s;
}

/** Two steps with some grads missing (so some params have no state yet). */
void train(Subject& s, int first_step, int steps) {
  for (int step = first_step; step < first_step + steps; ++step) {
    test::set_swap_grads(s.params, step);
    s.step();
  }
}

}  // namespace

TEST_SUITE("swap") {

TEST_CASE("save_checkpoint writes the StateDict path's file and load_checkpoint loads it the same, bit for bit") {
  const std::string path = test::temp_file("stream.safetensors");
  for (const std::string& kind : kKinds) {
    CAPTURE(kind);
    Subject saver = make_subject(kind);
    train(saver, 1, 2);
    saver.save_checkpoint(path);
    const std::string streamed = file_bytes(path);
    CHECK(streamed == serialize_state_dict(saver.state_dict()));

    Subject via_file = make_subject(kind), via_state = make_subject(kind);
    via_file.load_checkpoint(path);
    via_state.load_state_dict(load_state_dict(path));
    CHECK(serialize_state_dict(via_file.state_dict()) == streamed);
    for (Subject* loaded : {&via_file, &via_state})  // a checkpoint holds no params: the trainer's do
      for (size_t i = 0; i < saver.params.size(); ++i)
        std::memcpy(loaded->params[i]->data.data_ptr(), saver.params[i]->data.data_ptr(), saver.params[i]->data.nbytes());
    train(via_file, 3, 2);
    train(via_state, 3, 2);
    train(saver, 3, 2);
    const std::string continued = serialize_state_dict(saver.state_dict());  // (state_dict() waits for the steps)
    CHECK(serialize_state_dict(via_file.state_dict()) == continued);
    CHECK(serialize_state_dict(via_state.state_dict()) == continued);
    CHECK(test::params_bitwise_equal(via_file.params, saver.params));
    CHECK(test::params_bitwise_equal(via_state.params, saver.params));
  }
  std::remove(path.c_str());
}

TEST_CASE("load_checkpoint of a damaged or foreign file gives the StateDict path's error and changes nothing") {
  const std::string path = test::temp_file("stream_bad.safetensors");
  for (const std::string& kind : kKinds) {
    CAPTURE(kind);
    Subject saver = make_subject(kind);
    train(saver, 1, 2);
    const std::string good = serialize_state_dict(saver.state_dict());
    Subject target = make_subject(kind);
    train(target, 1, 3);
    const std::string before = serialize_state_dict(target.state_dict());
    std::vector<ParamPtr> params_before;
    for (const ParamPtr& p : target.params) params_before.push_back(make_param(p->name, p->data.clone()));
    // Flips through the header and the data, truncations, and another kind's valid file.
    std::vector<std::string> damaged;
    for (size_t at = 0; at < good.size(); at += good.size() / 97 + 1) {
      std::string flipped = good;
      flipped[at] = char(flipped[at] ^ 0x10);
      damaged.push_back(flipped);
      damaged.push_back(good.substr(0, at));
    }
    // A valid file of another optimizer (AdamW's and swapped AdamW's files load into each other).
    Subject other = make_subject(kind.find("AdamW") != std::string::npos && kind.find("Muon") == std::string::npos ? "Muon" : "AdamW");
    train(other, 1, 1);
    damaged.push_back(serialize_state_dict(other.state_dict()));
    size_t rejected = 0;
    for (const std::string& bytes : damaged) {
      write_bytes(path, bytes);
      std::string from_file = "loaded", from_state = "loaded";
      try {
        target.load_checkpoint(path);
      } catch (const Error& e) {
        from_file = e.what();
      }
      if (from_file == "loaded") {  // e.g. a flip in the header's padding: the same content
        CHECK(serialize_state_dict(target.state_dict()) == good);
        target.load_state_dict(parse_state_dict(before.data(), before.size()));
        continue;
      }
      ++rejected;
      try {
        target.load_state_dict(load_state_dict(path));
      } catch (const Error& e) {
        from_state = e.what();
      }
      CHECK(from_file == from_state);
      CHECK(serialize_state_dict(target.state_dict()) == before);
      CHECK(test::params_bitwise_equal(target.params, params_before));
    }
    CHECK(rejected > damaged.size() / 2);
  }
  std::remove(path.c_str());
}

TEST_CASE("a state tensor larger than the staging buffer streams in pieces, both ways") {
  // 5M f32 elements: 20 MB per moment, two 16 MiB pieces each through the staging buffer (bare
  // AdamW's device state) and in one read into the mirrors (swapped).
  const std::string path = test::temp_file("stream_big.safetensors");
  auto model = [] {
    std::vector<ParamPtr> params = {make_param("big", test::random_tensor({5 << 20}, DType::f32, 3))};
    params[0]->grad = test::random_tensor({5 << 20}, DType::f32, 4);
    return params;
  };
  const Stream stream(Device::cpu());
  auto params = model();
  AdamW saver(stream);
  saver.add_param_group(params);
  saver.step();
  saver.save_checkpoint(path);
  const std::string want = serialize_state_dict(saver.state_dict());
  CHECK(file_bytes(path) == want);

  auto bare_params = model(), swapped_params = model();
  AdamW bare(stream), inner(stream);
  bare.add_param_group(bare_params);
  inner.add_param_group(swapped_params);
  auto swapped = swap_adamw(inner);
  bare.load_checkpoint(path);
  swapped->load_checkpoint(path);
  CHECK(serialize_state_dict(bare.state_dict()) == want);
  CHECK(serialize_state_dict(swapped->state_dict()) == want);
  std::remove(path.c_str());
}

TEST_CASE("save_async writes what a synchronous save writes at that step while the steps go on, and changes no step") {
  const std::string sync_path = test::temp_file("async_sync.safetensors"), async_path = test::temp_file("async.safetensors");
  for (const std::string& kind : kKinds) {
    if (kind.rfind("swapped", 0) != 0) continue;
    CAPTURE(kind);
    Subject saver = make_subject(kind), twin = make_subject(kind);
    train(saver, 1, 2);
    train(twin, 1, 2);
    saver.save_checkpoint(sync_path);
    saver.save_async(async_path);
    train(saver, 3, 3);  // offloads into mirrors the writer may still be reading
    saver.wait_save();
    CHECK(file_bytes(async_path) == file_bytes(sync_path));
    train(twin, 3, 3);
    CHECK(serialize_state_dict(saver.state_dict()) == serialize_state_dict(twin.state_dict()));
    CHECK(test::params_bitwise_equal(saver.params, twin.params));
  }
  std::remove(sync_path.c_str());
  std::remove(async_path.c_str());
}

TEST_CASE("save_async: the offloads of later steps wait until the writer has written their mirrors") {
  // The file is written into a FIFO whose reader starts late, so the writer is held up after its
  // checksum pass while the next steps run: an offload that did not wait for the writer would
  // change bytes it has already checksummed but not yet written. Every swapped kind (packed,
  // per-tensor, a set), then a load, which must wait for the writer too.
  const std::string sync_path = test::temp_file("async_fifo_sync.safetensors"),
                    async_path = test::temp_file("async_fifo.safetensors"), fifo = async_path + ".tmp";
  for (const std::string& kind : kKinds) {
    if (kind.rfind("swapped", 0) != 0) continue;
    CAPTURE(kind);
    Subject s = make_subject(kind);
    train(s, 1, 2);
    s.save_checkpoint(sync_path);
    std::remove(fifo.c_str());
    REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
    std::string written;
    std::thread reader([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      written = file_bytes(fifo);
    });
    // A FIFO cannot be fsynced, so the commit fails once every byte is through: that error reaches
    // a later step or wait_save(), and the bytes are what the test compares.
    std::string error;
    s.save_async(async_path);
    for (int step = 3; step < 6; ++step) {  // their offloads wait for the reader
      try {
        train(s, step, 1);
      } catch (const Error& e) {
        error = e.what();
      }
    }
    s.load_checkpoint(sync_path);  // waits for the writer before it reads or writes anything
    try {
      s.wait_save();
    } catch (const Error& e) {
      error = e.what();
    }
    reader.join();
    CHECK(error == "[checkpoint] saving '" + async_path + "' in the background failed: [checkpoint] cannot commit '" +
                       async_path + "': Invalid argument");
    CHECK(written == file_bytes(sync_path));
    std::remove(fifo.c_str());
  }
  std::remove(sync_path.c_str());
}

TEST_CASE("a member's own save_async while its set's runs waits for the set's, which stays intact") {
  // One mirror reader per runtime: the member's save waits for the set's writer (held up by a
  // FIFO) instead of replacing it, so the set's file keeps the bytes it checksummed.
  const std::string set_sync = test::temp_file("set_sync.safetensors"), set_async = test::temp_file("set_async.safetensors"),
                    member_sync = test::temp_file("member_sync.safetensors"),
                    member_async = test::temp_file("member_async.safetensors"), fifo = set_async + ".tmp";
  auto params = test::swap_model(12);
  MuonWithAdamW both(Stream(Device::cpu()), params);
  SwapConfig config;
  config.swap_times = 3;
  auto set = swap_muon_with_adamw(both, config);
  for (int step = 1; step <= 2; ++step) {
    test::set_swap_grads(params, step);
    set->step();
  }
  set->save_checkpoint(set_sync);
  set->member("muon").save_checkpoint(member_sync);
  std::remove(fifo.c_str());
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  std::string written;
  std::thread reader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    written = file_bytes(fifo);
  });
  set->save_async(set_async);
  set->member("muon").save_async(member_async);  // waits for the set's writer first
  int failures = 0;  // the set's save fails at its commit (a FIFO cannot be fsynced), reported once
  for (int step = 3; step <= 4; ++step) {
    test::set_swap_grads(params, step);
    try {
      set->step();
    } catch (const Error&) {
      ++failures;
    }
  }
  try {
    set->wait_save();
  } catch (const Error&) {
    ++failures;
  }
  CHECK(failures == 1);
  CHECK_NOTHROW(set->member("muon").wait_save());
  reader.join();
  CHECK(written == file_bytes(set_sync));
  CHECK(file_bytes(member_async) == file_bytes(member_sync));
  for (const std::string& path : {set_sync, member_sync, member_async, fifo}) std::remove(path.c_str());
}

TEST_CASE(
    "a failed save_async is thrown by the next step, before it changes anything, the next save_async, or wait_save, "
    "once") {
  for (const std::string by : {"step", "save_async", "wait_save"}) {
    CAPTURE(by);
    Subject s = make_subject("swapped AdamW"), twin = make_subject("swapped AdamW");
    train(s, 1, 1);
    train(twin, 1, 1);
    s.save_async("/nonexistent-dir/x.safetensors");
    const std::string want = "[checkpoint] saving '/nonexistent-dir/x.safetensors' in the background failed: [checkpoint] "
                             "cannot create '/nonexistent-dir/x.safetensors.tmp': No such file or directory";
    if (by == "step") {
      test::set_swap_grads(s.params, 2);
      // The writer fails at once (the directory does not exist); a step reports a save that has
      // finished, so give the writer's thread ample time to get there.
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      CHECK_THROWS_WITH_AS(s.step(), want.c_str(), Error);
    } else if (by == "save_async") {
      const std::string path = test::temp_file("after_failed_save.safetensors");
      std::remove(path.c_str());
      CHECK_THROWS_WITH_AS(s.save_async(path), want.c_str(), Error);
      CHECK_FALSE(std::filesystem::exists(path));  // this save did not start: call it again
      s.save_async(path);
      s.wait_save();
      CHECK(serialize_state_dict(load_state_dict(path)) == serialize_state_dict(twin.state_dict()));
      std::remove(path.c_str());
    } else {
      CHECK_THROWS_WITH_AS(s.wait_save(), want.c_str(), Error);
    }
    CHECK_NOTHROW(s.wait_save());  // reported once
    CHECK(serialize_state_dict(s.state_dict()) == serialize_state_dict(twin.state_dict()));
    train(s, 2, 1);
    train(twin, 2, 1);
    CHECK(serialize_state_dict(s.state_dict()) == serialize_state_dict(twin.state_dict()));
  }
}

TEST_CASE("a process killed while save_async writes leaves the previous checkpoint whole and loadable") {
  // The test runs itself as a child (SWAPOPT_KILLED_SAVE=<dir>): it saves a checkpoint, keeps a
  // copy of it, steps, and starts save_async() over the same path with the process's file size
  // limit at half the checkpoint. The kernel then ends it (SIGXFSZ) inside the writer's write()
  // halfway through the temporary file, before its fsync and rename, on every run. (Polling for
  // the temporary file and raising SIGKILL raced the writer: on a loaded machine the save could
  // finish, or be renamed, before the kill.)
  auto model = [] {
    std::vector<ParamPtr> params;
    for (int i = 0; i < 8; ++i) {
      params.push_back(make_param("w." + std::to_string(i), test::random_tensor({1 << 20}, DType::f32, 70 + uint32_t(i))));
      params.back()->grad = test::random_tensor({1 << 20}, DType::f32, 80 + uint32_t(i));
    }
    return params;
  };
  constexpr rlim_t kHalfCheckpoint = 32 << 20;  // 8 params of 2^20 f32 elements, two moments each: 64 MiB
  if (const char* dir = std::getenv("SWAPOPT_KILLED_SAVE")) {
    const std::string path = std::string(dir) + "/run.safetensors";
    auto params = model();
    AdamW adamw(Stream(Device::cpu()));
    adamw.add_param_group(params);
    auto swapped = swap_adamw(adamw);
    swapped->step();
    swapped->save_checkpoint(path);
    write_bytes(path + ".previous", file_bytes(path));
    swapped->step();
    rlimit limit{};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = kHalfCheckpoint;
    const rlimit no_core{0, 0};
    // A parent that ignores SIGXFSZ (Python's os.system does) passes that on: the write would
    // fail with EFBIG instead, and the save would throw rather than the process end.
    if (std::signal(SIGXFSZ, SIG_DFL) == SIG_ERR || ::setrlimit(RLIMIT_CORE, &no_core) != 0 ||
        ::setrlimit(RLIMIT_FSIZE, &limit) != 0)
      std::_Exit(4);
    swapped->save_async(path);
    swapped->wait_save();
    std::_Exit(3);  // the save finished: the limit did not stop it
  }
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  REQUIRE(n > 0);
  self[n] = '\0';
  char dir_template[] = "/tmp/swapopt-killed-save-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template, path = dir + "/run.safetensors";
  const int status = std::system(
      ("SWAPOPT_KILLED_SAVE=" + dir + " '" + self + "' -tc='*killed while save_async*' >/dev/null 2>&1").c_str());
  // The child's end: the shell reports a command ended by a signal as 128 + its number (dash), or
  // is itself the process ended where it execs the command.
  CAPTURE(status);
  REQUIRE(((WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGXFSZ) ||
           (WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ)));
  struct stat info_of_tmp {};
  CHECK(::stat((path + ".tmp").c_str(), &info_of_tmp) == 0);
  CHECK(info_of_tmp.st_size == off_t(kHalfCheckpoint));       // the writer was stopped halfway
  CHECK(file_bytes(path) == file_bytes(path + ".previous"));  // untouched by the interrupted save
  auto params = model();
  AdamW adamw(Stream(Device::cpu()));
  adamw.add_param_group(params);
  auto swapped = swap_adamw(adamw);
  CHECK_NOTHROW(swapped->load_checkpoint(path));
  CHECK_THROWS_AS(swapped->load_checkpoint(path + ".tmp"), Error);  // the partial file is left, and rejected
  for (const char* name : {"/run.safetensors", "/run.safetensors.tmp", "/run.safetensors.previous"})
    std::remove((dir + name).c_str());
  ::rmdir(dir.c_str());
}

}  // TEST_SUITE
