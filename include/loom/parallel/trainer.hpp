#pragma once
//! \file Trainer: composes a Model, an Optimizer, a Schedule and a Strategy into a training step
//! on a global batch (DESIGN.md invariant 2: the loss is the mean over all target tokens of the
//! global batch, whatever the split into micro-batches).

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <span>
#include <utility>
#include <vector>

#include "loom/comm/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/models/concepts.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/optim/lr_schedule.hpp"
#include "loom/parallel/concepts.hpp"
#include "loom/parallel/detail/buffer_pool.hpp"
#include "loom/parallel/detail/in_order_check.hpp"
#include "loom/parallel/mesh.hpp"
#include "loom/parallel/pipeline_stage.hpp"
#include "loom/parallel/stage_partition.hpp"
#include "loom/parallel/single_rank.hpp"
#include "loom/schedule/concepts.hpp"
#include "loom/schedule/gradient_accumulation.hpp"

namespace loom {

//! Run-time settings of a Trainer (structure is in its template arguments).
struct TrainerOptions {
  std::int64_t micro_batch_size = 1;  //!< sequences per micro-batch on each rank
  double clip_grad_norm = 0.0;        //!< clip the global gradient norm to this; 0 = off
  //! Keys every parameter's initial values, and (with the step and the position in the global
  //! batch) every dropout mask.
  std::uint64_t seed = 1337;
  //! Activation recomputation (full activation checkpointing; Megatron-LM's `--recompute-method
  //! block`): in every chunk of layers a rank runs, the first `recompute_layers` of the layers
  //! that keep activations (the model's last layer, which computes the loss, excepted) keep
  //! nothing but their input from forward to backward, and run their forward again just before
  //! their backward, into one buffer the rank shares across them. 0: none; all_layers: every
  //! one. The recomputed forward draws the same dropout masks and, on a deterministic backend,
  //! computes the same bits, so the run trains the same model (docs/recompute.md).
  int recompute_layers = 0;
  //! recompute_layers for every layer it applies to.
  static constexpr int all_layers = std::numeric_limits<int>::max();
  //! For bf16 models: add the micro-batches' gradients up, reduce them over the data-parallel
  //! group, clip them and step the optimizer from them in fp32 (Megatron-LM's
  //! accumulate_allreduce_grads_in_fp32, its default for bf16), instead of in bf16 (llm.c's
  //! way, the default here). Costs 4 bytes of gradient per parameter more (docs/mixed_precision.md
  //! has each strategy's figure), and twice the bytes in each gradient reduction. Float models
  //! already do all of it in fp32; every strategy and schedule takes it.
  bool fp32_gradients = false;

  friend bool operator==(const TrainerOptions&, const TrainerOptions&) = default;
  friend std::ostream& operator<<(std::ostream& out, const TrainerOptions& o) {
    out << "{micro_batch_size=" << o.micro_batch_size << ", clip_grad_norm=" << o.clip_grad_norm
        << ", seed=" << o.seed << ", recompute_layers=";
    if (o.recompute_layers == all_layers) out << "all";
    else out << o.recompute_layers;
    return out << ", fp32_gradients=" << o.fp32_gradients << "}";
  }
};

//! What one step did.
struct StepMetrics {
  std::int64_t step = 0;       //!< steps done, this one included
  double loss = 0;             //!< mean loss over the global batch's target tokens
  double lr = 0;               //!< learning rate applied
  double grad_norm = 0;        //!< global L2 norm of the gradient before clipping
  std::int64_t tokens = 0;     //!< target tokens in the global batch
  std::int64_t micro_batches = 0;
  double seconds = 0;          //!< wall time of the step
  double tokens_per_second = 0;
  double flops = 0;            //!< training FLOPs of the step (DESIGN.md formula)
  //! Of `seconds`, the time this rank waited for other pipeline stages: blocked receiving
  //! activations or gradients, waiting for its sends to drain, exchanging tied gradients with
  //! the other stages that hold them, and waiting at the end of the step for the last stage to
  //! finish (0 without pipeline stages). Divided by `seconds`, it is the rank's measured
  //! pipeline bubble.
  double pipeline_wait_seconds = 0;
};

//! Trains `M` with optimizer `O`, micro-batch order `S` and state strategy `St`.
//! A step takes the global batch (every rank sees the same one) and returns its metrics.
//!
//! On a mesh with pipeline stages (pp > 1) each rank runs its stage's layers
//! (PipelineStage: layers balanced by Model::layer_cost, `chunks_per_rank(schedule)` chunks per
//! rank) and executes the schedule's actions for its stage, moving activations forward and
//! their gradients backward with send/recv on `mesh.pipeline()`.
namespace detail {
//! A TensorwiseOptimizer's per-tensor state type on backend B for parameters of T; an empty
//! type for element-wise optimizers, whose state is in the strategy's flat buffers.
template <class O, class B, class T>
struct TensorStateOf {
  struct type {};
};
template <TensorwiseOptimizer O, class B, class T>
struct TensorStateOf<O, B, T> {
  using type = typename O::template State<B, T>;
};
}  // namespace detail

template <Model M, Optimizer O, Schedule S = GradientAccumulation, Strategy St = SingleRank>
class Trainer {
 public:
  using backend_type = typename M::backend_type;
  using scalar_type = typename M::scalar_type;
  using optimizer_type = O;
  //! The layers (and parameters) this rank runs: all of them without pipeline stages.
  using Stage = PipelineStage<M>;
  using Engine = typename St::template Engine<backend_type, scalar_type>;
  static_assert(StrategyEngine<Engine, scalar_type>,
                "loom: the strategy's Engine does not offer the hooks the Trainer drives");
  static_assert(!pipelined_schedule<S> || supports_pipeline<St>,
                "loom: this strategy cannot run under a pipeline schedule. Zero<2> and Zero<3> reduce-scatter "
                "gradients (and Zero<3> gathers parameters) in every micro-batch's backward, which a pipeline "
                "repeats for each of its micro-batches, and a tied parameter's gradient must be summed across "
                "stages before it is sharded. Use DataParallel or Zero<1> with pipeline schedules (DeepSpeed "
                "has the same rule), or GradientAccumulation without pipeline stages.");
  static_assert(!splits_backward_schedule<S> || SplitBackwardModel<M>,
                "loom: this schedule splits each backward into input- and weight-gradient passes (zero "
                "bubble); the Model must provide stash_elements, backward_input and backward_weight "
                "(SplitBackwardModel, as gpt2::Model does).");

  //! One rank, no communicator. `lr` is any LrSchedule (ConstantLr, WarmupCosineLr, or a type
  //! of yours with `at(step)`); `strategy` carries the strategy's settings.
  template <LrSchedule L>
  Trainer(backend_type& backend, M model, O optimizer, L lr, TrainerOptions options = {},
          St strategy = {}, S schedule = {})
      : Trainer(backend, CommunicatorRef{}, CommunicatorRef{}, CommunicatorRef{}, std::move(model),
                std::move(optimizer), std::move(lr), options, std::move(strategy), std::move(schedule)) {}

  //! Data-parallel training over `group` (which must outlive the Trainer): every rank passes the
  //! same global batch to step() and trains on its contiguous slice of it (DESIGN.md
  //! invariant 2); the strategy reduces the gradients over the group.
  template <Communicator C, LrSchedule L>
  Trainer(backend_type& backend, C& group, M model, O optimizer, L lr, TrainerOptions options = {},
          St strategy = {}, S schedule = {})
      : Trainer(backend, CommunicatorRef(group), CommunicatorRef{}, CommunicatorRef{}, std::move(model),
                std::move(optimizer), std::move(lr), options, std::move(strategy), std::move(schedule)) {}

  //! Training on a DP × TP × PP mesh (which must outlive the Trainer): `model` is this rank's
  //! tensor-parallel shard of the whole model, built over `mesh.tensor_parallel()`; this rank
  //! runs its pipeline stage's layers of it, and the strategy works over `mesh.data_parallel()`.
  //! Every rank passes the same global batch; the ranks of a TP group and of a pipeline train on
  //! the same slice. Checked before any step: the model's tensor-parallel size, and enough
  //! layers for pp × chunks_per_rank(schedule) stages.
  template <Communicator C, LrSchedule L>
  Trainer(backend_type& backend, Mesh<C>& mesh, M model, O optimizer, L lr, TrainerOptions options = {},
          St strategy = {}, S schedule = {})
      : Trainer(backend, CommunicatorRef(mesh.data_parallel()), CommunicatorRef(mesh.tensor_parallel()),
                CommunicatorRef(mesh.pipeline()), (check_mesh(mesh, model), std::move(model)),
                std::move(optimizer), std::move(lr), options, std::move(strategy), std::move(schedule)) {}

  //! One optimizer step on `global`, anything with `tokens_view()` and `targets_view()`
  //! returning [batch, seq] int32 tensors (io::Batch), and `lengths_view()` returning its
  //! sequences' lengths where it has one (empty: no padding).
  template <class Batch>
  StepMetrics step(const Batch& global) {
    return step(global.tokens_view(), global.targets_view(), lengths_of(global));
  }

  //! One optimizer step on the global batch given as [batch, seq] tokens and targets, and
  //! optionally [batch] `lengths`: sequence i is its first lengths[i] tokens, in [1, seq], then
  //! padding that no query attends to (AttentionKeys) and whose targets must be ignored (< 0).
  //! Empty: every sequence is seq tokens.
  StepMetrics step(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets,
                   Tensor<const std::int32_t> lengths = {}) {
    const auto start = std::chrono::steady_clock::now();
    forget_unfinished_step();
    const std::int64_t micro_batches = plan(tokens, targets, lengths);
    const std::int64_t target_tokens = count_targets(targets);
    LOOM_CHECK(target_tokens > 0, "trainer step: target tokens", target_tokens,
               "a global batch needs at least one target >= 0");
    const Inputs batch = place_batch({tokens, targets, lengths});
    // In the accumulate type: 1 / tokens is no bf16 value.
    const auto loss_scale = static_cast<accumulate_t<scalar_type>>(1.0 / static_cast<double>(target_tokens));

    engine_.begin_step();
    deferred_notification_ = false;
    wait_seconds_ = 0;
    double loss_sum = 0;
    for (std::size_t i = 0; i < actions_.size(); ++i) {
      const Action& a = actions_[i];
      const Inputs mb = micro(batch, a.micro_batch);
      issue(plan_[i]);
      switch (a.kind) {
        case Action::Kind::forward:
          loss_sum += forward(a.micro_batch, a.chunk, mb, dropout_key(a.micro_batch), loss_scale);
          break;
        case Action::Kind::backward:
        case Action::Kind::backward_input:
          backward(a, mb, loss_scale, completes_chunk_[i]);
          break;
        case Action::Kind::backward_weight:
          backward_weight(a, mb, loss_scale, completes_chunk_[i]);
          break;
      }
    }
    issue(plan_.back());
    finish_pipeline();
    engine_.finish_gradients();

    StepMetrics m;
    const double replica_loss = engine_.global_sum(loss_sum);
    // The first exchange with the other stages after the actions: a stage that finished early
    // waits here for the pipeline to drain, which is bubble too.
    const auto drain = std::chrono::steady_clock::now();
    m.loss = pipeline_sum(replica_loss) / static_cast<double>(target_tokens);
    if (pipeline_.size() > 1)
      wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - drain).count();
    m.grad_norm = std::sqrt(gradient_sum_of_squares());
    double grad_scale = 1.0;
    if (options_.clip_grad_norm > 0 && m.grad_norm > options_.clip_grad_norm)
      grad_scale = options_.clip_grad_norm / (m.grad_norm + 1e-6);
    m.lr = lr_(step_);
    engine_.update(grad_scale, [&](std::span<const detail::FlatRange<T>> ranges) { apply_optimizer(ranges, m.lr); });
    backend_->synchronize();
    ++step_;

    m.step = step_;
    m.tokens = tokens.numel();
    m.micro_batches = micro_batches;
    m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    m.tokens_per_second = static_cast<double>(m.tokens) / m.seconds;
    m.pipeline_wait_seconds = wait_seconds_;
    m.flops = stage_.flops_per_token(tokens.extent(1)) * static_cast<double>(m.tokens);
    return m;
  }

  //! Mean loss on a batch without changing anything (forward only; collective like step()).
  //! Throws where no target is >= 0. validation_loss (parallel/validation.hpp) takes many.
  template <class Batch>
  double evaluate(const Batch& global) {
    const Inputs given{global.tokens_view(), global.targets_view(), lengths_of(global)};
    forget_unfinished_step();
    plan(given.tokens, given.targets, given.lengths);
    const std::int64_t target_tokens = count_targets(given.targets);
    LOOM_CHECK(target_tokens > 0, "trainer evaluate: target tokens", target_tokens,
               "a batch needs at least one target >= 0 to have a mean loss");
    const Inputs batch = place_batch(given);
    double loss_sum = 0;
    // Micro-batch by micro-batch through the chunks in order: every receive has its send ahead.
    for (std::size_t i = 0; i < evaluate_actions_.size(); ++i) {
      const Action& a = evaluate_actions_[i];
      issue(evaluate_plan_[i]);
      // No dropout: evaluation measures the model itself.
      loss_sum += forward(a.micro_batch, a.chunk, micro(batch, a.micro_batch), {}, 0);
      release(find(a.micro_batch, a.chunk));
    }
    issue(evaluate_plan_.back());
    wait_for_sends();
    return pipeline_sum(engine_.global_sum(loss_sum)) / static_cast<double>(target_tokens);
  }

  //! The whole model (this rank's tensor-parallel shard of it).
  const M& model() const noexcept { return stage_.model(); }
  //! The layers and parameters this rank runs (all of them without pipeline stages).
  const Stage& stage() const noexcept { return stage_; }
  //! Steps done.
  std::int64_t steps() const noexcept { return step_; }
  //! Every parameter of model().layout(), in its order, copied to host memory. Collective over
  //! the pipeline (each stage contributes its layers) and, when the strategy shards parameters
  //! (ZeRO-3), over the data-parallel group.
  std::vector<scalar_type> gather_parameters() {
    std::vector<scalar_type> mine(static_cast<std::size_t>(stage_.layout().total()));
    engine_.copy_parameters_to(mine.data());
    std::vector<scalar_type> out(static_cast<std::size_t>(model().layout().total()), scalar_type(0));
    stage_.scatter_owned(mine.data(), out.data());
    // Every element is owned by one stage and zero elsewhere, so the sum is exact.
    if (pipeline_.size() > 1) pipeline_.all_reduce(std::span<scalar_type>(out), ReduceOp::sum);
    return out;
  }
  //! Replaces every parameter with `values` (model().layout() order, host memory), e.g. from a
  //! checkpoint; every rank passes the same values and keeps its stage's part.
  void load_parameters(std::span<const scalar_type> values) { load_values(values); }
  //! A bf16 model also takes fp32 values: its fp32 master weights get them exactly, its
  //! parameters rounded.
  void load_parameters(std::span<const accumulate_t<scalar_type>> values)
    requires is_narrow_storage<scalar_type>
  {
    load_values(values);
  }
  //! The element type of the training state: the parameters at the optimizer's precision (the
  //! fp32 master weights of a bf16 model) and the optimizer's state.
  using state_type = accumulate_t<scalar_type>;
  //! Arrays of the training state: the parameters (array 0), then the optimizer's state slots.
  static constexpr int state_arrays = 1 + O::state_slots;
  //! model().layout() unsharded: every parameter at its global shape, in the same order, as a
  //! 1-rank run lays it out. Checkpoints are written in it, so any mesh can read them.
  const ParameterLayout& whole_layout() const noexcept { return whole_layout_; }
  //! Where the training-state elements this rank owns go in whole_layout(): copy_owned_state()
  //! returns them in run order, `local` counting from its first. The ranks of the mesh own
  //! disjoint elements that together cover the whole layout once (its ZeRO shard, its
  //! tensor-parallel slice, its stage; replicated parameters on data-parallel, tensor-parallel
  //! rank 0; tied copies on the owning stage only). How checkpoints are written in parallel.
  std::vector<WholeRun> owned_state_runs() const {
    return state_runs(engine_.owned_state_ranges(), tensor_parallel_.rank() == 0, false);
  }
  //! Training-state array `array` (0: parameters at the optimizer's precision, k: optimizer
  //! state slot k - 1): this rank's owned elements (owned_state_runs), in host memory. Not
  //! collective.
  std::vector<state_type> copy_owned_state(int array) {
    detail::check_state_array(array, O::state_slots);
    std::vector<state_type> values(static_cast<std::size_t>(elements_of(engine_.owned_state_ranges())));
    engine_.copy_owned_state_to(array, values.data());
    return values;
  }
  //! Where the elements load_needed_state(array, ...) takes are in whole_layout(): everything
  //! this rank holds of the array (its slice and stage, and its ZeRO shard where the array is
  //! sharded), tied copies included. Ranks may need the same elements.
  std::vector<WholeRun> needed_state_runs(int array) const {
    detail::check_state_array(array, O::state_slots);
    return state_runs(engine_.needed_state_ranges(array), true, true);
  }
  //! Replaces this rank's part of training-state array `array` with `values`: the elements
  //! needed_state_runs(array) lists, in its order. Not collective.
  void load_needed_state(int array, std::span<const state_type> values) {
    detail::check_state_array(array, O::state_slots);
    const std::int64_t expected = elements_of(engine_.needed_state_ranges(array));
    LOOM_CHECK(static_cast<std::int64_t>(values.size()) == expected, "load_needed_state: elements", values.size(),
               "must equal this rank's needed_state_runs' " + detail::to_text(expected));
    forget_unfinished_step();
    engine_.load_state(array, values.data());
    backend_->synchronize();
  }
  //! Training-state array `array` of the whole model, in whole_layout() order, in host memory
  //! on every rank. Collective over the data-parallel, tensor-parallel and pipeline groups: each
  //! element comes from the one rank that owns it (owned_state_runs) and the others add zeros,
  //! so the sums are exact.
  std::vector<state_type> gather_state(int array) {
    const std::vector<state_type> mine = copy_owned_state(array);
    std::vector<state_type> whole(static_cast<std::size_t>(whole_layout_.total()), state_type(0));
    for (const WholeRun& r : owned_state_runs()) std::copy_n(mine.data() + r.local, r.count, whole.data() + r.whole);
    for (CommunicatorRef* g : {&group_, &tensor_parallel_, &pipeline_})
      if (g->size() > 1) g->all_reduce(std::span<state_type>(whole), ReduceOp::sum);
    return whole;
  }
  //! Replaces training-state array `array` with `values` (whole_layout() order, host memory):
  //! every rank passes the same values and keeps its part. Array 0 alone is how a run starts from
  //! pretrained weights; all of them and set_steps() resume a run.
  void load_state(int array, std::span<const state_type> values) {
    detail::check_state_array(array, O::state_slots);
    LOOM_CHECK(static_cast<std::int64_t>(values.size()) == whole_layout_.total(), "load_state: elements",
               values.size(), "must equal the whole layout's " + detail::to_text(whole_layout_.total()));
    const std::vector<WholeRun> runs = needed_state_runs(array);
    std::vector<state_type> mine(static_cast<std::size_t>(elements_of(engine_.needed_state_ranges(array))));
    for (const WholeRun& r : runs) std::copy_n(values.data() + r.whole, r.count, mine.data() + r.local);
    load_needed_state(array, mine);
  }
  //! Numbers of the optimizer's per-tensor state (a TensorwiseOptimizer's: Adafactor's row and
  //! column moments) for the whole model, parameter after parameter of whole_layout(); 0 for
  //! element-wise optimizers, whose state is in the arrays. Checkpoints keep it as one array of
  //! doubles after the others.
  std::int64_t whole_tensor_state_size() const { return whole_tensor_state_offsets().back(); }
  //! Where the per-tensor state this rank writes goes in that array (`local` counting in
  //! copy_tensor_state()): its stage's parameters on the rank at data-parallel and
  //! tensor-parallel position 0 (every rank that holds part of a tensor keeps the same state of
  //! the whole tensor), tied copies on their owning stage only; nothing elsewhere.
  std::vector<WholeRun> owned_tensor_state_runs() const { return tensor_state_runs(true); }
  //! Where the per-tensor state load_tensor_state() takes comes from: every parameter of the
  //! stage, tied copies included.
  std::vector<WholeRun> needed_tensor_state_runs() const { return tensor_state_runs(false); }
  //! Bytes of the optimizer's per-tensor state this rank holds (0 for element-wise optimizers);
  //! counted under MemoryCategory::optimizer_state.
  std::int64_t tensor_state_bytes() const noexcept {
    if constexpr (TensorwiseOptimizer<O>)
      return tensor_state_.bytes();
    else
      return 0;
  }
  //! This rank's per-tensor state, in host memory (empty for element-wise optimizers).
  std::vector<double> copy_tensor_state() const {
    if constexpr (TensorwiseOptimizer<O>)
      return tensor_state_.moments();
    else
      return {};
  }
  //! Replaces this rank's per-tensor state with `values`, laid out as copy_tensor_state()'s.
  //! Not collective.
  void load_tensor_state(std::span<const double> values) {
    if constexpr (TensorwiseOptimizer<O>) {
      forget_unfinished_step();
      tensor_state_.load_moments(values);
    } else {
      LOOM_CHECK(values.empty(), "load_tensor_state: values", values.size(),
                 "the optimizer keeps no per-tensor state, so there must be none");
    }
  }
  //! True on every rank when `flag` is true on any rank of the mesh (collective over the
  //! data-parallel, tensor-parallel and pipeline groups): how ranks agree that one of them failed,
  //! so that all stop together instead of waiting for it.
  bool any_of_ranks(bool flag) {
    double any = flag ? 1.0 : 0.0;
    for (CommunicatorRef* g : {&group_, &tensor_parallel_, &pipeline_})
      if (g->size() > 1) g->all_reduce(std::span<double>(&any, 1), ReduceOp::max);
    return any > 0;
  }
  //! Sums `values` in place over every rank of the mesh (collective over the data-parallel,
  //! tensor-parallel and pipeline groups).
  void sum_over_ranks(std::span<double> values) {
    for (CommunicatorRef* g : {&group_, &tensor_parallel_, &pipeline_})
      if (g->size() > 1) g->all_reduce(values, ReduceOp::sum);
  }
  //! Sets the steps done, which the learning-rate schedule and the optimizer's bias correction
  //! count from: a run resumed from a checkpoint taken after step n continues at n + 1.
  void set_steps(std::int64_t steps) {
    LOOM_CHECK(steps >= 0, "set_steps: steps", steps, "must be >= 0");
    step_ = steps;
  }
  //! The flat parameters in place, in stage().layout() order (the model's layout without
  //! pipeline stages), for strategies that hold them whole on every rank (SingleRank,
  //! DataParallel).
  const scalar_type* parameters() const noexcept
    requires requires(const Engine& e) { e.params(); }
  {
    return engine_.params();
  }
  //! Writable parameters in place, e.g. to load a checkpoint before the first step.
  scalar_type* mutable_parameters() noexcept
    requires requires(Engine& e) { e.mutable_params(); }
  {
    return engine_.mutable_params();
  }
  //! The flat gradients of the last step (after clipping), where the strategy holds them whole.
  //! With TrainerOptions::fp32_gradients (bf16 models) they are in fp32_gradients() instead.
  const scalar_type* gradients() noexcept
    requires requires(Engine& e) { e.grads(); }
  {
    return engine_.grads();
  }
  //! The flat fp32 gradients of the last step (after clipping) where TrainerOptions::fp32_gradients
  //! keeps them (bf16 models); null otherwise.
  const accumulate_t<scalar_type>* fp32_gradients() noexcept
    requires requires(Engine& e) { e.fp32_grads(); }
  {
    return engine_.fp32_grads();
  }
  const MemoryTracker& memory() const noexcept { return backend_->memory(); }
  const TrainerOptions& options() const noexcept { return options_; }
  //! The strategy's settings.
  const St& strategy() const noexcept { return strategy_; }
  //! The schedule's settings.
  const S& schedule() const noexcept { return schedule_; }
  //! The strategy's engine (its buffers, and e.g. DataParallel's buckets).
  const Engine& engine() const noexcept { return engine_; }
  //! This rank's place in the tensor-parallel group (size 1 without tensor parallelism).
  int tensor_parallel_rank() const { return tensor_parallel_.rank(); }
  int tensor_parallel_size() const { return tensor_parallel_.size(); }
  //! This rank's place in the data-parallel group.
  int data_parallel_rank() const { return group_.rank(); }
  int data_parallel_size() const { return group_.size(); }
  //! This rank's pipeline stage, and the stages.
  int pipeline_rank() const { return pipeline_.rank(); }
  int pipeline_size() const { return pipeline_.size(); }
  //! Micro-batch activation sets this rank holds at once (the schedule's live_micro_batches for
  //! the last step's shape): each holds one chunk's saved activations of one micro-batch.
  std::int64_t activation_slots() const noexcept { return static_cast<std::int64_t>(slots_.size()); }
  //! Elements of one activation slot (saved activations, hidden states, split-backward stash).
  std::int64_t activation_slot_elements() const noexcept { return slot_elements_; }
  //! Layers of this rank that recompute their activations in the backward
  //! (TrainerOptions::recompute_layers), for the last step's shape.
  int recomputed_layers() const noexcept {
    int n = 0;
    for (const ChunkPlan& p : chunk_plans_)
      n += static_cast<int>(std::count(p.recomputed.begin(), p.recomputed.end(), true));
    return n;
  }
  //! Elements of the buffers the recomputed layers share for their activations and their
  //! (discarded) output (0 without recomputation).
  std::int64_t recompute_elements() const noexcept { return recompute_saved_.size() + recompute_output_.size(); }

 private:
  using T = scalar_type;

  template <LrSchedule L>
  Trainer(backend_type& backend, CommunicatorRef group, CommunicatorRef tensor_parallel, CommunicatorRef pipeline,
          M model, O optimizer, L lr, TrainerOptions options, St strategy, S schedule)
      : backend_(&backend),
        group_(group),
        tensor_parallel_(tensor_parallel),
        pipeline_(pipeline),
        stage_(make_stage(std::move(model), pipeline, schedule)),
        whole_layout_(loom::whole_layout(stage_.model().layout())),
        optimizer_(std::move(optimizer)),
        schedule_((check_schedule(schedule, pipeline, chunks_per_rank(schedule)), std::move(schedule))),
        strategy_(std::move(strategy)),
        lr_([lr = std::move(lr)](std::int64_t step) { return static_cast<double>(lr.at(step)); }),
        options_(options),
        layer_parameters_(layer_parameters_of(stage_)),
        engine_(strategy_, EngineContext<backend_type>{.backend = (validate(options), backend),
                                                       .data_parallel = group,
                                                       .layout = stage_.layout(),
                                                       .state_slots = O::state_slots,
                                                       .seed = options.seed,
                                                       .layer_parameters = layer_parameters_,
                                                       .fp32_gradients = options.fp32_gradients}),
        tensor_state_(make_tensor_state(backend, stage_.layout())),
        mailbox_pool_(backend, MemoryCategory::communication) {}

  //! The optimizer's per-tensor state (a TensorwiseOptimizer's State), or nothing.
  using TensorState = typename detail::TensorStateOf<O, backend_type, T>::type;
  static TensorState make_tensor_state(backend_type& backend, const ParameterLayout& layout) {
    if constexpr (TensorwiseOptimizer<O>)
      return TensorState(backend, layout);
    else
      return {};
  }

  //! Where each parameter of whole_layout() starts in the whole per-tensor state, and its end.
  std::vector<std::int64_t> whole_tensor_state_offsets() const {
    std::vector<std::int64_t> offsets{0};
    for (const auto& e : whole_layout_.entries()) {
      std::int64_t n = 0;
      if constexpr (TensorwiseOptimizer<O>) n = TensorState::numbers(e.spec.whole_shape());
      offsets.push_back(offsets.back() + n);
    }
    return offsets;
  }
  //! owned_tensor_state_runs (owned) or needed_tensor_state_runs.
  std::vector<WholeRun> tensor_state_runs(bool owned) const {
    std::vector<WholeRun> runs;
    if constexpr (TensorwiseOptimizer<O>) {
      if (owned && (group_.rank() != 0 || tensor_parallel_.rank() != 0)) return runs;
      const std::vector<std::int64_t> whole = whole_tensor_state_offsets();
      const auto stage = stage_.layout().entries();
      const auto entries = whole_layout_.entries();
      for (std::size_t p = 0; p < stage.size(); ++p) {
        if (owned && stage[p].spec.tied_copy) continue;
        const auto w = static_cast<std::size_t>(&whole_layout_.find(stage[p].spec.name) - entries.data());
        runs.push_back({.local = tensor_state_.offset(p), .whole = whole[w], .count = whole[w + 1] - whole[w]});
      }
    }
    return runs;
  }

  //! Steps the optimizer over the ranges the strategy hands this rank (step_ + 1, from 1).
  void apply_optimizer(std::span<const detail::FlatRange<T>> ranges, double lr) {
    const ParameterLayout& layout = stage_.layout();
    if constexpr (TensorwiseOptimizer<O>) {
      // A tensor's pieces are on the data-parallel ranks that shard it (the strategy sums over
      // them) and its slices on the tensor-parallel group; each stage holds its own tensors.
      optimizer_.update(*backend_, layout, std::span<const TensorSegment<T>>(detail::tensor_segments(layout, ranges)),
                        tensor_state_, lr, step_ + 1, tensor_parallel_.rank() == 0, [&](std::span<double> values) {
                          engine_.reduce_updated(values);
                          if (tensor_parallel_.size() > 1) tensor_parallel_.all_reduce(values, ReduceOp::sum);
                        });
    } else {
      for (const detail::FlatRange<T>& range : ranges)
        detail::apply_optimizer(optimizer_, *backend_, layout, range, lr, step_ + 1);
    }
  }

  //! This rank's layers: the model's layers cut into pp × chunks virtual stages balanced by
  //! layer_cost, of which this rank runs stage, stage + pp, ...
  static Stage make_stage(M model, CommunicatorRef pipeline, const S& schedule) {
    const int stages = pipeline.size(), chunks = chunks_per_rank(schedule);
    LOOM_CHECK(chunks >= 1, "trainer: the schedule's virtual stages", chunks, "must be >= 1");
    if (stages == 1 && chunks == 1) return Stage(std::move(model));
    LOOM_CHECK(model.num_layers() >= stages * chunks, "trainer: pipeline stages x virtual stages",
               detail::to_text(stages) + " x " + detail::to_text(chunks),
               "the model has " + detail::to_text(model.num_layers()) +
                   " layers and every virtual stage needs at least one");
    std::vector<double> costs;
    for (int l = 0; l < model.num_layers(); ++l) costs.push_back(model.layer_cost(l));
    std::vector<StageLayers> virtual_stages = balance_stages(costs, stages * chunks);
    return Stage(std::move(model), std::move(virtual_stages), stages, pipeline.rank());
  }

  //! The schedule must accept this pipeline (GradientAccumulation runs one stage, ...), checked
  //! before step 1 with p micro-batches (a count every schedule accepts).
  static void check_schedule(const S& schedule, CommunicatorRef pipeline, int chunks) {
    (void)schedule.actions(ScheduleShape{.stages = pipeline.size(), .stage = pipeline.rank(),
                                         .micro_batches = pipeline.size(), .virtual_stages = chunks});
  }

  static std::int64_t elements_of(const std::vector<ElementRange>& ranges) {
    std::int64_t n = 0;
    for (const ElementRange& r : ranges) n += r.size();
    return n;
  }
  //! Where the stage-layout `ranges`, stored one after another, are in whole_layout(): tied
  //! copies only `with_tied_copies`, parameters replicated over tensor parallelism only
  //! `with_replicated`.
  std::vector<WholeRun> state_runs(const std::vector<ElementRange>& ranges, bool with_replicated,
                                   bool with_tied_copies) const {
    std::vector<WholeRun> runs;
    std::int64_t local = 0;
    for (const ElementRange& r : ranges) {
      for (const auto& s : stage_.segments()) {
        const std::int64_t first = std::max(r.begin, s.stage_offset), last = std::min(r.end, s.stage_offset + s.numel);
        if (first >= last || (s.tied_copy && !with_tied_copies)) continue;
        append_whole_runs(model().layout(), whole_layout_, s.model_offset + (first - s.stage_offset), last - first,
                          local + (first - r.begin), with_replicated, runs);
      }
      local += r.size();
    }
    return runs;
  }

  template <class U>
  void load_values(std::span<const U> values) {
    LOOM_CHECK(static_cast<std::int64_t>(values.size()) == model().layout().total(), "load_parameters: elements",
               values.size(), "must equal the layout's " + detail::to_text(model().layout().total()));
    std::vector<U> mine(static_cast<std::size_t>(stage_.layout().total()));
    stage_.gather_from(values.data(), mine.data());
    engine_.load_parameters(mine.data());
  }

  static std::vector<std::vector<ElementRange>> layer_parameters_of(const Stage& stage) {
    std::vector<std::vector<ElementRange>> out;
    for (int l = 0; l < stage.num_layers(); ++l) out.push_back(stage.layer_parameters(l));
    return out;
  }

  //! The model must be split over the mesh's tensor-parallel group.
  template <class C>
  static void check_mesh(Mesh<C>& mesh, const M& model) {
    if constexpr (requires { model.tensor_parallel_size(); })
      LOOM_CHECK(model.tensor_parallel_size() == mesh.shape().tp, "trainer: the model's tensor-parallel ranks",
                 model.tensor_parallel_size(),
                 "must equal the mesh's tp (" + detail::to_text(mesh.shape().tp) +
                     "): build the model over mesh.tensor_parallel()");
  }

  //! The squared global gradient norm: each data-parallel group's strategy counts its elements
  //! once; over tensor parallelism the split parameters add up across the group and the
  //! replicated ones (identical on every TP rank) count once, from TP rank 0; over the pipeline
  //! the stages add up, tied copies counted on their owner only.
  double gradient_sum_of_squares() {
    double sum = engine_.grad_sum_of_squares(tensor_parallel_.rank() == 0);
    if (tensor_parallel_.size() > 1) tensor_parallel_.all_reduce(std::span<double>(&sum, 1), ReduceOp::sum);
    return pipeline_sum(sum);
  }

  //! `local` summed over the pipeline's stages.
  double pipeline_sum(double local) {
    if (pipeline_.size() > 1) pipeline_.all_reduce(std::span<double>(&local, 1), ReduceOp::sum);
    return local;
  }

  static void validate(const TrainerOptions& o) {
    LOOM_CHECK(o.micro_batch_size >= 1, "trainer options: micro_batch_size", o.micro_batch_size,
               "must be >= 1");
    LOOM_CHECK(o.clip_grad_norm >= 0, "trainer options: clip_grad_norm", o.clip_grad_norm,
               "must be >= 0 (0 disables clipping)");
    LOOM_CHECK(o.recompute_layers >= 0, "trainer options: recompute_layers", o.recompute_layers,
               "must be >= 0 (0: no recomputation; TrainerOptions::all_layers: every layer)");
    // A zero-bubble schedule defers each weight-gradient pass, which reads the layer's
    // activations, past other micro-batches' work: a recomputed layer would have to hold them
    // from its input pass to then, which saves nothing at the peak.
    LOOM_CHECK(o.recompute_layers == 0 || !splits_backward_schedule<S>, "trainer options: recompute_layers",
               o.recompute_layers,
               "must be 0 under a schedule that splits the backward (ZeroBubbleH1): its weight passes read "
               "the activations after other micro-batches' work; recompute with OneFOneB, Interleaved1F1B, "
               "GPipe or GradientAccumulation, or keep less with AttentionStorage::recompute");
  }

  //! Checks the batch and (re)allocates activation storage for its shape; returns the number
  //! of micro-batches.
  std::int64_t plan(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets,
                    Tensor<const std::int32_t> lengths) {
    LOOM_CHECK(tokens.shape().rank() == 2, "trainer step: tokens shape", tokens.shape(),
               "expected [batch, seq]");
    LOOM_CHECK(targets.shape() == tokens.shape(), "trainer step: targets shape", targets.shape(),
               "must equal the tokens' shape " + detail::to_text(tokens.shape()));
    check_lengths(targets, lengths);
    const std::int64_t rows = tokens.extent(0), mbs = options_.micro_batch_size;
    const std::int64_t ranks = group_.size();
    if (ranks == 1)
      LOOM_CHECK(rows % mbs == 0, "trainer step: global batch size", rows,
                 "must be a multiple of micro_batch_size (" + detail::to_text(mbs) + ")");
    else
      LOOM_CHECK(rows % (mbs * ranks) == 0, "trainer step: global batch size", rows,
                 "must be a multiple of micro_batch_size (" + detail::to_text(mbs) +
                     ") x data-parallel ranks (" + detail::to_text(ranks) + ")");
    const std::int64_t micro_batches = rows / (mbs * ranks);
    first_row_ = group_.rank() * (rows / ranks);
    allocate({mbs, tokens.extent(1)}, micro_batches);
    return micro_batches;
  }

  //! Plans which sends and receives go out together, for step() and for evaluate(): the first
  //! grouping (detail::MessageGrouping) under which every rank's groups complete when
  //! point-to-point runs in issue order (NCCL: no tags, one stream; detail::in_order_deadlock).
  //! Every rank's actions follow from the schedule and the shape, so this rank models all of
  //! them, and all ranks choose alike. Over such a communicator a schedule that no grouping
  //! completes is refused here, before anything is sent; a communicator with tags runs any.
  void plan_messages(const ScheduleShape& mine) {
    plan_.clear();
    evaluate_plan_.clear();
    evaluate_actions_.clear();
    for (std::int64_t mb = 0; mb < mine.micro_batches; ++mb)
      for (int c = 0; c < mine.virtual_stages; ++c)
        evaluate_actions_.push_back({.kind = Action::Kind::forward, .micro_batch = mb, .chunk = c});
    if (pipeline_.size() < 2) {
      plan_.resize(actions_.size() + 1);
      evaluate_plan_.resize(evaluate_actions_.size() + 1);
      return;
    }
    const bool in_order = pipeline_.point_to_point_in_issue_order();
    const auto refuse = [&](const char* what, const std::string& why) {
      throw Error("trainer: pipeline " + std::string(what) + " on " + detail::to_text(mine) +
                      " over a communicator that runs point-to-point in issue order (NCCL)",
                  "would deadlock", why + "; use a communicator with tags (threads, MPI, or one staged through host memory)");
    };
    std::vector<std::vector<Action>> every_stage;
    for (int s = 0; s < mine.stages; ++s) {
      ScheduleShape theirs = mine;
      theirs.stage = s;
      every_stage.push_back(s == mine.stage ? actions_ : schedule_.actions(theirs));
    }
    const detail::GroupingChoice step = detail::choose_grouping(every_stage, mine);
    if (!step.safe && in_order) refuse("schedule", step.why_not);
    plan_ = detail::message_plan(actions_, mine, step.safe.value_or(detail::MessageGrouping::per_action));
    const detail::GroupingChoice evaluation = detail::choose_grouping(
        std::vector<std::vector<Action>>(static_cast<std::size_t>(mine.stages), evaluate_actions_), mine);
    if (!evaluation.safe && in_order) refuse("evaluation", evaluation.why_not);
    evaluate_plan_ =
        detail::message_plan(evaluate_actions_, mine, evaluation.safe.value_or(detail::MessageGrouping::per_action));
  }

  //! Where each chunk's layers keep their activations inside a slot.
  struct ChunkPlan {
    int first = 0, count = 0;  //!< local layers [first, first + count)
    int virtual_stage = 0;
    bool receives = false;  //!< its first layer's input comes from the previous virtual stage
    bool sends = false;     //!< its last layer's output goes to the next virtual stage
    std::vector<std::int64_t> saved_offset, stash_offset;  //!< per layer of the chunk, and the end
    //! Per layer of the chunk: it keeps nothing in the slot and recomputes its activations
    //! (TrainerOptions::recompute_layers).
    std::vector<bool> recomputed;
  };

  //! The schedule's actions and activation slots for `shape` (the schedule says how many
  //! micro-batches live at once); nothing is allocated when the shape repeats.
  void allocate(MicroBatchShape shape, std::int64_t micro_batches) {
    const int chunks = stage_.chunks();
    const ScheduleShape schedule_shape{.stages = pipeline_.size(), .stage = pipeline_.rank(),
                                       .micro_batches = micro_batches, .virtual_stages = chunks};
    if (micro_batches != planned_micro_batches_) {
      actions_ = schedule_.actions(schedule_shape);  // generated once per micro-batch count
      // Each chunk's last backward (or weight-gradient pass) completes its gradients.
      completes_chunk_.assign(actions_.size(), false);
      std::vector<bool> seen(static_cast<std::size_t>(chunks), false);
      for (std::size_t i = actions_.size(); i-- > 0;) {
        const Action& a = actions_[i];
        LOOM_CHECK(a.chunk >= 0 && a.chunk < chunks, "trainer: schedule action", a,
                   "names a chunk this rank does not have (" + detail::to_text(chunks) + " chunks)");
        const bool finishing = a.kind == Action::Kind::backward || a.kind == Action::Kind::backward_weight;
        if (finishing && !seen[static_cast<std::size_t>(a.chunk)]) {
          completes_chunk_[i] = true;
          seen[static_cast<std::size_t>(a.chunk)] = true;
        }
      }
      plan_messages(schedule_shape);
      planned_micro_batches_ = micro_batches;
    }
    const std::int64_t slots = schedule_.live_micro_batches(schedule_shape);
    if (shape == shape_ && slots == static_cast<std::int64_t>(slots_.size())) return;
    wait_for_sends();
    shape_ = shape;
    const std::int64_t hidden = stage_.hidden_elements(shape);
    const int model_layers = stage_.model().num_layers();
    chunk_plans_.clear();
    std::int64_t saved = 0, stash = 0, hiddens = 0, workspace = 0, recomputed_saved = 0;
    bool any_receives = false;
    for (int c = 0; c < chunks; ++c) {
      ChunkPlan p;
      const StageLayers local = stage_.chunk_layers(c), global = stage_.chunk_model_layers(c);
      p.first = local.first;
      p.count = local.count();
      p.virtual_stage = c * pipeline_.size() + pipeline_.rank();
      p.receives = global.first > 0;
      p.sends = global.last + 1 < model_layers;
      p.saved_offset.assign(static_cast<std::size_t>(p.count) + 1, 0);
      p.stash_offset.assign(static_cast<std::size_t>(p.count) + 1, 0);
      p.recomputed.assign(static_cast<std::size_t>(p.count), false);
      int recompute_left = options_.recompute_layers;
      for (int j = 0; j < p.count; ++j) {
        // Every layer's range starts 16-byte aligned, so that a layer may keep values of a wider
        // type than T in it (a head's per-row statistics in double).
        constexpr auto align = static_cast<std::int64_t>(sizeof(T) >= 16 ? 1 : 16 / sizeof(T));
        const std::int64_t kept = (stage_.activation_elements(p.first + j, shape) + align - 1) / align * align;
        const bool last = global.first + j + 1 == model_layers;  // computes the loss
        if (recompute_left > 0 && kept > 0 && !last) {
          p.recomputed[static_cast<std::size_t>(j)] = true;
          --recompute_left;
          recomputed_saved = std::max(recomputed_saved, kept);
        }
        p.saved_offset[j + 1] = p.saved_offset[j] + (p.recomputed[static_cast<std::size_t>(j)] ? 0 : kept);
        if constexpr (splits_backward_schedule<S>)
          p.stash_offset[j + 1] = p.stash_offset[j] + stage_.stash_elements(p.first + j, shape);
        workspace = std::max(workspace, stage_.workspace_elements(p.first + j, shape));
      }
      saved = std::max(saved, p.saved_offset.back());
      stash = std::max(stash, p.stash_offset.back());
      hiddens = std::max<std::int64_t>(hiddens, p.count - 1 + p.receives + p.sends);
      any_receives = any_receives || p.receives;
      chunk_plans_.push_back(std::move(p));
    }
    slots_.clear();
    for (std::int64_t s = 0; s < slots; ++s) {
      Slot slot;
      slot.saved = Buffer<T, backend_type>(*backend_, saved, MemoryCategory::activations);
      slot.hidden = Buffer<T, backend_type>(*backend_, hidden * hiddens, MemoryCategory::activations);
      slot.stash = Buffer<T, backend_type>(*backend_, stash, MemoryCategory::activations);
      if (any_receives) slot.input_grad = Buffer<T, backend_type>(*backend_, hidden, MemoryCategory::communication);
      slots_.push_back(std::move(slot));
    }
    slot_elements_ = saved + hidden * hiddens + stash;
    // One layer's activations at a time: a recomputed layer's, from its forward run again to the
    // end of its backward (and its forward's, which nothing reads), and its output, which its
    // successor already holds.
    recompute_saved_ = Buffer<T, backend_type>(*backend_, recomputed_saved, MemoryCategory::activations);
    recompute_output_ =
        Buffer<T, backend_type>(*backend_, recomputed_saved > 0 ? hidden : 0, MemoryCategory::workspace);
    workspace_ = Buffer<T, backend_type>(*backend_, workspace, MemoryCategory::workspace);
    hidden_grads_ = Buffer<T, backend_type>(*backend_, 2 * hidden, MemoryCategory::workspace);
    received_grad_ = Buffer<T, backend_type>(*backend_, any_sends() ? hidden : 0, MemoryCategory::communication);
  }

  bool any_sends() const {
    for (const ChunkPlan& p : chunk_plans_)
      if (p.sends) return true;
    return false;
  }

  //! A batch's inputs: [batch, seq] tokens and targets, and [batch] sequence lengths (empty: no
  //! padding).
  struct Inputs {
    Tensor<const std::int32_t> tokens, targets, lengths;
  };

  //! `global.lengths_view()` where a batch type has one, else empty (no padding).
  template <class Batch>
  static Tensor<const std::int32_t> lengths_of(const Batch& global) {
    if constexpr (requires { global.lengths_view(); })
      return global.lengths_view();
    else
      return {};
  }

  //! Checks `lengths` (host memory) against the batch: empty, or [batch] with each length in
  //! [1, seq] and every target at or past its sequence's length ignored (< 0), so that padding
  //! never reaches the loss.
  static void check_lengths(Tensor<const std::int32_t> targets, Tensor<const std::int32_t> lengths) {
    if (lengths.empty()) return;
    const std::int64_t rows = targets.extent(0), seq = targets.extent(1);
    LOOM_CHECK(lengths.shape() == Shape{rows}, "trainer step: lengths shape", lengths.shape(),
               "expected [batch] = [" + detail::to_text(rows) + "] (or empty: no padding)");
    for (std::int64_t i = 0; i < rows; ++i) {
      const std::int32_t length = lengths.data()[i];
      LOOM_CHECK(length >= 1 && length <= seq, "trainer step: lengths[" + detail::to_text(i) + "]", length,
                 "must be in [1, seq = " + detail::to_text(seq) + "]");
      for (std::int64_t t = length; t < seq; ++t)
        LOOM_CHECK(targets.data()[i * seq + t] < 0,
                   "trainer step: target of padded position [" + detail::to_text(i) + ", " + detail::to_text(t) + "]",
                   targets.data()[i * seq + t],
                   "must be < 0 (ignored): sequence " + detail::to_text(i) + " is " + detail::to_text(length) +
                       " tokens long");
    }
  }

  //! Micro-batch `mb` of this rank's slice of the global batch: rows [first_row + mb·size,
  //! first_row + (mb+1)·size).
  Inputs micro(const Inputs& global, std::int64_t mb) const {
    const std::int64_t rows = options_.micro_batch_size, seq = global.tokens.extent(1);
    const std::int64_t first = first_row_ + mb * rows;
    const auto slice = [&](Tensor<const std::int32_t> t) {
      return Tensor<const std::int32_t>(t.data() + first * seq, Shape{rows, seq});
    };
    return {slice(global.tokens), slice(global.targets),
            global.lengths.empty() ? Tensor<const std::int32_t>{}
                                   : Tensor<const std::int32_t>(global.lengths.data() + first, Shape{rows})};
  }

  //! The global batch where the kernels read it, after the model's own check of its values
  //! (`check_batch`, where the model has one): as given on a backend with host memory, else
  //! copied into backend memory (one copy a step; 8 bytes a token and 4 a sequence).
  Inputs place_batch(const Inputs& given) {
    if constexpr (requires(const M& m) { m.check_batch(given.tokens, given.targets); })
      stage_.model().check_batch(given.tokens, given.targets);
    if constexpr (host_addressable<backend_type>) {
      return given;
    } else {
      const std::int64_t n = given.tokens.numel(), needed = 2 * n + given.lengths.numel();
      if (batch_.size() < needed) {
        batch_ = Buffer<std::int32_t, backend_type>();
        batch_ = Buffer<std::int32_t, backend_type>(*backend_, needed, MemoryCategory::activations);
      }
      const auto place = [this](std::int64_t at, Tensor<const std::int32_t> from) {
        if (from.empty()) return Tensor<const std::int32_t>{};
        backend_->copy_from_host(batch_.data() + at, from.data(),
                                 sizeof(std::int32_t) * static_cast<std::size_t>(from.numel()));
        return Tensor<const std::int32_t>(batch_.data() + at, from.shape());
      };
      return {place(0, given.tokens), place(n, given.targets), place(2 * n, given.lengths)};
    }
  }


  static std::int64_t count_targets(Tensor<const std::int32_t> targets) {
    std::int64_t n = 0;
    for (std::int32_t t : targets) n += t >= 0;
    return n;
  }

  //! One micro-batch's activations of one chunk, from its forward to its (last) backward pass.
  struct Slot {
    Buffer<T, backend_type> saved, hidden, stash, input_grad;
    Request output_sent, input_grad_sent;  //!< sends reading `hidden`'s output and `input_grad`
    std::int64_t micro_batch = -1;
    int chunk = -1;
  };

  //! A free slot for the forward of (mb, chunk), once the send of its last output is done. A
  //! slot whose output a send not yet issued still reads (evaluate() frees each slot at once) is
  //! taken only when no other is free, and that send then goes out alone first.
  Slot& acquire(std::int64_t mb, int chunk) {
    Slot* free = nullptr;
    for (Slot& s : slots_)
      if (s.micro_batch < 0 && (free == nullptr || unissued_reads(*free))) free = &s;
    if (free != nullptr) {
      if (unissued_reads(*free)) issue_unissued_reading(*free);
      free->output_sent.wait();
      free->micro_batch = mb;
      free->chunk = chunk;
      return *free;
    }
    throw Error("trainer: activation slots for forward F" + detail::to_text(mb) + "." + detail::to_text(chunk),
                slots_.size(),
                "the schedule said this many micro-batches are alive at once on this rank, but its actions "
                "keep more (live_micro_batches is too small for actions)");
  }
  Slot* held(std::int64_t mb, int chunk) {
    for (Slot& s : slots_)
      if (s.micro_batch == mb && s.chunk == chunk) return &s;
    return nullptr;
  }
  Slot& find(std::int64_t mb, int chunk) {
    if (Slot* s = held(mb, chunk)) return *s;
    throw Error("trainer: backward of micro-batch " + detail::to_text(mb) + ", chunk " + detail::to_text(chunk),
                "no forward", "a schedule must run a micro-batch's forward before its backward");
  }
  static void release(Slot& s) { s.micro_batch = -1; }
  //! Only a step that threw leaves sends not issued (into its slots) or slots held.
  void forget_unfinished_step() {
    unissued_.clear();
    for (Slot& s : slots_) release(s);
  }

  //! Hidden state j of a chunk in `slot`: 0 the chunk's input, j the output of its j-th layer.
  Tensor<T> hidden(Slot& slot, const ChunkPlan& p, int j) const {
    const std::int64_t n = stage_.hidden_elements(shape_);
    return {slot.hidden.data() + (j - (p.receives ? 0 : 1)) * n, hidden_shape()};
  }
  Shape hidden_shape() const {
    const std::int64_t n = stage_.hidden_elements(shape_);
    return Shape{shape_.batch, shape_.seq, n / (shape_.batch * shape_.seq)};
  }
  static Tensor<T> range(Buffer<T, backend_type>& b, const std::vector<std::int64_t>& offsets, int j) {
    return {b.data() + offsets[static_cast<std::size_t>(j)],
            Shape{offsets[static_cast<std::size_t>(j) + 1] - offsets[static_cast<std::size_t>(j)]}};
  }
  //! Local layer `l`'s scratch, for its forward and its backward.
  Tensor<T> workspace(int l) { return {workspace_.data(), Shape{stage_.workspace_elements(l, shape_)}}; }
  //! Where layer j of a chunk keeps its activations: its range of the slot, or the buffer the
  //! recomputed layers share.
  Tensor<T> saved(Slot& slot, const ChunkPlan& p, int j) {
    const Shape kept{stage_.activation_elements(p.first + j, shape_)};
    if (p.recomputed[static_cast<std::size_t>(j)]) return {recompute_saved_.data(), kept};
    return {slot.saved.data() + p.saved_offset[static_cast<std::size_t>(j)], kept};
  }

  //! The dropout key of micro-batch `mb` in this step: the seed, the steps done, and the global
  //! index of its first sequence (DESIGN.md invariant 2: masks do not depend on the mesh).
  DropoutKey dropout_key(std::int64_t mb) const noexcept {
    return {.seed = options_.seed, .step = step_, .first_sequence = first_row_ + mb * options_.micro_batch_size};
  }

  //! The forward of one chunk of micro-batch `mb`; `loss_scale` is its backward's (0: none follows).
  double forward(std::int64_t mb, int chunk, const Inputs& inputs, DropoutKey dropout,
                 accumulate_t<T> loss_scale) {
    const ChunkPlan& p = chunk_plans_[static_cast<std::size_t>(chunk)];
    Slot* received = held(mb, chunk);  // a receive from another rank took the slot (issue)
    Slot& slot = received != nullptr ? *received : acquire(mb, chunk);
    if (p.receives && received == nullptr) take_local(hidden(slot, p, 0), message_tag(0, mb, p.virtual_stage));
    double loss_sum = 0;
    for (int j = 0; j < p.count; ++j) {
      const int l = p.first + j;
      ForwardArgs<T> a{.tokens = inputs.tokens,
                       .targets = inputs.targets,
                       .input = j > 0 || p.receives ? Tensor<const T>(hidden(slot, p, j)) : Tensor<const T>{},
                       .output = j + 1 < p.count || p.sends ? hidden(slot, p, j + 1) : Tensor<T>{},
                       .saved = saved(slot, p, j),
                       .dropout = dropout,
                       .workspace = workspace(l),
                       .lengths = inputs.lengths,
                       .loss_scale = loss_scale};
      loss_sum += stage_.forward(*backend_, l, engine_.forward_params(l), a);
      engine_.after_forward(l);
    }
    if (p.sends) transmit(hidden(slot, p, p.count), p.virtual_stage + 1, message_tag(0, mb, p.virtual_stage + 1), slot.output_sent);
    return loss_sum;
  }

  //! A whole backward, or its input-gradient pass (backward_input), of one chunk.
  void backward(const Action& action, const Inputs& inputs, accumulate_t<T> loss_scale, bool completes) {
    const ChunkPlan& p = chunk_plans_[static_cast<std::size_t>(action.chunk)];
    Slot& slot = find(action.micro_batch, action.chunk);
    const std::int64_t mb = action.micro_batch;
    const std::int64_t n = stage_.hidden_elements(shape_);
    // From another rank the gradient came in this action's group (issue).
    if (p.sends && (p.virtual_stage + 1) % pipeline_.size() == pipeline_.rank())
      take_local(Tensor<T>(received_grad_.data(), hidden_shape()), message_tag(1, mb, p.virtual_stage));
    if (p.receives) slot.input_grad_sent.wait();
    int current = 0;  // which half of hidden_grads_ holds d loss / d output of layer j
    for (int j = p.count - 1; j >= 0; --j) {
      const int l = p.first + j;
      Tensor<T> input_grad{};
      if (j > 0) input_grad = Tensor<T>(hidden_grads_.data() + (1 - current) * n, hidden_shape());
      else if (p.receives) input_grad = Tensor<T>(slot.input_grad.data(), hidden_shape());
      // A model that adds to its input gradient needs zeros there; one that writes it, nothing.
      if constexpr (!writes_input_grad<M>)
        if (!input_grad.empty()) backend_->fill_zero(input_grad.data(), sizeof(T) * static_cast<std::size_t>(n));
      Tensor<const T> output_grad{};
      if (j + 1 < p.count) output_grad = Tensor<const T>(hidden_grads_.data() + current * n, hidden_shape());
      else if (p.sends) output_grad = Tensor<const T>(received_grad_.data(), hidden_shape());
      BackwardArgs<T> a{.tokens = inputs.tokens,
                        .targets = inputs.targets,
                        .input = j > 0 || p.receives ? Tensor<const T>(hidden(slot, p, j)) : Tensor<const T>{},
                        .output_grad = output_grad,
                        .input_grad = input_grad,
                        .saved = saved(slot, p, j),
                        .workspace = workspace(l),
                        .loss_scale = loss_scale,
                        .dropout = dropout_key(mb),
                        .lengths = inputs.lengths};
      const ParameterView<const T> params = engine_.backward_params(l);
      if (p.recomputed[static_cast<std::size_t>(j)]) {
        // The forward again, from the input the slot kept, with the same parameters and masks:
        // the activations it kept the first time (its output is already the next layer's input).
        const ForwardArgs<T> again{.tokens = inputs.tokens,
                                   .targets = inputs.targets,
                                   .input = a.input,
                                   .output = Tensor<T>(recompute_output_.data(), hidden_shape()),
                                   .saved = a.saved,
                                   .dropout = a.dropout,
                                   .workspace = a.workspace,
                                   .lengths = inputs.lengths,
                                   .loss_scale = loss_scale};
        (void)stage_.forward(*backend_, l, params, again);
      }
      if (action.kind == Action::Kind::backward) {
        stage_.backward(*backend_, l, params, engine_.backward_grads(l), a);
        notify(l, completes);
      } else {
        if constexpr (SplitBackwardModel<M>) {
          stage_.backward_input(*backend_, l, params, engine_.backward_grads(l), a,
                                range(slot.stash, p.stash_offset, j));
          // Parameter gradients the input pass makes go into the fp32 sums now, not after other
          // micro-batches' input passes have added theirs to them in bf16.
          if constexpr (requires(Engine& e) { e.drain(l); }) engine_.drain(l);
        } else {
          throw Error("trainer: schedule action", detail::to_text(action),
                      "needs a Model with backward_input and backward_weight");
        }
      }
      current = 1 - current;
    }
    if (p.receives)
      transmit(Tensor<T>(slot.input_grad.data(), hidden_shape()), p.virtual_stage - 1,
               message_tag(1, mb, p.virtual_stage - 1), slot.input_grad_sent);
    if (action.kind == Action::Kind::backward) release(slot);
  }

  //! The weight-gradient pass of one chunk (after its backward_input).
  void backward_weight(const Action& action, const Inputs& inputs, accumulate_t<T> loss_scale, bool completes) {
    if constexpr (SplitBackwardModel<M>) {
      const ChunkPlan& p = chunk_plans_[static_cast<std::size_t>(action.chunk)];
      Slot& slot = find(action.micro_batch, action.chunk);
      for (int j = p.count - 1; j >= 0; --j) {
        const int l = p.first + j;
        BackwardArgs<T> a{.tokens = inputs.tokens,
                          .targets = inputs.targets,
                          .input = j > 0 || p.receives ? Tensor<const T>(hidden(slot, p, j)) : Tensor<const T>{},
                          .output_grad = {},  // the weight pass reads the stash instead
                          .input_grad = {},
                          .saved = saved(slot, p, j),
                          .workspace = workspace(l),
                          .loss_scale = loss_scale,
                          .dropout = dropout_key(action.micro_batch),
                          .lengths = inputs.lengths};
        stage_.backward_weight(*backend_, l, engine_.backward_params(l), engine_.backward_grads(l), a,
                               range(slot.stash, p.stash_offset, j));
        notify(l, completes);
      }
      release(slot);
    } else {
      (void)inputs, (void)loss_scale, (void)completes;
      throw Error("trainer: schedule action", detail::to_text(action),
                  "needs a Model with backward_input and backward_weight");
    }
  }

  //! Tells the engine `layer`'s backward is done. The last one of local layer 0 waits when this
  //! rank holds tied parameters: their gradients are summed across the stages first.
  void notify(int layer, bool completes) {
    if (completes && layer == 0 && !stage_.tied().empty()) {
      deferred_notification_ = true;
      return;
    }
    engine_.on_backward(layer, completes);
  }

  //! The end of a step's actions: sends done, tied gradients summed, the engine told.
  void finish_pipeline() {
    wait_for_sends();
    if (!stage_.tied().empty()) {
      // Mostly waiting: the other holder (stage 0 for the last stage) finishes its backward later.
      const auto start = std::chrono::steady_clock::now();
      exchange_tied_gradients();
      wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (deferred_notification_) engine_.on_backward(0, true);
  }

  void wait_for_sends() {
    LOOM_CHECK(unissued_.empty(), "trainer: sends left out of the message plan", unissued_.size(),
               "every send goes out in a planned group (a bug in the executor)");
    const auto start = std::chrono::steady_clock::now();
    for (Slot& s : slots_) {
      s.output_sent.wait();
      s.input_grad_sent.wait();
    }
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  //! Every holder of a tied parameter ends with the same gradient: the holders' gradients summed
  //! in holder order (so the bits agree on every holder), in pieces of at most 1 Mi elements.
  //! Where the engine keeps fp32 gradients, local layer 0's last part is drained into them first
  //! (the engine is told of that layer only after this), and the fp32 sums are exchanged.
  void exchange_tied_gradients() {
    if constexpr (requires(Engine& e) { e.fp32_grads_view(0); }) {
      if (engine_.fp32_gradients()) {
        engine_.drain(0);
        const ParameterView<accumulate_t<T>> sums = engine_.fp32_grads_view(0);
        return exchange_tied_gradients([&](std::int64_t offset, std::int64_t n) { return sums.at(offset, n); },
                                       wide_tied_buffer_, wide_tied_parts_);
      }
    }
    const auto at = [&](std::int64_t offset, std::int64_t n) { return engine_.backward_grads(0).at(offset, n); };
    exchange_tied_gradients(at, tied_buffer_, tied_parts_);
  }
  //! The exchange over gradients of type U: `at(offset, n)` points at n of them from layout
  //! element `offset`; `buffer` and `parts` are the scratch it keeps between steps.
  template <class At, class U>
  void exchange_tied_gradients(At at, Buffer<U, backend_type>& buffer, std::vector<const U*>& parts) {
    constexpr std::int64_t piece = std::int64_t{1} << 20;
    const int me = pipeline_.rank();
    for (std::size_t t = 0; t < stage_.tied().size(); ++t) {
      const TiedParameter& tied = stage_.tied()[t];
      const int tag = tied_tag_base + static_cast<int>(t);
      const std::int64_t others = static_cast<std::int64_t>(tied.holders.size()) - 1;
      const std::int64_t length = std::min(piece, tied.numel);
      if (buffer.size() < length * (others + 1))
        buffer = Buffer<U, backend_type>(*backend_, length * (others + 1), MemoryCategory::communication);
      U* grads = at(tied.offset, tied.numel);
      for (std::int64_t begin = 0; begin < tied.numel; begin += piece) {
        const std::int64_t n = std::min(piece, tied.numel - begin);
        const std::span<const U> mine(grads + begin, static_cast<std::size_t>(n));
        // Each holder's piece, in holder order: ours in place, the others received into the
        // buffer. The exchange goes pair by pair in holder order, each pair's send and receive
        // as one group: two holders that each sent first and then received would deadlock where
        // a send holds up the rank's later work until it is received (NCCL's stream order;
        // test_pipeline_stream_order).
        parts.clear();
        std::int64_t received = 0;
        for (int h : tied.holders) {
          if (h == me) {
            parts.push_back(grads + begin);
            continue;
          }
          U* into = buffer.data() + (1 + received++) * length;
          const std::span<U> theirs(into, static_cast<std::size_t>(n));
          const std::array exchange{pipeline_.send_call(mine, h, tag), pipeline_.recv_call(theirs, h, tag)};
          std::vector<Request> done = pipeline_.start_group(exchange);
          wait_all(done);
          parts.push_back(into);
        }
        U* sum = buffer.data();
        copy<U>(*backend_, Tensor<U>(sum, Shape{n}), Tensor<const U>(parts[0], Shape{n}));
        for (std::size_t i = 1; i < parts.size(); ++i)
          add_to<U>(*backend_, Tensor<U>(sum, Shape{n}), Tensor<const U>(parts[i], Shape{n}));
        copy<U>(*backend_, Tensor<U>(grads + begin, Shape{n}), Tensor<const U>(sum, Shape{n}));
      }
    }
  }

  //! Message tags on the pipeline group: activations (direction 0) and their gradients
  //! (direction 1) of micro-batch `mb` for virtual stage `to`. Tags repeat only 15000 messages
  //! apart, and messages between two ranks with one tag arrive in order.
  int message_tag(int direction, std::int64_t mb, int to) const {
    const std::int64_t stages = static_cast<std::int64_t>(pipeline_.size()) * stage_.chunks();
    return static_cast<int>((2 * (mb * stages + to) + direction) % tied_tag_base);
  }
  static constexpr int tied_tag_base = 30000;

  //! Sends `data` to the rank of virtual stage `to`; `done` gets the Request that completes when
  //! `data` may be reused. A send to another rank goes out in the group the plan puts it in
  //! (issue); with one pipeline rank the message stays here.
  void transmit(Tensor<T> data, int to, int tag, Request& done) {
    const int peer = to % pipeline_.size();
    if (peer != pipeline_.rank()) {
      unissued_.push_back(
          {pipeline_.send_call(std::span<const T>(data.data(), static_cast<std::size_t>(data.numel())), peer, tag), &done});
      return;
    }
    Buffer<T, backend_type> copy_of = mailbox_pool_.acquire(data.numel());
    copy<T>(*backend_, Tensor<T>(copy_of.data(), Shape{data.numel()}), Tensor<const T>(data.data(), Shape{data.numel()}));
    mailbox_.push_back({tag, std::move(copy_of)});
  }

  //! Starts one planned group: its sends (made by earlier actions, in the order they were made)
  //! and its receives (an activation into the slot it takes for its forward, a gradient into
  //! received_grad_), and waits for the receives.
  void issue(const detail::PlannedGroup& group) {
    if (group.empty()) return;
    const auto start = std::chrono::steady_clock::now();
    // The receives' buffers first: taking a slot may send, alone, what still reads it (acquire).
    group_into_.clear();
    for (const detail::PlannedMessage& m : group) {
      if (m.send) continue;
      if (m.direction == 1) {
        group_into_.push_back(received_grad_.data());
        continue;
      }
      const int chunk = m.to_stage / pipeline_.size();
      group_into_.push_back(hidden(acquire(m.micro_batch, chunk), chunk_plans_[static_cast<std::size_t>(chunk)], 0).data());
    }
    group_calls_.clear();
    group_done_.clear();
    const std::size_t n = static_cast<std::size_t>(stage_.hidden_elements(shape_));
    std::size_t received = 0;
    for (const detail::PlannedMessage& m : group) {
      const int tag = message_tag(m.direction, m.micro_batch, m.to_stage);
      if (!m.send) {
        group_calls_.push_back(pipeline_.recv_call(std::span<T>(group_into_[received++], n), m.peer, tag));
        group_done_.push_back(nullptr);
        continue;
      }
      const auto it = std::find_if(unissued_.begin(), unissued_.end(),
                                   [&](const UnissuedSend& u) { return u.call.peer == m.peer && u.call.tag == tag; });
      if (it == unissued_.end()) continue;  // it went out alone already (acquire)
      group_calls_.push_back(it->call);
      group_done_.push_back(it->done);
      unissued_.erase(it);
    }
    std::vector<Request> requests = pipeline_.start_group(group_calls_);
    for (std::size_t k = 0; k < requests.size(); ++k)
      if (group_done_[k] != nullptr)
        *group_done_[k] = std::move(requests[k]);  // waited for when its buffer is reused
      else
        requests[k].wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  //! Whether a send not yet issued reads `slot`'s output (the layers of a forward write there;
  //! its input-gradient send may wait: only its backward writes input_grad, after
  //! input_grad_sent).
  bool unissued_reads(const Slot& slot) const {
    return std::any_of(unissued_.begin(), unissued_.end(),
                       [&](const UnissuedSend& u) { return u.done == &slot.output_sent; });
  }
  //! Issues, alone, the send not yet issued that reads `slot`'s output.
  void issue_unissued_reading(Slot& slot) {
    const auto it = std::find_if(unissued_.begin(), unissued_.end(),
                                 [&](const UnissuedSend& u) { return u.done == &slot.output_sent; });
    slot.output_sent = pipeline_.start(it->call);
    unissued_.erase(it);
  }

  //! Takes the message this rank sent itself with `tag` (pp = 1, interleaved) into `data`.
  void take_local(Tensor<T> data, int tag) {
    for (auto it = mailbox_.begin(); it != mailbox_.end(); ++it)
      if (it->first == tag) {
        copy<T>(*backend_, Tensor<T>(data.data(), Shape{data.numel()}), Tensor<const T>(it->second.data(), Shape{data.numel()}));
        mailbox_pool_.release(std::move(it->second));
        mailbox_.erase(it);
        return;
      }
    throw Error("trainer: receive from this rank's own virtual stage", tag,
                "no message with this tag was sent (a schedule must run the sender first)");
  }

  backend_type* backend_;
  CommunicatorRef group_;
  CommunicatorRef tensor_parallel_;
  CommunicatorRef pipeline_;
  Stage stage_;
  ParameterLayout whole_layout_;
  O optimizer_;
  S schedule_;
  St strategy_;
  std::function<double(std::int64_t)> lr_;
  TrainerOptions options_;
  std::vector<std::vector<ElementRange>> layer_parameters_;
  Engine engine_;
  TensorState tensor_state_;
  std::int64_t step_ = 0;
  std::int64_t first_row_ = 0;  // this rank's first row of the global batch

  MicroBatchShape shape_{0, 0};
  std::int64_t planned_micro_batches_ = 0;
  std::vector<Action> actions_;
  std::vector<bool> completes_chunk_;
  std::vector<ChunkPlan> chunk_plans_;
  std::vector<Slot> slots_;
  std::int64_t slot_elements_ = 0;
  Buffer<T, backend_type> workspace_, hidden_grads_, received_grad_, tied_buffer_;
  Buffer<accumulate_t<T>, backend_type> wide_tied_buffer_;  // the same with fp32 gradients
  //! The recomputed layers' activations and discarded output (TrainerOptions::recompute_layers).
  Buffer<T, backend_type> recompute_saved_, recompute_output_;
  Buffer<std::int32_t, backend_type> batch_;  //!< the global batch in backend memory (device backends)
  std::vector<const T*> tied_parts_;    // and the holders' pieces it sums
  std::vector<const accumulate_t<T>*> wide_tied_parts_;
  detail::BufferPool<T, backend_type> mailbox_pool_;
  std::vector<std::pair<int, Buffer<T, backend_type>>> mailbox_;  // messages to this rank's own chunks
  //! Which sends and receives go out together before each action and after the last, for
  //! step() and for evaluate() (plan_messages). NCCL runs a rank's operations in issue order on
  //! one stream, so a send issued alone before a receive holds that receive up until the peer
  //! takes the send, while the peer may be waiting to send us what we receive (1F1B's steady
  //! state: one stage sends an activation as the next sends a gradient back). Issuing both as
  //! one group (as Megatron-LM batches isend/irecv) lets both proceed.
  std::vector<detail::PlannedGroup> plan_, evaluate_plan_;
  std::vector<Action> evaluate_actions_;
  //! Sends made by an action whose group has not been issued yet.
  struct UnissuedSend {
    CollectiveCall call;
    Request* done;  //!< the slot's output_sent or input_grad_sent
  };
  std::vector<UnissuedSend> unissued_;
  std::vector<CollectiveCall> group_calls_;  // issue's scratch
  std::vector<Request*> group_done_;
  std::vector<T*> group_into_;
  bool deferred_notification_ = false;
  double wait_seconds_ = 0;  // this step's time blocked on other stages
};

}  // namespace loom
