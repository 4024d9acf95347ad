#pragma once
//! \file Trainer: composes a Model, an Optimizer, a Schedule and a Strategy into a training step
//! on a global batch (DESIGN.md invariant 2: the loss is the mean over all target tokens of the
//! global batch, whatever the split into micro-batches).

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <ostream>
#include <utility>
#include <vector>

#include "loom/comm/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/models/concepts.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/optim/lr_schedule.hpp"
#include "loom/parallel/concepts.hpp"
#include "loom/parallel/mesh.hpp"
#include "loom/parallel/single_rank.hpp"
#include "loom/schedule/concepts.hpp"
#include "loom/schedule/gradient_accumulation.hpp"

namespace loom {

//! Run-time settings of a Trainer (structure is in its template arguments).
struct TrainerOptions {
  std::int64_t micro_batch_size = 1;  //!< sequences per micro-batch on each rank
  double clip_grad_norm = 0.0;        //!< clip the global gradient norm to this; 0 = off
  std::uint64_t seed = 1337;          //!< keys every parameter's initial values

  friend bool operator==(const TrainerOptions&, const TrainerOptions&) = default;
  friend std::ostream& operator<<(std::ostream& out, const TrainerOptions& o) {
    return out << "{micro_batch_size=" << o.micro_batch_size
               << ", clip_grad_norm=" << o.clip_grad_norm << ", seed=" << o.seed << "}";
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
};

//! Trains `M` with optimizer `O`, micro-batch order `S` and state strategy `St`.
//! A step takes the global batch (every rank sees the same one) and returns its metrics.
template <Model M, Optimizer O, Schedule S = GradientAccumulation, Strategy St = SingleRank>
class Trainer {
 public:
  using backend_type = typename M::backend_type;
  using scalar_type = typename M::scalar_type;
  using Engine = typename St::template Engine<backend_type, scalar_type>;
  static_assert(StrategyEngine<Engine, scalar_type>,
                "loom: the strategy's Engine does not offer the hooks the Trainer drives");

  //! One rank, no communicator. `lr` is any LrSchedule (ConstantLr, WarmupCosineLr, or a type
  //! of yours with `at(step)`); `strategy` carries the strategy's settings.
  template <LrSchedule L>
  Trainer(backend_type& backend, M model, O optimizer, L lr, TrainerOptions options = {},
          St strategy = {}, S schedule = {})
      : Trainer(backend, CommunicatorRef{}, CommunicatorRef{}, std::move(model), std::move(optimizer), std::move(lr),
                options, std::move(strategy), std::move(schedule)) {}

  //! Data-parallel training over `group` (which must outlive the Trainer): every rank passes the
  //! same global batch to step() and trains on its contiguous slice of it (DESIGN.md
  //! invariant 2); the strategy reduces the gradients over the group.
  template <Communicator C, LrSchedule L>
  Trainer(backend_type& backend, C& group, M model, O optimizer, L lr, TrainerOptions options = {},
          St strategy = {}, S schedule = {})
      : Trainer(backend, CommunicatorRef(group), CommunicatorRef{}, std::move(model), std::move(optimizer),
                std::move(lr), options, std::move(strategy), std::move(schedule)) {}

  //! Training on a DP × TP mesh (which must outlive the Trainer): `model` is this rank's
  //! tensor-parallel shard, built over `mesh.tensor_parallel()`; the strategy works over
  //! `mesh.data_parallel()`. Every rank passes the same global batch; the ranks of a TP group
  //! train on the same slice. Pipeline stages (pp > 1) are rejected: this Trainer runs one stage.
  template <Communicator C, LrSchedule L>
  Trainer(backend_type& backend, Mesh<C>& mesh, M model, O optimizer, L lr, TrainerOptions options = {},
          St strategy = {}, S schedule = {})
      : Trainer(backend, CommunicatorRef(mesh.data_parallel()), CommunicatorRef(mesh.tensor_parallel()),
                std::move(model), std::move(optimizer), std::move(lr), options, std::move(strategy),
                std::move(schedule)) {
    // Before any step (the engines' constructors communicate nothing, so no rank waits here).
    check_mesh(mesh, model_);
  }

  //! One optimizer step on `global`, anything with `tokens_view()` and `targets_view()`
  //! returning [batch, seq] int32 tensors (io::Batch).
  template <class Batch>
  StepMetrics step(const Batch& global) {
    return step(global.tokens_view(), global.targets_view());
  }

  //! One optimizer step on the global batch given as [batch, seq] tokens and targets.
  StepMetrics step(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets) {
    const auto start = std::chrono::steady_clock::now();
    const std::int64_t micro_batches = plan(tokens, targets);
    const std::int64_t target_tokens = count_targets(targets);
    LOOM_CHECK(target_tokens > 0, "trainer step: target tokens", target_tokens,
               "a global batch needs at least one target >= 0");
    const auto loss_scale = static_cast<scalar_type>(1.0 / static_cast<double>(target_tokens));

    engine_.begin_step();
    double loss_sum = 0;
    for (const Action& a : actions_) {
      const std::int64_t slot = a.micro_batch % slots_;
      if (a.kind == Action::Kind::forward)
        loss_sum += forward(slot, micro(tokens, a.micro_batch), micro(targets, a.micro_batch));
      else
        backward(slot, micro(tokens, a.micro_batch), micro(targets, a.micro_batch), loss_scale,
                 a.micro_batch + 1 == micro_batches);
    }
    engine_.finish_gradients();

    StepMetrics m;
    m.loss = engine_.global_sum(loss_sum) / static_cast<double>(target_tokens);
    m.grad_norm = std::sqrt(gradient_sum_of_squares());
    double grad_scale = 1.0;
    if (options_.clip_grad_norm > 0 && m.grad_norm > options_.clip_grad_norm)
      grad_scale = options_.clip_grad_norm / (m.grad_norm + 1e-6);
    m.lr = lr_(step_);
    engine_.update(optimizer_, m.lr, step_ + 1, grad_scale);
    backend_->synchronize();
    ++step_;

    m.step = step_;
    m.tokens = tokens.numel();
    m.micro_batches = micro_batches;
    m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    m.tokens_per_second = static_cast<double>(m.tokens) / m.seconds;
    m.flops = model_.flops_per_token(tokens.extent(1)) * static_cast<double>(m.tokens);
    return m;
  }

  //! Mean loss on a batch without changing anything (forward only).
  template <class Batch>
  double evaluate(const Batch& global) {
    Tensor<const std::int32_t> tokens = global.tokens_view(), targets = global.targets_view();
    const std::int64_t micro_batches = plan(tokens, targets);
    double loss_sum = 0;
    for (std::int64_t mb = 0; mb < micro_batches; ++mb)
      loss_sum += forward(0, micro(tokens, mb), micro(targets, mb));
    return engine_.global_sum(loss_sum) / static_cast<double>(count_targets(targets));
  }

  const M& model() const noexcept { return model_; }
  //! Steps done.
  std::int64_t steps() const noexcept { return step_; }
  //! Every parameter, in layout order (model().layout()), copied to host memory. Collective
  //! over the data-parallel group when the strategy shards parameters (ZeRO-3).
  std::vector<scalar_type> gather_parameters() {
    std::vector<scalar_type> out(static_cast<std::size_t>(model_.layout().total()));
    engine_.copy_parameters_to(out.data());
    return out;
  }
  //! Replaces every parameter with `values` (layout order, host memory), e.g. from a checkpoint;
  //! every rank passes the same values.
  void load_parameters(std::span<const scalar_type> values) {
    LOOM_CHECK(static_cast<std::int64_t>(values.size()) == model_.layout().total(), "load_parameters: elements",
               values.size(), "must equal the layout's " + detail::to_text(model_.layout().total()));
    engine_.load_parameters(values.data());
  }
  //! The flat parameters in place (layout order), for strategies that hold them whole on every
  //! rank (SingleRank, DataParallel).
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
  const scalar_type* gradients() noexcept
    requires requires(Engine& e) { e.grads(); }
  {
    return engine_.grads();
  }
  const MemoryTracker& memory() const noexcept { return backend_->memory(); }
  const TrainerOptions& options() const noexcept { return options_; }
  //! The strategy's settings.
  const St& strategy() const noexcept { return strategy_; }
  //! The strategy's engine (its buffers, and e.g. DataParallel's buckets).
  const Engine& engine() const noexcept { return engine_; }
  //! This rank's place in the tensor-parallel group (size 1 without tensor parallelism).
  int tensor_parallel_rank() const { return tensor_parallel_.rank(); }
  int tensor_parallel_size() const { return tensor_parallel_.size(); }
  //! This rank's place in the data-parallel group.
  int data_parallel_rank() const { return group_.rank(); }
  int data_parallel_size() const { return group_.size(); }

 private:
  using T = scalar_type;

  template <LrSchedule L>
  Trainer(backend_type& backend, CommunicatorRef group, CommunicatorRef tensor_parallel, M model, O optimizer,
          L lr, TrainerOptions options, St strategy, S schedule)
      : backend_(&backend),
        group_(group),
        tensor_parallel_(tensor_parallel),
        model_(std::move(model)),
        optimizer_(std::move(optimizer)),
        schedule_(std::move(schedule)),
        strategy_(std::move(strategy)),
        lr_([lr = std::move(lr)](std::int64_t step) { return static_cast<double>(lr.at(step)); }),
        options_(options),
        layer_parameters_(layer_parameters_of(model_)),
        engine_(strategy_, EngineContext<backend_type>{.backend = (validate(options), backend),
                                                       .data_parallel = group,
                                                       .layout = model_.layout(),
                                                       .state_slots = O::state_slots,
                                                       .seed = options.seed,
                                                       .layer_parameters = layer_parameters_}) {}

  static std::vector<std::vector<ElementRange>> layer_parameters_of(const M& model) {
    std::vector<std::vector<ElementRange>> out;
    for (int l = 0; l < model.num_layers(); ++l) out.push_back(model.layer_parameters(l));
    return out;
  }

  //! The model must be split over the mesh's tensor-parallel group, and there is one stage.
  template <class C>
  static void check_mesh(Mesh<C>& mesh, const M& model) {
    LOOM_CHECK(mesh.shape().pp == 1, "trainer: mesh pipeline stages", mesh.shape().pp,
               "this Trainer runs one pipeline stage (pp = 1); pipeline stages need the pipeline executor");
    if constexpr (requires { model.tensor_parallel_size(); })
      LOOM_CHECK(model.tensor_parallel_size() == mesh.shape().tp, "trainer: the model's tensor-parallel ranks",
                 model.tensor_parallel_size(),
                 "must equal the mesh's tp (" + detail::to_text(mesh.shape().tp) +
                     "): build the model over mesh.tensor_parallel()");
  }

  //! The squared global gradient norm: each data-parallel group's strategy counts its elements
  //! once; over tensor parallelism the split parameters add up across the group and the
  //! replicated ones (identical on every TP rank) count once, from TP rank 0.
  double gradient_sum_of_squares() {
    if (tensor_parallel_.size() == 1) return engine_.grad_sum_of_squares(true);
    double sum = engine_.grad_sum_of_squares(tensor_parallel_.rank() == 0);
    tensor_parallel_.all_reduce(std::span<double>(&sum, 1), ReduceOp::sum);
    return sum;
  }

  static void validate(const TrainerOptions& o) {
    LOOM_CHECK(o.micro_batch_size >= 1, "trainer options: micro_batch_size", o.micro_batch_size,
               "must be >= 1");
    LOOM_CHECK(o.clip_grad_norm >= 0, "trainer options: clip_grad_norm", o.clip_grad_norm,
               "must be >= 0 (0 disables clipping)");
  }

  //! Checks the batch and (re)allocates activation storage for its shape; returns the number
  //! of micro-batches.
  std::int64_t plan(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets) {
    LOOM_CHECK(tokens.shape().rank() == 2, "trainer step: tokens shape", tokens.shape(),
               "expected [batch, seq]");
    LOOM_CHECK(targets.shape() == tokens.shape(), "trainer step: targets shape", targets.shape(),
               "must equal the tokens' shape " + detail::to_text(tokens.shape()));
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

  //! The schedule's actions and activation slots for `shape` (the schedule says how many
  //! micro-batches live at once); nothing is allocated when the shape repeats.
  void allocate(MicroBatchShape shape, std::int64_t micro_batches) {
    const ScheduleShape schedule_shape{.stages = 1, .stage = 0, .micro_batches = micro_batches};
    if (micro_batches != planned_micro_batches_) {
      actions_ = schedule_.actions(schedule_shape);  // generated once per micro-batch count
      // This Trainer executes whole forwards and backwards of one stage; split backwards
      // (ZB-H1) and virtual-stage chunks (interleaved) need the pipeline executor.
      for (const Action& a : actions_)
        LOOM_CHECK((a.kind == Action::Kind::forward || a.kind == Action::Kind::backward) && a.chunk == 0,
                   "trainer: schedule action", a,
                   "this Trainer runs one pipeline stage with whole forward and backward actions; a schedule "
                   "that splits the backward or uses virtual stages needs pipeline stages");
      planned_micro_batches_ = micro_batches;
    }
    const std::int64_t slots = schedule_.live_micro_batches(schedule_shape);
    if (shape == shape_ && slots == slots_) return;
    shape_ = shape;
    slots_ = slots;
    const int layers = model_.num_layers();
    saved_offset_.assign(layers + 1, 0);
    std::int64_t workspace = 0;
    for (int l = 0; l < layers; ++l) {
      saved_offset_[l + 1] = saved_offset_[l] + model_.activation_elements(l, shape);
      workspace = std::max(workspace, model_.workspace_elements(l, shape));
    }
    const std::int64_t hidden = model_.hidden_elements(shape);
    saved_.clear();
    hidden_.clear();
    for (std::int64_t s = 0; s < slots_; ++s) {
      saved_.emplace_back(*backend_, saved_offset_[layers], MemoryCategory::activations);
      hidden_.emplace_back(*backend_, hidden * (layers - 1), MemoryCategory::activations);
    }
    workspace_ = Buffer<T, backend_type>(*backend_, workspace, MemoryCategory::workspace);
    hidden_grads_ = Buffer<T, backend_type>(*backend_, 2 * hidden, MemoryCategory::workspace);
  }

  //! Micro-batch `mb` of this rank's slice of a [batch, seq] global tensor: rows
  //! [first_row + mb·size, first_row + (mb+1)·size).
  Tensor<const std::int32_t> micro(Tensor<const std::int32_t> t, std::int64_t mb) const {
    const std::int64_t rows = options_.micro_batch_size, seq = t.extent(1);
    return {t.data() + (first_row_ + mb * rows) * seq, Shape{rows, seq}};
  }

  static std::int64_t count_targets(Tensor<const std::int32_t> targets) {
    std::int64_t n = 0;
    for (std::int32_t t : targets) n += t >= 0;
    return n;
  }

  Tensor<T> hidden(std::int64_t slot, int layer) const {
    const std::int64_t n = model_.hidden_elements(shape_);
    return {hidden_[slot].data() + layer * n, Shape{shape_.batch, shape_.seq, n / (shape_.batch * shape_.seq)}};
  }
  Tensor<T> saved(std::int64_t slot, int layer) const {
    return {saved_[slot].data() + saved_offset_[layer],
            Shape{saved_offset_[layer + 1] - saved_offset_[layer]}};
  }

  double forward(std::int64_t slot, Tensor<const std::int32_t> tokens,
                 Tensor<const std::int32_t> targets) {
    const int layers = model_.num_layers();
    double loss_sum = 0;
    for (int l = 0; l < layers; ++l) {
      ForwardArgs<T> a{.tokens = tokens,
                       .targets = targets,
                       .input = l > 0 ? Tensor<const T>(hidden(slot, l - 1)) : Tensor<const T>{},
                       .output = l + 1 < layers ? hidden(slot, l) : Tensor<T>{},
                       .saved = saved(slot, l)};
      loss_sum += model_.forward(*backend_, l, engine_.forward_params(l), a);
      engine_.after_forward(l);
    }
    return loss_sum;
  }

  void backward(std::int64_t slot, Tensor<const std::int32_t> tokens,
                Tensor<const std::int32_t> targets, T loss_scale, bool last_micro_batch) {
    const int layers = model_.num_layers();
    const std::int64_t n = model_.hidden_elements(shape_);
    const Shape hidden_shape{shape_.batch, shape_.seq, n / (shape_.batch * shape_.seq)};
    int current = 0;  // which half of hidden_grads_ holds d loss / d output of layer l
    for (int l = layers - 1; l >= 0; --l) {
      Tensor<T> input_grad{};
      if (l > 0) {
        input_grad = Tensor<T>(hidden_grads_.data() + (1 - current) * n, hidden_shape);
        backend_->fill_zero(input_grad.data(), sizeof(T) * n);
      }
      BackwardArgs<T> a{
          .tokens = tokens,
          .targets = targets,
          .input = l > 0 ? Tensor<const T>(hidden(slot, l - 1)) : Tensor<const T>{},
          .output_grad = l + 1 < layers ? Tensor<const T>(hidden_grads_.data() + current * n, hidden_shape)
                                        : Tensor<const T>{},
          .input_grad = input_grad,
          .saved = saved(slot, l),
          .workspace = Tensor<T>(workspace_.data(), Shape{model_.workspace_elements(l, shape_)}),
          .loss_scale = loss_scale};
      model_.backward(*backend_, l, engine_.backward_params(l), engine_.backward_grads(l), a);
      engine_.on_backward(l, last_micro_batch);
      current = 1 - current;
    }
  }

  backend_type* backend_;
  CommunicatorRef group_;
  CommunicatorRef tensor_parallel_;
  M model_;
  O optimizer_;
  S schedule_;
  St strategy_;
  std::function<double(std::int64_t)> lr_;
  TrainerOptions options_;
  std::vector<std::vector<ElementRange>> layer_parameters_;
  Engine engine_;
  std::int64_t step_ = 0;
  std::int64_t first_row_ = 0;  // this rank's first row of the global batch

  MicroBatchShape shape_{0, 0};
  std::int64_t slots_ = 0;
  std::int64_t planned_micro_batches_ = 0;
  std::vector<Action> actions_;
  std::vector<std::int64_t> saved_offset_;
  std::vector<Buffer<T, backend_type>> saved_, hidden_;
  Buffer<T, backend_type> workspace_, hidden_grads_;
};

}  // namespace loom
