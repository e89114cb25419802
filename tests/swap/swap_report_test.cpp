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
}
