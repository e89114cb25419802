// The swap report: read without a sync (the last completed step's), counting slots and bytes, and
// the device memory the swap saves.
#include <future>

#include "swap/swap_fixture.h"

using namespace swapopt;

TEST_SUITE("swap") {
  TEST_CASE("last_report() never waits: while a step runs it is the previous step's, after a sync the last one's") {
    auto params = test::swap_model(3);
    Muon muon(Stream(Device::cpu()));
    muon.add_param_group(params);
    SwapConfig config;
    config.min_numel = 1;
    config.swap_times = 4;  // more batches than are in flight at once
    auto swapped = swap_muon(muon, config);
    CHECK(swapped->last_report().batches == 0);  // nothing completed yet

    for (const ParamPtr& p : params) p->grad = test::random_tensor(p->data.shape(), DType::f32, 11);  // every param
    swapped->step();
    swapped->synchronize();
    const SwapStepReport first = swapped->last_report();
    CHECK(first.swapped_slots == params.size());
    CHECK(first.state_bytes == swapped->runtime().slot_bytes());
    CHECK(first.peak_resident_bytes < first.state_bytes);  // the saving: state never all on the device

    params[0]->grad = Tensor();  // one param without a grad: one slot fewer moves
    std::promise<void> open;
    std::shared_future<void> opened = open.get_future().share();
    muon.stream().enqueue([opened] { opened.wait(); });  // holds the step in its queue
    swapped->step();
    const SwapStepReport during = swapped->last_report();  // would deadlock if it waited
    CHECK(during.swapped_slots == first.swapped_slots);
    CHECK(during.h2d_bytes == first.h2d_bytes);
    open.set_value();
    swapped->synchronize();
    const SwapStepReport second = swapped->last_report();
    CHECK(second.swapped_slots == params.size() - 1);
    CHECK(second.h2d_bytes < first.h2d_bytes);
    CHECK(second.exposed_wait_ms >= 0.0);
  }

  TEST_CASE("a step skipped for a non-finite grad reports the loads of its early prefetch, and nothing else") {
    auto params = test::swap_model(3);
    AdamW adamw(Stream(Device::cpu()));
    adamw.add_param_group(params);
    SwapConfig config;
    config.min_numel = 1;
    config.swap_times = 4;
    auto swapped = swap_adamw(adamw, config);
    swapped->set_skip_nonfinite(true);
    auto set_grads = [&](float value) {
      for (const ParamPtr& p : params)
        p->grad = Tensor::from_floats(std::vector<float>(size_t(p->data.numel()), value), p->data.shape());
    };
    set_grads(0.5f);
    swapped->step();  // every slot exists from here on
    set_grads(NAN);
    swapped->step();
    swapped->synchronize();
    const SwapStepReport skipped = swapped->last_report();
    CHECK(swapped->last_step_skipped());
    CHECK(skipped.skipped_nonfinite);
    CHECK(skipped.h2d_bytes == 0);
    CHECK(skipped.d2h_bytes == 0);
    CHECK(skipped.batches == 0);

    swapped->prefetch_early();
    swapped->step();
    swapped->synchronize();
    const SwapStepReport prefetched = swapped->last_report();
    CHECK(prefetched.skipped_nonfinite);
    CHECK(prefetched.h2d_bytes > 0);  // the prefetch's loads happened
    CHECK(prefetched.h2d_copies > 0);
    CHECK(prefetched.h2d_bytes < swapped->runtime().slot_bytes());  // the first batches only
    CHECK(prefetched.d2h_bytes == 0);
    CHECK(prefetched.batches == 0);

    set_grads(0.25f);
    swapped->step();
    swapped->synchronize();
    CHECK_FALSE(swapped->last_step_skipped());
    CHECK(swapped->last_report().h2d_bytes == swapped->runtime().slot_bytes());  // a whole step, no prefetch left over
  }
}
