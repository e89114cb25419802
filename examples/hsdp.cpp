// swapopt-hsdp: data-parallel training with HSDP Muon on a replicate x shard mesh of processes
// (Gloo over loopback, CPU backend). Each rank holds a row shard of every weight, gathers the full
// weights for its forward pass on its own batch, averages the gradients over all ranks, and steps
// a swapped HSDP Muon on its shards: momentum exists only on each param's owner replica, for its
// shard, and lives in host memory between steps.
//
//   swapopt-hsdp [--mesh 2x2] [--hidden 256] [--layers 5] [--steps 60] [--batch 128] [--swap-times 6]
//                [--no-swap] [--checkpoint-dir DIR [--checkpoint-every 10]]
//
// With --checkpoint-dir every rank writes its shard of the weights and its optimizer state there
// every --checkpoint-every steps (each file atomically; the last two steps kept) and, when it
// starts, resumes from the newest step every rank has: a job restarted after a failure continues
// bit for bit as if it had not stopped (tests/hosts, scenario 8).
//
// Without RANK in the environment it launches the mesh's ranks itself (fork + exec of this program
// with RANK, WORLD_SIZE, LOCAL_RANK and a FileStore rendezvous directory) and waits for them; with
// RANK set (e.g. under your own launcher, SWAPOPT_RENDEZVOUS or SWAPOPT_REDIS given) it is one rank.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>

#include "swapopt/swapopt.h"

using namespace swapopt;

namespace {

struct Config {
  int64_t replicas = 2, shards = 2;
  int64_t input = 64, hidden = 256, layers = 5, output = 16, batch = 128;
  int steps = 60;
  int swap_times = 6;
  bool swap = true;
  bool fingerprint = false;  // every rank prints hashes of its params and optimizer state at the end
  std::string checkpoint_dir;  // empty: no checkpoints
  int checkpoint_every = 10;
};

constexpr const char* kFlags =
    "flags: --mesh RxS --hidden N --layers N --steps N --batch N --swap-times N --no-swap --fingerprint\n"
    "       --checkpoint-dir DIR --checkpoint-every N --help\n";

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "swapopt-hsdp: %s\n%s", why.c_str(), kFlags);
  std::exit(2);
}

Config parse(int argc, char** argv) {
  Config c;
  bool given_every = false;  // --checkpoint-every
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("swapopt-hsdp: data-parallel training with swapped HSDP Muon on an RxS mesh of local processes\n%s", kFlags);
      std::exit(0);
    }
    if (flag == "--no-swap") {
      c.swap = false;
      continue;
    }
    if (flag == "--fingerprint") {
      c.fingerprint = true;
      continue;
    }
    static const char* const kValued[] = {"--checkpoint-dir", "--mesh",  "--hidden",     "--layers",
                                          "--steps",          "--batch", "--swap-times", "--checkpoint-every"};
    if (std::find(std::begin(kValued), std::end(kValued), flag) == std::end(kValued)) usage("unknown flag " + flag);
    if (i + 1 >= argc) usage("missing value for " + flag);
    const std::string value = argv[++i];
    if (flag == "--checkpoint-dir") {
      c.checkpoint_dir = value;
      continue;
    }
    if (flag == "--mesh") {
      int used = 0;
      if (std::sscanf(value.c_str(), "%ldx%ld%n", &c.replicas, &c.shards, &used) != 2 || size_t(used) != value.size())
        usage("--mesh takes RxS, e.g. 2x2");
      continue;
    }
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(value.c_str(), &end, 10);
    if (value.empty() || *end != '\0' || errno == ERANGE) usage("bad value '" + value + "' for " + flag);
    if (v < 1 || v > INT32_MAX)
      usage("value " + value + " for " + flag + " is out of range (1 to " + std::to_string(INT32_MAX) + ")");
    if (flag == "--hidden") c.hidden = v;
    else if (flag == "--layers") c.layers = v;
    else if (flag == "--steps") c.steps = int(v);
    else if (flag == "--batch") c.batch = v;
    else if (flag == "--swap-times") c.swap_times = int(v);
    else {
      c.checkpoint_every = int(v);  // --checkpoint-every, the last flag kValued names
      given_every = true;
    }
  }
  if (c.replicas < 1 || c.shards < 1) usage("--mesh takes RxS with R and S at least 1");
  if (given_every && c.checkpoint_dir.empty()) usage("--checkpoint-every needs --checkpoint-dir");
  if (c.hidden % c.shards != 0 || c.output % c.shards != 0)
    usage("--hidden and the output width " + std::to_string(c.output) + " must be multiples of the shard count");
  return c;
}

/** FNV-1a over `n` bytes, continuing from `h`: a fingerprint to compare runs bit for bit. */
uint64_t fnv1a(const void* data, size_t n, uint64_t h = 14695981039346656037ull) {
  const auto* b = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/** Starts every rank of the mesh from this program and returns the worst exit code. */
int launch(const Config& c, char** argv) {
  char dir_template[] = "/tmp/swapopt_hsdp_XXXXXX";
  const char* dir = ::mkdtemp(dir_template);
  if (dir == nullptr) usage("cannot create a rendezvous directory under /tmp");
  const int world = int(c.replicas * c.shards);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("SWAPOPT_RENDEZVOUS", dir, 1);
      // The ranks share this machine's cores: one OpenMP thread each unless told otherwise.
      ::setenv("OMP_NUM_THREADS", "1", 0);
      ::execv("/proc/self/exe", argv);
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  int worst = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    worst = std::max(worst, code);
  }
  std::system(("rm -rf " + std::string(dir)).c_str());
  return worst;
}

Tensor random_matrix(std::mt19937& gen, const Shape& shape, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(size_t(shape_numel(shape)));
  for (float& x : v) x = dist(gen);
  return Tensor::from_floats(v, shape);
}

/** A weight sharded on its rows over the shard dim, replicated over the replicate dim. */
ParamPtr sharded_weight(const std::string& name, const Tensor& full, const std::shared_ptr<const DeviceMesh>& mesh) {
  const std::vector<Placement> placements = {Placement::Replicate(), Placement::Shard(0)};
  Shape offset;
  const Shape local = DTensor::local_shape_at(full.shape(), *mesh, placements, mesh->coordinate(), &offset);
  ParamPtr p = make_param(name, full.narrow(0, offset[0], local[0]).clone());
  p->layout = DTensor(p->data, full.shape(), mesh, placements);
  return p;
}

/** This rank's checkpoint files of step `step`: its weights' shards and its optimizer state. */
std::string checkpoint_path(const Config& c, int rank, int step, const char* what) {
  return c.checkpoint_dir + "/rank" + std::to_string(rank) + "-step" + std::to_string(step) + "." + what;
}

/** The newest step of which this rank has both files (the weights are written last), or 0. */
int newest_checkpoint(const Config& c, int rank) {
  int newest = 0;
  const std::string prefix = "rank" + std::to_string(rank) + "-step";
  for (const auto& entry : std::filesystem::directory_iterator(c.checkpoint_dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || !name.ends_with(".weights")) continue;
    const int step = std::atoi(name.c_str() + prefix.size());
    if (step > newest && std::filesystem::exists(checkpoint_path(c, rank, step, "optimizer"))) newest = step;
  }
  return newest;
}

/** The step every rank resumes from: the newest one all ranks have. A rank saves step s only after
 *  every rank finished step s - every (its collectives needed them all), so keeping two steps is
 *  enough for every rank to hold the minimum. */
int agree_on_resume_step(const Config& c, Communicator& world) {
  std::vector<float> newest(size_t(world.size()), 0.f);
  newest[size_t(world.rank())] = float(newest_checkpoint(c, world.rank()));
  Tensor all = Tensor::from_floats(newest, {int64_t(newest.size())});
  world.all_reduce(all)->wait();  // every entry but one is zero: the sum gathers them
  return int(*std::min_element(all.data<float>(), all.data<float>() + all.numel()));
}

int run_rank(const Config& c) {
  const LaunchEnv env = LaunchEnv::from_environment();
  if (env.world_size != c.replicas * c.shards)
    usage("WORLD_SIZE " + std::to_string(env.world_size) + " does not match --mesh " + std::to_string(c.replicas) +
          "x" + std::to_string(c.shards) + " (" + std::to_string(c.replicas * c.shards) + " ranks)");
  std::shared_ptr<Communicator> world = make_gloo_communicator(env);
  auto mesh = std::make_shared<DeviceMesh>(std::vector<int64_t>{c.replicas, c.shards},
                                           std::vector<std::string>{"replicate", "shard"}, env.rank);
  auto shard_group = world->sub_group(
      [&] {
        std::vector<int> ranks;
        for (int64_t s = 0; s < c.shards; ++s) ranks.push_back(int(mesh->coordinate()[0] * c.shards + s));
        return ranks;
      }(),
      "model-shards" + std::to_string(mesh->coordinate()[0]));
  const bool lead = env.rank == 0;

  // The same initial weights on every rank (one seed); each keeps its rows. The teacher too.
  std::mt19937 init(7);
  std::vector<ParamPtr> weights;
  int64_t in = c.input;
  for (int64_t k = 0; k < c.layers; ++k) {
    weights.push_back(sharded_weight("layers." + std::to_string(k) + ".weight",
                                     random_matrix(init, {c.hidden, in}, 1.f / std::sqrt(float(in))), mesh));
    in = c.hidden;
  }
  weights.push_back(sharded_weight("head.weight", random_matrix(init, {c.output, in}, 1.f / std::sqrt(float(in))), mesh));
  const Tensor teacher = random_matrix(init, {c.output, c.input}, 1.f / std::sqrt(float(c.input)));

  Stream stream(Device::cpu());
  Muon muon(stream);
  MuonOptions options;
  options.lr = 0.02;
  options.weight_decay = 0.0;
  muon.add_param_group(weights, options);
  // Small assignments (one hidden weight per replica each) so that the swap has several units to
  // pipeline: a unit never splits an assignment, and the default cap (512 MiB x replicas) would
  // make a single one here.
  HsdpOptions hsdp;
  hsdp.cap_bytes = c.hidden * c.hidden * int64_t(sizeof(float));
  muon.enable_hsdp(world, hsdp);
  SwapConfig swap;
  swap.swap_times = c.swap_times;
  std::unique_ptr<SwapOptimizer> swapped = c.swap ? swap_muon(muon, swap) : nullptr;
  auto optimizer_step = [&] { c.swap ? swapped->step() : muon.step(); };

  int first_step = 1;
  if (!c.checkpoint_dir.empty()) {
    std::filesystem::create_directories(c.checkpoint_dir);
    if (const int resume = agree_on_resume_step(c, *world); resume > 0) {
      const StateDict saved = load_state_dict(checkpoint_path(c, env.rank, resume, "weights"));
      for (const ParamPtr& w : weights) {
        const auto found = saved.tensors.find(w->name);
        SWAPOPT_CHECK(found != saved.tensors.end() && found->second.nbytes() == w->data.nbytes(),
                      "swapopt-hsdp: " << checkpoint_path(c, env.rank, resume, "weights") << " has no " << w->name << " of its shape");
        std::memcpy(w->data.data_ptr(), found->second.data_ptr(), w->data.nbytes());
      }
      const std::string state = checkpoint_path(c, env.rank, resume, "optimizer");
      c.swap ? swapped->load_checkpoint(state) : muon.load_checkpoint(state);
      first_step = resume + 1;
      if (lead) std::printf("swapopt-hsdp: resumed from step %d (%s)\n", resume, c.checkpoint_dir.c_str());
    }
  }
  // After step `step`: the optimizer state, then the weights (their file marks the step complete).
  auto save_checkpoint = [&](int step) {
    // A weights file of this step left by an earlier attempt must not pair with a new optimizer
    // file should this rank die between the two writes.
    std::filesystem::remove(checkpoint_path(c, env.rank, step, "weights"));
    const std::string state = checkpoint_path(c, env.rank, step, "optimizer");
    c.swap ? swapped->save_checkpoint(state) : muon.save_checkpoint(state);
    StateDict shards;
    shards.metadata = "{\"step\": " + std::to_string(step) + "}";
    for (const ParamPtr& w : weights) shards.tensors.emplace(w->name, w->data);
    save_state_dict(shards, checkpoint_path(c, env.rank, step, "weights"));
    for (const char* what : {"weights", "optimizer"})  // the step before the previous one
      std::filesystem::remove(checkpoint_path(c, env.rank, step - 2 * c.checkpoint_every, what));
  };

  if (lead)
    std::printf(
        "swapopt-hsdp: mesh %lldx%lld (replicate x shard), %lld layer%s of %lld, batch %lld per rank, %d steps\n",
        (long long)c.replicas, (long long)c.shards, (long long)c.layers, c.layers == 1 ? "" : "s", (long long)c.hidden,
        (long long)c.batch, c.steps);
  const int run_steps = c.steps - first_step + 1;  // this run's, after a resume
  if (run_steps <= 0) {
    if (lead) std::printf("swapopt-hsdp: the checkpoint is at step %d already, no step left of %d\n", first_step - 1, c.steps);
    return 0;
  }
  float first_loss = 0.f, loss = 0.f;
  double total_ms = 0.0;
  std::vector<double> optimizer_ms;  // the optimizer step alone, per step
  for (int step = first_step; step <= c.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    // Every rank its own batches, a function of (rank, step) so that a resumed run sees the same.
    std::mt19937 data(1000 + 100003 * uint32_t(env.rank) + uint32_t(step));
    const Tensor x = random_matrix(data, {c.batch, c.input}, 1.f);
    Tensor target = Tensor::empty({c.batch, c.output}, DType::f32, Device::cpu());
    ops::gemm(stream, x, false, teacher, true, target);

    // Forward with the full weights, gathered from the row shards of this rank's shard group.
    std::vector<Tensor> full, acts = {x};
    for (const ParamPtr& w : weights) {
      full.push_back(Tensor::empty(w->logical_shape(), DType::f32, Device::cpu()));
      shard_group->all_gather(w->data, full.back())->wait();
    }
    for (size_t k = 0; k < weights.size(); ++k) {
      Tensor h = Tensor::empty({c.batch, full[k].size(0)}, DType::f32, Device::cpu());
      ops::gemm(stream, acts.back(), false, full[k], true, h);
      stream.synchronize();
      if (k + 1 < weights.size())
        for (int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = std::tanh(h.data<float>()[i]);
      acts.push_back(h);
    }
    // Mean squared error; dy = 2 (y - target) / numel.
    stream.synchronize();
    Tensor dy = acts.back().clone();
    ops::axpby(stream, -1.f, target, 1.f, dy);
    stream.synchronize();
    double sum = 0;
    for (int64_t i = 0; i < dy.numel(); ++i) sum += double(dy.data<float>()[i]) * dy.data<float>()[i];
    ops::scale(stream, dy, 2.f / float(dy.numel()));

    // Backward: full gradients on this batch, averaged over every rank, then this rank's rows.
    for (size_t k = weights.size(); k-- > 0;) {
      Tensor grad = Tensor::empty(full[k].shape(), DType::f32, Device::cpu());
      ops::gemm(stream, dy, true, acts[k], false, grad);
      if (k > 0) {
        Tensor dh = Tensor::empty(acts[k].shape(), DType::f32, Device::cpu());
        ops::gemm(stream, dy, false, full[k], false, dh);
        stream.synchronize();
        const float* a = acts[k].data<float>();
        float* d = dh.data<float>();
        for (int64_t i = 0; i < dh.numel(); ++i) d[i] *= 1.f - a[i] * a[i];
        dy = dh;
      }
      stream.synchronize();
      world->all_reduce(grad)->wait();
      const int64_t rows = weights[k]->data.size(0), first = weights[k]->layout->local_offset()[0];
      weights[k]->grad = Tensor::empty({rows, grad.size(1)}, DType::f32, Device::cpu());
      ops::copy(stream, grad.narrow(0, first, rows), weights[k]->grad);
      ops::scale(stream, weights[k]->grad, 1.f / float(env.world_size));
    }
    const auto t_opt = std::chrono::steady_clock::now();
    optimizer_step();
    stream.synchronize();
    optimizer_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_opt).count());

    Tensor mean_loss = Tensor::from_floats({float(sum / double(dy.numel()))}, {1});
    world->all_reduce(mean_loss)->wait();
    loss = mean_loss.data<float>()[0] / float(env.world_size);
    if (step == first_step) first_loss = loss;
    if (!c.checkpoint_dir.empty() && step % c.checkpoint_every == 0) save_checkpoint(step);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    total_ms += ms;
    if (lead && (step == 1 || step % 10 == 0 || step == c.steps)) {
      std::printf("step %4d  loss %.5f  step %.1f ms\n", step, loss, ms);
      std::fflush(stdout);  // progress reaches a log file or pipe as it happens
    }
  }

  if (c.fingerprint) {  // this rank's params and optimizer state, bit for bit (tests/hosts compares runs)
    uint64_t params = fnv1a(nullptr, 0), state = fnv1a(nullptr, 0);
    for (const ParamPtr& w : weights) params = fnv1a(w->data.data_ptr(), w->data.nbytes(), params);
    const StateDict sd = c.swap ? swapped->state_dict() : muon.state_dict();
    for (const auto& [name, t] : sd.tensors) state = fnv1a(t.data_ptr(), t.nbytes(), fnv1a(name.data(), name.size(), state));
    std::printf("fingerprint rank %d: params %016llx state %016llx loss %.9g\n", env.rank, (unsigned long long)params,
                (unsigned long long)state, double(loss));
  }

  // What HSDP and swap save: momentum bytes this rank holds, against one unsharded replica's.
  size_t held = 0, unsharded = 0;
  for (const auto& [param, state] : muon.state())
    for (const auto& [key, t] : state.tensors) held += t.nbytes();
  for (const ParamPtr& w : weights) unsharded += size_t(shape_numel(w->logical_shape())) * sizeof(float);
  Tensor held_total = Tensor::from_floats({float(held)}, {1});
  world->all_reduce(held_total)->wait();
  if (lead) {
    std::printf("\nsummary\n");
    std::printf("  loss: %.5f -> %.5f\n", first_loss, loss);
    std::printf("  steps/s: %.2f (%.1f ms/step)\n", 1000.0 * run_steps / total_ms, total_ms / run_steps);
    std::printf("  momentum of one unsharded Muon: %zu bytes; held by rank 0: %zu, by all %lld ranks: %.0f\n", unsharded, held,
                (long long)env.world_size, double(held_total.data<float>()[0]));
    std::sort(optimizer_ms.begin(), optimizer_ms.end());
    std::printf("  optimizer step on rank 0: median %.2f ms (%s)\n", optimizer_ms[optimizer_ms.size() / 2],
                c.swap ? "swapped" : "not swapped");
    if (c.swap) {
      swapped->synchronize();  // the report is the last completed step's
      std::printf("  device-resident momentum on rank 0 at the step's peak (swapped): %zu bytes\n",
                  swapped->last_report().peak_resident_bytes);
    }
  }
  // From step 1 the loss must have gone down; a resumed run (perhaps a step or two) only finishes.
  return std::isfinite(loss) && (first_step > 1 || loss < first_loss) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Config c = parse(argc, argv);
  try {
    if (std::getenv("RANK") == nullptr) return launch(c, argv);
    return run_rank(c);
  } catch (const std::exception& e) {
    const char* rank = std::getenv("RANK");
    std::fprintf(stderr, "swapopt-hsdp%s%s: %s\n", rank ? " rank " : "", rank ? rank : "", e.what());
    return 1;
  }
}
