// clip_grad_norm: torch's rule, exact in one process, each element counted once across HSDP ranks.
#include <cmath>
#include <iomanip>
#include <sstream>

#include "optim/thread_communicator.h"
#include "test_util.h"

using namespace swapopt;

namespace {

std::vector<ParamPtr> with_grads(uint32_t seed, float grad_scale) {
  std::vector<ParamPtr> out = {make_param("w", Tensor::zeros({8, 6}, DType::f32, Device::cpu())),
                               make_param("v", Tensor::zeros({5}, DType::f32, Device::cpu())),
                               make_param("none", Tensor::zeros({3}, DType::f32, Device::cpu()))};
  for (size_t i = 0; i < 2; ++i) {
    std::vector<float> g = test::random_values(size_t(out[i]->data.numel()), seed + uint32_t(i));
    for (float& x : g) x *= grad_scale;
    out[i]->grad = Tensor::from_floats(g, out[i]->data.shape());
  }
  return out;  // "none" has no grad
}

double reference_norm(const std::vector<ParamPtr>& params) {
  double sum = 0;
  for (const ParamPtr& p : params)
    if (p->has_grad())
      for (float x : p->grad.to_float_vector()) sum += double(x) * double(x);
  return std::sqrt(sum);
}

/** Runs `body(rank, world)` on `ranks` thread ranks of one world; returns each rank's error ("" when none). */
std::vector<std::string> on_thread_ranks(
    int ranks, const std::function<void(int rank, const std::shared_ptr<Communicator>&)>& body) {
  auto world = std::make_shared<test::ThreadWorld>();
  return test::run_on_thread_ranks(
      ranks, [&](int rank) { body(rank, std::make_shared<test::ThreadCommunicator>(world, "world", rank, ranks)); });
}

}  // namespace

TEST_CASE("clip_grad_norm: the global L2 norm, grads scaled by max_norm / (norm + 1e-6) when above, untouched below") {
  Stream s(Device::cpu());
  auto params = with_grads(1, 10.f);
  const double want = reference_norm(params);
  std::vector<std::vector<float>> before;
  for (size_t i = 0; i < 2; ++i) before.push_back(params[i]->grad.to_float_vector());
  const double norm = clip_grad_norm(params, 1.0, s);
  s.synchronize();
  CHECK(std::fabs(norm - want) <= 1e-6 * want);
  const float coef = float(1.0 / (norm + 1e-6));
  size_t mismatches = 0;
  for (size_t i = 0; i < 2; ++i) {
    const std::vector<float> after = params[i]->grad.to_float_vector();
    for (size_t k = 0; k < after.size(); ++k) mismatches += after[k] != coef * before[i][k];
  }
  CHECK(mismatches == 0);
  CHECK(std::fabs(reference_norm(params) - 1.0) < 1e-5);

  auto small = with_grads(2, 0.01f);
  const std::string unchanged = serialize_state_dict({{{"w", small[0]->grad}, {"v", small[1]->grad}}, "{}"});
  CHECK(clip_grad_norm(small, 100.0, s) < 100.0);
  s.synchronize();
  CHECK(serialize_state_dict({{{"w", small[0]->grad}, {"v", small[1]->grad}}, "{}"}) == unchanged);

  // The world group as a shared_ptr (as the README's HSDP setup holds it); none: this process only.
  auto again = with_grads(1, 10.f);
  CHECK(clip_grad_norm(again, 1.0, s, std::shared_ptr<Communicator>()) == norm);

  auto bad = with_grads(3, 1.f);
  bad[1]->grad.data<float>()[2] = std::nanf("");
  const std::string kept = serialize_state_dict({{{"w", bad[0]->grad}}, "{}"});
  CHECK(std::isnan(clip_grad_norm(bad, 1.0, s)));  // reported; nothing is scaled by a NaN
  s.synchronize();
  CHECK(serialize_state_dict({{{"w", bad[0]->grad}}, "{}"}) == kept);
  CHECK(test::error_of([&] { clip_grad_norm(params, 0.0, s); }) ==
        "[clip_grad_norm] max_norm must be finite and > 0, got 0");
  std::vector<ParamPtr> with_null = params;
  with_null.push_back(nullptr);
  CHECK(test::error_of([&] { clip_grad_norm(with_null, 1.0, s); }) == "[clip_grad_norm] null parameter");
}

TEST_CASE(
    "clip_grad_norm across HSDP ranks (2x2 mesh): every rank gets the single-process norm, each element counted once") {
  // Full grads: a row-sharded matrix, a replicated matrix, and a param without a layout.
  const std::vector<Shape> shapes = {{8, 6}, {4, 4}, {5}};
  std::vector<ParamPtr> full;
  for (size_t i = 0; i < shapes.size(); ++i) {
    full.push_back(make_param(std::to_string(i), Tensor::zeros(shapes[i], DType::f32, Device::cpu())));
    full.back()->grad = test::random_tensor(shapes[i], DType::f32, 10 + uint32_t(i));
  }
  const double want = reference_norm(full);
  std::vector<double> norms(4, -1.0);
  const std::vector<std::string> errors = on_thread_ranks(4, [&](int rank, const std::shared_ptr<Communicator>& comm) {
    auto mesh =
        std::make_shared<DeviceMesh>(std::vector<int64_t>{2, 2}, std::vector<std::string>{"replicate", "shard"}, rank);
    const int64_t shard = mesh->coordinate()[1];
    std::vector<ParamPtr> params;
    ParamPtr w = make_param("w", Tensor::zeros({4, 6}, DType::f32, Device::cpu()));
    w->grad = full[0]->grad.narrow(0, 4 * shard, 4).clone();
    w->layout = DTensor(w->data, {8, 6}, mesh, {Placement::Replicate(), Placement::Shard(0)});
    ParamPtr r = make_param("r", Tensor::zeros({4, 4}, DType::f32, Device::cpu()));
    r->grad = full[1]->grad.clone();
    r->layout = DTensor(r->data, {4, 4}, mesh, {Placement::Replicate(), Placement::Replicate()});
    ParamPtr l = make_param("l", Tensor::zeros({5}, DType::f32, Device::cpu()));
    l->grad = full[2]->grad.clone();
    Stream s(Device::cpu());
    norms[size_t(rank)] = clip_grad_norm({w, r, l}, 1e9, s, comm.get());
  });
  for (int rank = 0; rank < 4; ++rank) {
    CAPTURE(rank);
    CHECK(errors[size_t(rank)] == "");
    CHECK(std::fabs(norms[size_t(rank)] - want) <= 1e-6 * want);  // each shard's norm is an f32
    CHECK(norms[size_t(rank)] == norms[0]);
  }
}

TEST_CASE(
    "clip_grad_norm refuses a param listed twice, grads sharing memory, released grads and grads of another shape, "
    "changing nothing") {
  Stream stream(Device::cpu());
  std::vector<ParamPtr> params = with_grads(3, 10.f);
  const auto grads = [&] {
    std::vector<std::vector<float>> out;
    for (const ParamPtr& p : params) out.push_back(p->has_grad() ? p->grad.to_float_vector() : std::vector<float>());
    return out;
  };
  const auto before = grads();
  CHECK(test::error_of([&] {
          clip_grad_norm({params[0], params[1], params[0]}, 1.0, stream);
        }) == "[clip_grad_norm] parameter 'w' is listed twice (its grad would be counted and scaled twice)");
  params[2]->grad = params[0]->grad.view({48}).narrow(0, 40, 3);  // inside w's grad
  CHECK(test::error_of([&] { clip_grad_norm(params, 1.0, stream); }) ==
        "[clip_grad_norm] the grads of 'w' and 'none' share memory (they would be counted and scaled twice)");
  params[2]->grad = Tensor();
  CHECK(grads() == before);
  Tensor released = Tensor::zeros({5}, DType::f32, Device::cpu());
  released.storage()->release();
  params[1]->grad = released;
  CHECK(test::error_of([&] { clip_grad_norm(params, 1.0, stream); }) ==
        "[clip_grad_norm] grad of 'v' has released storage");
  params[1]->grad = Tensor::from_floats(before[1], {5});
  CHECK(grads() == before);
  params[1]->grad = Tensor::from_floats(before[1], {1, 5});  // the same elements, another shape
  CHECK(test::error_of([&] { clip_grad_norm(params, 1.0, stream); }) ==
        "[clip_grad_norm] grad of 'v' is Tensor(f32, [1, 5], cpu), the param Tensor(f32, [5], cpu)");
  params[1]->grad = Tensor::from_floats(before[1], {5});
  CHECK(grads() == before);
  const double want = reference_norm(params);
  CHECK(clip_grad_norm(params, 1.0, stream) == doctest::Approx(want).epsilon(1e-6));
}

TEST_CASE("clip_grad_norm across ranks adds each rank's f64 sum exactly: totals f32 cannot hold come out exact") {
  // Five row-sharded params of one element per rank. Rank 0's shards hold 1 and zeros; rank 1's
  // hold 2^26, 8192, 8192, 2, 2: a sum of 2^52 + 2^27 + 8, whose 53 bits need three f32 parts
  // (2^52, 2^27 and 8). The total 2^52 + 2^27 + 9 is exact in f64. Rank 1's sum sent as one or two
  // f32 parts, or the sums added in f32, would give a norm of 67108865 or 67108864.
  std::vector<double> norms(2, -1.0);
  const std::vector<std::string> errors = on_thread_ranks(2, [&](int rank, const std::shared_ptr<Communicator>& comm) {
    auto mesh =
        std::make_shared<DeviceMesh>(std::vector<int64_t>{1, 2}, std::vector<std::string>{"replicate", "shard"}, rank);
    std::vector<ParamPtr> params;
    const std::vector<float> values = rank == 0 ? std::vector<float>{1.f, 0.f, 0.f, 0.f, 0.f}
                                                : std::vector<float>{67108864.f, 8192.f, 8192.f, 2.f, 2.f};
    for (float value : values) {
      params.push_back(
          make_param("p" + std::to_string(params.size()), Tensor::zeros({1, 1}, DType::f32, Device::cpu())));
      params.back()->grad = Tensor::from_floats({value}, {1, 1});
      params.back()->layout = DTensor(params.back()->data, {2, 1}, mesh, {Placement::Replicate(), Placement::Shard(0)});
    }
    Stream s(Device::cpu());
    norms[size_t(rank)] = clip_grad_norm(params, 1e18, s, comm.get());
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  const double want = std::sqrt(4503599761588233.0);  // 67108865.00000006
  CHECK(norms == std::vector<double>{want, want});
}

TEST_CASE("clip_grad_norm across ranks: a sum of squares beyond f32's range clips as in one process") {
  // A grad of 1e20 (1e40 squared, past f32's 3.4e38) on a param without a layout (each rank
  // weighs it by 1 / 2): the norm is the single-process one, and the grad is clipped.
  const auto make = [] {
    ParamPtr w = make_param("w", Tensor::zeros({1}, DType::f32, Device::cpu()));
    w->grad = Tensor::from_floats({1e20f}, {1});
    return w;
  };
  Stream single(Device::cpu());
  const ParamPtr alone = make();
  const double want = clip_grad_norm({alone}, 1.0, single);
  single.synchronize();  // the clipping scale is enqueued on the stream; to_float_vector() is not ordered after it
  const std::vector<float> clipped = alone->grad.to_float_vector();
  std::vector<double> norms(2, -1.0);
  std::vector<std::vector<float>> grads(2);
  const std::vector<std::string> errors = on_thread_ranks(2, [&](int rank, const std::shared_ptr<Communicator>& comm) {
    const ParamPtr w = make();
    Stream s(Device::cpu());
    norms[size_t(rank)] = clip_grad_norm({w}, 1.0, s, comm.get());
    s.synchronize();
    grads[size_t(rank)] = w->grad.to_float_vector();
  });
  CHECK(errors == std::vector<std::string>{"", ""});
  CHECK(want == double(1e20f));
  CHECK(norms == std::vector<double>{want, want});
  CHECK(grads == std::vector<std::vector<float>>{clipped, clipped});
  CHECK(std::fabs(clipped[0] - 1.f) < 1e-6f);
}

TEST_CASE("clip_grad_norm across ranks: a max_norm that differs between ranks throws on every rank, scaling no grad") {
  // Each rank clipped by its own max_norm: every rank succeeded, the replicas' grads parted
  // (found by a hunting helper).
  for (const double rank_1_max_norm : {100.0, std::nextafter(1.0, 2.0)}) {
    CAPTURE(rank_1_max_norm);
    std::vector<std::string> got(2);
    const std::vector<std::string> errors =
        on_thread_ranks(2, [&](int rank, const std::shared_ptr<Communicator>& comm) {
          std::vector<ParamPtr> params = with_grads(1, 10.f);
          const std::vector<float> before = params[1]->grad.to_float_vector();
          Stream s(Device::cpu());
          got[size_t(rank)] =
              test::error_of([&] { clip_grad_norm(params, rank == 1 ? rank_1_max_norm : 1.0, s, comm.get()); });
          s.synchronize();
          CHECK(params[1]->grad.to_float_vector() == before);
          clip_grad_norm(params, 1.0, s, comm.get());  // the same max_norm: both go on
        });
    CHECK(errors == std::vector<std::string>{"", ""});
    std::ostringstream want;
    want << "[clip_grad_norm] ranks pass different max_norm (rank 0: 1, rank 1: " << std::setprecision(17)
         << rank_1_max_norm << "): every rank must clip alike, no grad was scaled";
    CHECK(got[0] == want.str());
    CHECK(got[1] == want.str());
  }
}

TEST_CASE("clip_grad_norm across ranks: bad input on one rank throws on every rank, scaling no grad") {
  // Rank 1's checks failed and it threw alone; rank 0 waited in the exchange until the timeout
  // (found by a hunting helper).
  struct Case {
    const char* what;
    std::function<double(std::vector<ParamPtr>&, Stream&, Communicator*)> call;
    std::string want;
  };
  const std::vector<Case> cases = {
      {"a grad not contiguous",
       [](std::vector<ParamPtr>& p, Stream& s, Communicator* c) {
         p[0]->grad = Tensor::zeros({6, 8}, DType::f32, Device::cpu()).transpose(0, 1);
         return clip_grad_norm(p, 1.0, s, c);
       },
       "[clip_grad_norm] grad of 'w' must be contiguous on cpu, got Tensor(f32, [8, 6], cpu)"},
      {"a grad of another shape than its param",
       [](std::vector<ParamPtr>& p, Stream& s, Communicator* c) {
         p[0]->grad = Tensor::zeros({6, 8}, DType::f32, Device::cpu());
         return clip_grad_norm(p, 1.0, s, c);
       },
       "[clip_grad_norm] grad of 'w' is Tensor(f32, [6, 8], cpu), the param Tensor(f32, [8, 6], cpu)"},
      {"a param listed twice",
       [](std::vector<ParamPtr>& p, Stream& s, Communicator* c) {
         p.push_back(p[0]);
         return clip_grad_norm(p, 1.0, s, c);
       },
       "[clip_grad_norm] parameter 'w' is listed twice (its grad would be counted and scaled twice)"},
      {"max_norm nan",
       [](std::vector<ParamPtr>& p, Stream& s, Communicator* c) { return clip_grad_norm(p, std::nan(""), s, c); },
       "[clip_grad_norm] max_norm must be finite and > 0, got nan"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    std::vector<std::string> got(2);
    const std::vector<std::string> errors =
        on_thread_ranks(2, [&](int rank, const std::shared_ptr<Communicator>& comm) {
          std::vector<ParamPtr> params = with_grads(1, 10.f);
          const std::vector<float> before = params[1]->grad.to_float_vector();
          Stream s(Device::cpu());
          got[size_t(rank)] = test::error_of([&] {
            if (rank == 1) {
              c.call(params, s, comm.get());
            } else {
              clip_grad_norm(params, 1.0, s, comm.get());
            }
          });
          s.synchronize();
          CHECK(params[1]->grad.to_float_vector() == before);  // scaled on no rank
          // Both ranks go on: a good call clips.
          clip_grad_norm(with_grads(1, 10.f), 1.0, s, comm.get());
        });
    CHECK(errors == std::vector<std::string>{"", ""});
    CHECK(got[0] == "[clip_grad_norm] failed its checks on 1 of 2 ranks (their errors say why): no grad was scaled");
    CHECK(got[1] == c.want);
  }
}
