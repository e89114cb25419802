#include "swapopt/swap/swap_optimizer.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <sstream>

#include "../core/comma_list.h"
#include "../optim/checkpoint_stream.h"
#include "async_save.h"
#include "budget_miss.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/swap/adamw_swap_adapter.h"
#include "swapopt/swap/muon_swap_adapter.h"

namespace swapopt {

namespace {

/** The adapter, checked before the members built from it use it. */
StateSwapAdapter& checked(const std::unique_ptr<StateSwapAdapter>& adapter) {
  SWAPOPT_CHECK(adapter != nullptr, "[swap] SwapOptimizer needs a state adapter, got null");
  return *adapter;
}

std::vector<std::string> resolve_keys(StateSwapAdapter& adapter, const SwapConfig& config) {
  const Optimizer& optimizer = adapter.optimizer();
  config.validate();
  const std::vector<std::string> family = adapter.family_state_keys();
  if (!config.state_keys) return family;
  std::vector<std::string> foreign;
  for (const std::string& key : *config.state_keys)
    if (std::find(family.begin(), family.end(), key) == family.end()) foreign.push_back(key);
  if (!foreign.empty()) {
    SWAPOPT_FAIL("[swap] state keys [" << comma_list(foreign) << "] are not " << optimizer.name() << " state; "
                                       << optimizer.name() << " swaps only [" << comma_list(family) << "]");
  }
  return *config.state_keys;
}

}  // namespace

SwapOptimizer::SwapOptimizer(std::unique_ptr<StateSwapAdapter> adapter, SwapConfig config)
    : adapter_(std::move(adapter)),
      keys_(resolve_keys(checked(adapter_), config)),
      runtime_(adapter_->optimizer().stream(), config) {
  SWAPOPT_CHECK(!optimizer().wrapped(), "[swap] " << optimizer().name() << " is already wrapped by a SwapOptimizer");
  optimizer().check_layouts();  // the wrapper fixes them
  adapter_->validate(config);
  runtime_.build(adapter_->slot_layout(keys_), adapter_->optimizer());
  optimizer().set_wrapped(true);
  optimizer().votes_on_budget_ = config.device_budget_bytes.has_value();
}

SwapOptimizer::~SwapOptimizer() {
  if (save_) save_->wait_all();  // it reads the mirrors (a failure it met is dropped with it)
  try {
    runtime_.return_state();
  } catch (const std::exception& e) {  // destructors never throw; the state stays unreachable
    std::fprintf(stderr, "swapopt: returning the swapped state to the optimizer failed: %s\n", e.what());
  }
  optimizer().set_wrapped(false);
  optimizer().votes_on_budget_ = false;
}

void SwapOptimizer::step() {
  PlannedStep plan = plan_step();
  run_step(plan);
}

// Everything that can reject the step runs before anything changes: the optimizer's checks, the
// plan and the budget. State a unit creates is made when run() starts.
SwapOptimizer::PlannedStep SwapOptimizer::plan_step() {
  Optimizer* optimizer = &this->optimizer();
  Optimizer::check_together({&optimizer, 1}, [&] {
    check_save();
    optimizer->apply_schedule();
    optimizer->check_step_locally();
  });
  return plan_checked_step();
}

SwapOptimizer::PlannedStep SwapOptimizer::plan_checked_step() {
  PlannedStep plan;
  stamp(plan);
  plan.skip = optimizer().skip_this_step();
  if (plan.skip) return plan;
  if (!runtime_.config().device_budget_bytes) {
    plan_units(plan);  // without a budget no plan fails
    return plan;
  }
  // A budget plan depends on the rank's own state and workspace (under HSDP the owner of a matrix
  // holds its NS workspace): the ranks agree whether every plan fits before any of them starts the
  // step's collectives, so that a plan failing on one rank fails the step on all, changing nothing.
  Optimizer* optimizer = &this->optimizer();
  Optimizer::vote_together(
      {&optimizer, 1}, [&] { return plan_units(plan), false; }, budget_elsewhere());
  return plan;
}

void SwapOptimizer::plan_units(PlannedStep& plan) {
  plan.units = adapter_->plan_units(false);
  runtime_.attach_slots(plan.units, optimizer());
  try {
    plan.batch_sizes = runtime_.plan_batches(plan.units, adapter_->partition_costs(plan.units));
  } catch (const BudgetMiss& miss) {
    // Under HSDP each rank plans the units it runs (an owner holds a matrix's NS workspace): the
    // least budget found is this rank's, and another rank's may be larger.
    if (optimizer().spans_ranks()) throw miss.naming(miss.least(), true);
    throw;
  }
}

std::string SwapOptimizer::budget_elsewhere() const {
  std::ostringstream message;
  message << "[swap] device_budget_bytes " << runtime_.config().device_budget_bytes.value_or(0)
          << " does not hold the step's plan on another rank (that rank's error names the unit): the step changed "
             "nothing";
  return message.str();
}

void SwapOptimizer::stamp(PlannedStep& plan) {
  // Ids are unique in the process, so that no wrapper takes another's plan for its own.
  static std::atomic<uint64_t> plans_made{0};
  plan.id = ++plans_made;
  latest_plan_ = plan.id;
}

void SwapOptimizer::run_step(PlannedStep& plan) {
  SWAPOPT_CHECK(plan.id != 0 && plan.id == latest_plan_ && plan.id != plan_run_,
                "[swap] run_step() takes the plan the last plan_step() made, once: plan the step again");
  plan_run_ = plan.id;
  optimizer().last_step_skipped_ = plan.skip;
  if (plan.skip) {
    runtime_.record_skipped_step();
    optimizer().record_step_events();
    return;
  }
  // The adapter's calls of the optimizer's update pieces are the wrapper's own while it runs.
  struct InStep {
    Optimizer& optimizer;
    explicit InStep(Optimizer& o) : optimizer(o) { optimizer.in_swapped_step_ = true; }
    ~InStep() { optimizer.in_swapped_step_ = false; }
  } in_step(optimizer());
  adapter_->begin_step();
  try {
    runtime_.run(plan.units, plan.batch_sizes, *adapter_);
  } catch (...) {
    adapter_->abandon_step();  // (the runtime's unwind has called it already where it synchronises)
    throw;
  }
  adapter_->finish_step();
  optimizer().record_step_events();
}

void SwapOptimizer::synchronize() {
  runtime_.synchronize_copies();
  optimizer().synchronize();
}

void SwapOptimizer::prefetch_early() {
  std::vector<UpdateUnit> units;
  std::vector<size_t> batch_sizes;
  try {
    units = adapter_->plan_units(true);
    runtime_.attach_slots(units, optimizer(), false);
    batch_sizes = runtime_.plan_batches(units, adapter_->partition_costs(units));
  } catch (const Error&) {
    // A plan that cannot be made (a budget it does not fit, a param whose data no longer has its
    // shape): step() names the error after its checks, and under HSDP after the ranks agree (a
    // rank throwing here alone would leave the others waiting in that vote).
    return;
  }
  runtime_.prefetch_early(units, batch_sizes);
}

StateDict SwapOptimizer::state_dict() {
  Optimizer& opt = optimizer();
  synchronize();
  StateDict out;
  out.metadata = opt.metadata_json();
  // The mirrors are host memory and no copy is in flight after synchronize(): read them directly;
  // state kept on the device goes through the stream, with one wait at the end.
  for (const auto& [param, ps] : opt.state())
    for (const auto& [key, tensor] : ps.tensors) {
      const SwapSlot* slot = runtime_.find_slot(param, key);
      Tensor host = Tensor::empty(tensor.shape(), tensor.dtype(), Device::cpu());
      if (slot != nullptr) {
        if (host.nbytes() > 0) std::memcpy(host.data_ptr(), slot->host.data_ptr(), host.nbytes());
      } else {
        ops::copy(opt.stream(), tensor, host);
      }
      out.tensors.emplace(opt.state_name(param, key), std::move(host));
    }
  opt.stream().synchronize();
  return out;
}

void SwapOptimizer::load_state_dict(const StateDict& state) { prepare_load(reader_of(state))(); }

void SwapOptimizer::load_checkpoint(const std::string& path, const CheckpointReadOptions& options) {
  runtime_.wait_mirror_reader();  // a background save may be writing this very file
  const CheckpointFile file(path, options);
  prepare_load(file.reader())();
}

CheckpointSource SwapOptimizer::checkpoint_source(bool copy_device_state,
                                                   std::unordered_map<const SwapSlot*, std::string>* mirrors) {
  Optimizer& opt = optimizer();
  synchronize();
  CheckpointSource out;
  out.metadata = opt.metadata_json();
  // No copy is in flight after synchronize(): the mirrors are read in place.
  for (const auto& [param, ps] : opt.state())
    for (const auto& [key, tensor] : ps.tensors) {
      const std::string name = opt.state_name(param, key);
      const SwapSlot* slot = runtime_.find_slot(param, key);
      if (slot != nullptr) {
        out.tensors.emplace(name, host_source(slot->host));
        if (mirrors != nullptr) mirrors->emplace(slot, name);
      } else if (copy_device_state) {
        Tensor host = Tensor::empty(tensor.shape(), tensor.dtype(), Device::cpu());
        ops::copy(opt.stream(), tensor, host);
        out.tensors.emplace(name, host_source(host));
      } else {
        out.tensors.emplace(name, device_source(opt.stream(), tensor));
      }
    }
  if (copy_device_state) opt.stream().synchronize();
  return out;
}

void SwapOptimizer::save_async(const std::string& path) {
  wait_save();
  std::unordered_map<const SwapSlot*, std::string> mirrors;
  CheckpointSource source = checkpoint_source(true, &mirrors);
  save_ = std::make_shared<AsyncSave>(std::move(source), std::move(mirrors), path);
  runtime_.set_mirror_reader(save_);
}

void SwapOptimizer::wait_save() {
  if (!save_) return;
  const std::shared_ptr<AsyncSave> save = std::move(save_);
  runtime_.clear_mirror_reader(save.get());
  save->wait();
}

void SwapOptimizer::check_save() {
  if (save_ && save_->finished()) wait_save();
}

void SwapOptimizer::save_checkpoint(const std::string& path) {
  runtime_.wait_mirror_reader();  // one writer of a file at a time (its failure stays for wait_save)
  write_checkpoint(checkpoint_source(), path);
}

std::function<void()> SwapOptimizer::prepare_load(const CheckpointReader& checkpoint) {
  // The write runs later, inside the returned change: it captures nothing of this frame.
  std::function<void()> apply = optimizer().prepare_load(checkpoint, [this](const Param& param, const std::string& key,
                                                                            const TensorReader& tensor) {
    Optimizer& opt = optimizer();
    SwapSlot* slot = runtime_.find_slot(&param, key);
    if (slot != nullptr) {  // into the mirror; the next step brings it over
      if (slot->nbytes() > 0) tensor.read(slot->host.data_ptr(), 0, slot->nbytes());
      slot->created = true;
      opt.state()[&param].tensors[key] = slot->device;
    } else {
      Tensor device_copy = Tensor::empty(tensor.shape, tensor.dtype, opt.device(), &opt.stream());  // as a step's state
      fill_from(opt.stream(), device_copy, tensor);
      opt.state()[&param].tensors[key] = device_copy;
    }
  });
  return [this, apply = std::move(apply)] {
    runtime_.wait_mirror_reader();      // a background save may still read the mirrors
    runtime_.discard_early_prefetch();  // its device copies would hold the state being replaced
    synchronize();
    for (const auto& slot : runtime_.slots()) slot->created = false;  // state not in the checkpoint is gone
    latest_plan_ = 0;  // a plan made before knew the old state (which slots it would create): plan again
    apply();
    optimizer().stream().synchronize();
  };
}

std::unique_ptr<SwapOptimizer> swap_muon(Muon& muon, SwapConfig config) {
  return std::make_unique<SwapOptimizer>(std::make_unique<MuonSwapAdapter>(muon), std::move(config));
}

std::unique_ptr<SwapOptimizer> swap_adamw(AdamW& adamw, SwapConfig config) {
  return std::make_unique<SwapOptimizer>(std::make_unique<AdamWSwapAdapter>(adamw), std::move(config));
}

}  // namespace swapopt
