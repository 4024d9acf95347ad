#pragma once
//! \file Trainer: composes a Model, an Optimizer, a Schedule and a Strategy into a training step
//! on a global batch (DESIGN.md invariant 2: the loss is the mean over all target tokens of the
//! global batch, whatever the split into micro-batches).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
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
#include "loom/parallel/detail/pipeline_executor.hpp"
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
  //! With fp32_gradients, a model whose layers can add gradients to the fp32 sums directly
  //! (FusesFp32Gradients: GPT-2's and BERT's embeddings, linear layers and unembeddings) has them
  //! do so: the weight-gradient GEMMs accumulate into fp32 (Megatron-LM's
  //! gradient_accumulation_fusion), so those gradients are never rounded to bf16 and never drained. Off: every layer writes bf16
  //! and the strategy drains it (the comparison docs/mixed_precision.md makes).
  bool fp32_gradient_fusion = true;
  //! A step whose loss or gradient norm is not finite (NaN or infinite: a learning rate too
  //! high, a poisoned weight) throws loom::Error on every rank, naming the step and the value,
  //! and changes nothing: the parameters and the optimizer state stay those of the step before,
  //! so that no later save writes a broken model (Megatron-LM's check_for_nan_in_loss_and_grad,
  //! also on by default). Off: such an update is applied, NaN and all, as PyTorch applies it.
  bool stop_on_non_finite = true;

  friend bool operator==(const TrainerOptions&, const TrainerOptions&) = default;
  friend std::ostream& operator<<(std::ostream& out, const TrainerOptions& o) {
    out << "{micro_batch_size=" << o.micro_batch_size << ", clip_grad_norm=" << o.clip_grad_norm
        << ", seed=" << o.seed << ", recompute_layers=";
    if (o.recompute_layers == all_layers) out << "all";
    else out << o.recompute_layers;
    return out << ", fp32_gradients=" << o.fp32_gradients << ", fp32_gradient_fusion=" << o.fp32_gradient_fusion
               << ", stop_on_non_finite=" << o.stop_on_non_finite << "}";
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
  //! pipeline bubble. Host time: over NCCL, where the host does not wait for messages (they
  //! complete in stream order on the GPU), it is not the bubble (docs/cuda.md).
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
  using model_type = M;
  using backend_type = typename M::backend_type;
  using scalar_type = typename M::scalar_type;
  using optimizer_type = O;
  //! The layers (and parameters) this rank runs: all of them without pipeline stages.
  using Stage = PipelineStage<M>;
  using Engine = typename St::template Engine<backend_type, scalar_type>;
  static_assert(StrategyEngine<Engine, scalar_type>,
                "loom: the strategy's Engine does not offer the hooks the Trainer drives");
  static_assert(!pipelined_schedule<S> || supports_pipeline<St>,
                "loom: this strategy cannot run under a pipeline schedule: its type says so "
                "(supports_pipeline = false). Use one that can (SingleRank, DataParallel or Zero<1..3>), or "
                "GradientAccumulation without pipeline stages.");
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
    executor_.forget_unfinished_step();
    const std::int64_t micro_batches = executor_.plan(tokens, targets, lengths, detail::ScheduleView(schedule_));
    const std::int64_t target_tokens = detail::count_targets(targets);
    LOOM_CHECK(target_tokens > 0, "trainer step: target tokens", target_tokens,
               "a global batch needs at least one target >= 0");
    const Inputs batch = executor_.place_batch({tokens, targets, lengths});
    // In the accumulate type: 1 / tokens is no bf16 value.
    const auto loss_scale = static_cast<accumulate_t<scalar_type>>(1.0 / static_cast<double>(target_tokens));

    engine_.begin_step();
    detail::EngineLayersOf<Engine, T> layers(engine_);
    const double loss_sum = executor_.run_step(batch, loss_scale, step_, layers);
    engine_.finish_gradients();

    StepMetrics m;
    const double replica_loss = engine_.global_sum(loss_sum);
    // The first exchange with the other stages after the actions: a stage that finished early
    // waits here for the pipeline to drain, which is bubble too.
    const auto drain = std::chrono::steady_clock::now();
    m.loss = pipeline_sum(replica_loss) / static_cast<double>(target_tokens);
    m.pipeline_wait_seconds = executor_.wait_seconds();
    if (pipeline_.size() > 1)
      m.pipeline_wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - drain).count();
    m.grad_norm = std::sqrt(gradient_sum_of_squares());
    if (options_.stop_on_non_finite && !(std::isfinite(m.loss) && std::isfinite(m.grad_norm))) refuse_non_finite(m);
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
    m.flops = stage().flops_per_token(tokens.extent(1)) * static_cast<double>(m.tokens);
    return m;
  }

  //! Mean loss on a batch without changing anything (forward only; collective like step()).
  //! Throws where no target is >= 0. validation_loss (parallel/validation.hpp) takes many.
  template <class Batch>
  double evaluate(const Batch& global) {
    const Inputs given{global.tokens_view(), global.targets_view(), lengths_of(global)};
    executor_.forget_unfinished_step();
    executor_.plan(given.tokens, given.targets, given.lengths, detail::ScheduleView(schedule_));
    const std::int64_t target_tokens = detail::count_targets(given.targets);
    LOOM_CHECK(target_tokens > 0, "trainer evaluate: target tokens", target_tokens,
               "a batch needs at least one target >= 0 to have a mean loss");
    detail::EngineLayersOf<Engine, T> layers(engine_);
    const double loss_sum = executor_.run_evaluation(executor_.place_batch(given), layers);
    return pipeline_sum(engine_.global_sum(loss_sum)) / static_cast<double>(target_tokens);
  }

  //! The whole model (this rank's tensor-parallel shard of it).
  const M& model() const noexcept { return stage().model(); }
  //! The layers and parameters this rank runs (all of them without pipeline stages).
  const Stage& stage() const noexcept { return executor_.stage(); }
  //! Steps done.
  std::int64_t steps() const noexcept { return step_; }
  //! Every parameter of model().layout(), in its order, copied to host memory. Collective over
  //! the pipeline (each stage contributes its layers) and, when the strategy shards parameters
  //! (ZeRO-3), over the data-parallel group.
  std::vector<scalar_type> gather_parameters() {
    std::vector<scalar_type> mine(static_cast<std::size_t>(stage().layout().total()));
    engine_.copy_parameters_to(mine.data());
    std::vector<scalar_type> out(static_cast<std::size_t>(model().layout().total()), scalar_type(0));
    stage().scatter_owned(mine.data(), out.data());
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
    detail::check_state_array(array, O::state_slots);  // before the allocation, not after it
    std::vector<state_type> values(static_cast<std::size_t>(owned_state_elements()));
    copy_owned_state(array, values);
    return values;
  }
  //! As copy_owned_state(array), into `out`, which must hold owned_state_elements(): for a caller
  //! that keeps its buffer from one copy to the next (a fresh one costs its pages' first touch,
  //! several times the copy itself). Not collective.
  void copy_owned_state(int array, std::span<state_type> out) {
    detail::check_state_array(array, O::state_slots);
    const std::int64_t expected = owned_state_elements();
    LOOM_CHECK(static_cast<std::int64_t>(out.size()) == expected, "copy_owned_state: elements", out.size(),
               "must equal this rank's owned_state_elements() " + detail::to_text(expected));
    engine_.copy_owned_state_to(array, out.data());
  }
  //! How many elements of each training-state array this rank owns: the sum of
  //! owned_state_runs()' counts (0 on a data-parallel replica other than the first).
  std::int64_t owned_state_elements() const { return elements_of(engine_.owned_state_ranges()); }
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
    executor_.forget_unfinished_step();
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
      executor_.forget_unfinished_step();
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
  //! With TrainerOptions::fp32_gradients (bf16 models) they are in fp32_gradients() instead, and
  //! this is null where the model fuses every gradient (no bf16 gradient buffer exists).
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
  //! Whether this rank's layers write gradients of the parameters' type: false for a bf16 model
  //! whose layers all add their gradients to the fp32 sums themselves (TrainerOptions::
  //! fp32_gradient_fusion), for which the strategy keeps no bf16 gradient buffer.
  bool layers_write_gradients() const noexcept {
    return loom::layers_write_gradients<scalar_type>(options_.fp32_gradients, layer_drained_);
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
  std::int64_t activation_slots() const noexcept { return executor_.activation_slots(); }
  //! Elements of one activation slot (saved activations, hidden states, split-backward stash).
  std::int64_t activation_slot_elements() const noexcept { return executor_.activation_slot_elements(); }
  //! Layers of this rank that recompute their activations in the backward
  //! (TrainerOptions::recompute_layers), for the last step's shape.
  int recomputed_layers() const noexcept { return executor_.recomputed_layers(); }
  //! Elements of the buffers the recomputed layers share for their activations and their
  //! (discarded) output (0 without recomputation).
  std::int64_t recompute_elements() const noexcept { return executor_.recompute_elements(); }

 private:
  using T = scalar_type;
  using Inputs = detail::BatchInputs;

  template <LrSchedule L>
  Trainer(backend_type& backend, CommunicatorRef group, CommunicatorRef tensor_parallel, CommunicatorRef pipeline,
          M model, O optimizer, L lr, TrainerOptions options, St strategy, S schedule)
      : backend_(&backend),
        group_(group),
        tensor_parallel_(tensor_parallel),
        pipeline_(pipeline),
        executor_(backend, group, pipeline, make_stage(std::move(model), pipeline, schedule),
                  {.micro_batch_size = options.micro_batch_size,
                   .recompute_layers = options.recompute_layers,
                   .seed = options.seed,
                   .split_backward = splits_backward_schedule<S>,
                   .fp32_gradient_fusion = fuses_fp32_gradients(options)}),
        whole_layout_(loom::whole_layout(stage().model().layout())),
        optimizer_(std::move(optimizer)),
        schedule_((check_schedule(schedule, pipeline, chunks_per_rank(schedule)), std::move(schedule))),
        strategy_(std::move(strategy)),
        lr_([lr = std::move(lr)](std::int64_t step) { return static_cast<double>(lr.at(step)); }),
        options_(options),
        layer_parameters_(layer_parameters_of(stage())),
        layer_drained_(layer_drained_of(stage(), layer_parameters_, options)),
        engine_(strategy_, EngineContext<backend_type>{.backend = (validate(options), backend),
                                                       .data_parallel = group,
                                                       .layout = stage().layout(),
                                                       .state_slots = O::state_slots,
                                                       .seed = options.seed,
                                                       .layer_parameters = layer_parameters_,
                                                       .fp32_gradients = options.fp32_gradients,
                                                       .layer_drained = &layer_drained_,
                                                       .tied = tied_ranges_of(stage())}),
        tensor_state_(make_tensor_state(backend, stage().layout())) {}

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
      const auto mine = stage().layout().entries();
      const auto entries = whole_layout_.entries();
      for (std::size_t p = 0; p < mine.size(); ++p) {
        if (owned && mine[p].spec.tied_copy) continue;
        const auto w = static_cast<std::size_t>(&whole_layout_.find(mine[p].spec.name) - entries.data());
        runs.push_back({.local = tensor_state_.offset(p), .whole = whole[w], .count = whole[w + 1] - whole[w]});
      }
    }
    return runs;
  }

  //! Steps the optimizer over the ranges the strategy hands this rank (step_ + 1, from 1).
  void apply_optimizer(std::span<const detail::FlatRange<T>> ranges, double lr) {
    const ParameterLayout& layout = stage().layout();
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
      for (const auto& s : stage().segments()) {
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
    std::vector<U> mine(static_cast<std::size_t>(stage().layout().total()));
    stage().gather_from(values.data(), mine.data());
    engine_.load_parameters(mine.data());
  }

  //! The stage-layout ranges of the tied parameters (EngineContext::tied).
  static std::vector<ElementRange> tied_ranges_of(const Stage& stage) {
    std::vector<ElementRange> ranges;
    for (const TiedParameter& t : stage.tied()) ranges.push_back({t.offset, t.offset + t.numel});
    return ranges;
  }
  static std::vector<std::vector<ElementRange>> layer_parameters_of(const Stage& stage) {
    std::vector<std::vector<ElementRange>> out;
    for (int l = 0; l < stage.num_layers(); ++l) out.push_back(stage.layer_parameters(l));
    return out;
  }
  //! What fp32 gradients drain after each layer: what it reads, less what it adds to the fp32
  //! sums itself where the model fuses them (TrainerOptions::fp32_gradient_fusion).
  static std::vector<std::vector<ElementRange>> layer_drained_of(const Stage& stage,
                                                                 const std::vector<std::vector<ElementRange>>& reads,
                                                                 const TrainerOptions& options) {
    if constexpr (FusesFp32Gradients<M>) {
      if (fuses_fp32_gradients(options)) {
        std::vector<std::vector<ElementRange>> out;
        for (int l = 0; l < stage.num_layers(); ++l)
          out.push_back(subtract_ranges(reads[static_cast<std::size_t>(l)], stage.fp32_gradient_parameters(l)));
        return out;
      }
    }
    return reads;
  }
  //! Whether the layers add their fp32_gradient_parameters to the fp32 sums themselves: the one
  //! decision both the executor (which hands them the sums) and the drains (which skip those
  //! ranges) follow.
  static bool fuses_fp32_gradients(const TrainerOptions& o) noexcept {
    return FusesFp32Gradients<M> && is_narrow_storage<T> && o.fp32_gradients && o.fp32_gradient_fusion;
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

  //! Ends a step whose loss or gradient norm is not finite without applying it, and throws
  //! (TrainerOptions::stop_on_non_finite). Every rank of the mesh gets here in the same step:
  //! both values are sums over the whole mesh, and a NaN or an infinity survives a sum in any
  //! order, so no rank is left waiting in a collective.
  [[noreturn]] void refuse_non_finite(const StepMetrics& m) {
    // The strategy's update with nothing applied ends its step as any other (ZeRO gathers the
    // unchanged shards again), so that the next step() starts where it would have.
    engine_.update(1.0, [](std::span<const detail::FlatRange<T>>) {});
    backend_->synchronize();
    const bool loss = !std::isfinite(m.loss);
    throw Error("trainer step " + detail::to_text(step_ + 1) + ": " + (loss ? "loss" : "gradient norm"),
                loss ? m.loss : m.grad_norm,
                "must be finite (loss " + detail::to_text(m.loss) + ", gradient norm " + detail::to_text(m.grad_norm) +
                    "); the update was not applied: the parameters and optimizer state are those after step " +
                    detail::to_text(step_) +
                    ". A lower learning rate or clipping may help; TrainerOptions::stop_on_non_finite = false "
                    "applies such updates");
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

  //! `global.lengths_view()` where a batch type has one, else empty (no padding).
  template <class Batch>
  static Tensor<const std::int32_t> lengths_of(const Batch& global) {
    if constexpr (requires { global.lengths_view(); })
      return global.lengths_view();
    else
      return {};
  }

  backend_type* backend_;
  CommunicatorRef group_;
  CommunicatorRef tensor_parallel_;
  CommunicatorRef pipeline_;
  detail::PipelineExecutor<M> executor_;
  ParameterLayout whole_layout_;
  O optimizer_;
  S schedule_;
  St strategy_;
  std::function<double(std::int64_t)> lr_;
  TrainerOptions options_;
  std::vector<std::vector<ElementRange>> layer_parameters_;
  std::vector<std::vector<ElementRange>> layer_drained_;  // EngineContext::layer_drained
  Engine engine_;
  TensorState tensor_state_;
  std::int64_t step_ = 0;
};

}  // namespace loom