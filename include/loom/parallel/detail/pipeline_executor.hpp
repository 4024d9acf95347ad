#pragma once
//! \file PipelineExecutor: runs the schedule's actions of one training step (or an evaluation) on
//! this rank's stage: activation slots, the sends and receives between pipeline stages, tied
//! gradients, recomputation. It depends on the model alone; the Trainer drives it for every
//! optimizer, schedule and strategy, reaching the strategy's engine through EngineLayers (one
//! virtual call per layer and pass, nothing per element), so a program that builds many Trainer
//! compositions of one model compiles this once per model instead of once per composition.

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/models/concepts.hpp"
#include "loom/parallel/detail/buffer_pool.hpp"
#include "loom/parallel/detail/in_order_check.hpp"
#include "loom/parallel/pipeline_stage.hpp"
#include "loom/schedule/concepts.hpp"

namespace loom::detail {

//! The per-layer hooks of a strategy's engine (StrategyEngine) that the executor calls, erased.
template <class T>
class EngineLayers {
 public:
  virtual ParameterView<const T> forward_params(int layer) = 0;
  virtual void after_forward(int layer) = 0;
  virtual ParameterView<const T> backward_params(int layer) = 0;
  virtual ParameterView<T> backward_grads(int layer) = 0;
  virtual void on_backward(int layer, bool last_micro_batch) = 0;
  //! Adds `layer`'s gradients made so far into the fp32 sums, where the engine keeps them
  //! (TrainerOptions::fp32_gradients); nothing elsewhere.
  virtual void drain(int layer) = 0;
  //! Whether the engine keeps the gradients' sums in fp32 (fp32_grads_view has them).
  virtual bool fp32_gradients() const = 0;
  //! `layer`'s fp32 gradient sums; only where fp32_gradients().
  virtual ParameterView<accumulate_t<T>> fp32_grads_view(int layer) = 0;

 protected:
  ~EngineLayers() = default;
};

//! EngineLayers of an engine of type E (which must outlive it).
template <class E, class T>
class EngineLayersOf final : public EngineLayers<T> {
 public:
  explicit EngineLayersOf(E& engine) noexcept : engine_(&engine) {}
  ParameterView<const T> forward_params(int layer) override { return engine_->forward_params(layer); }
  void after_forward(int layer) override { engine_->after_forward(layer); }
  ParameterView<const T> backward_params(int layer) override { return engine_->backward_params(layer); }
  ParameterView<T> backward_grads(int layer) override { return engine_->backward_grads(layer); }
  void on_backward(int layer, bool last_micro_batch) override { engine_->on_backward(layer, last_micro_batch); }
  void drain(int layer) override {
    if constexpr (requires { engine_->drain(layer); }) engine_->drain(layer);
  }
  bool fp32_gradients() const override {
    if constexpr (requires { engine_->fp32_grads_view(0); })
      return engine_->fp32_gradients();
    else
      return false;
  }
  ParameterView<accumulate_t<T>> fp32_grads_view(int layer) override {
    if constexpr (requires { engine_->fp32_grads_view(layer); })
      return engine_->fp32_grads_view(layer);
    else
      throw Error("trainer: fp32 gradients of layer", layer, "this strategy's engine keeps none");
  }

 private:
  E* engine_;
};

//! A schedule's actions and live micro-batches for a shape, erased (the schedule must outlive it).
class ScheduleView {
 public:
  template <Schedule S>
  explicit ScheduleView(const S& schedule) noexcept
      : schedule_(&schedule),
        actions_([](const void* s, const ScheduleShape& shape) { return static_cast<const S*>(s)->actions(shape); }),
        live_([](const void* s, const ScheduleShape& shape) {
          return static_cast<std::int64_t>(static_cast<const S*>(s)->live_micro_batches(shape));
        }) {}
  std::vector<Action> actions(const ScheduleShape& shape) const { return actions_(schedule_, shape); }
  std::int64_t live_micro_batches(const ScheduleShape& shape) const { return live_(schedule_, shape); }

 private:
  const void* schedule_;
  std::vector<Action> (*actions_)(const void*, const ScheduleShape&);
  std::int64_t (*live_)(const void*, const ScheduleShape&);
};

//! A batch's inputs: [batch, seq] tokens and targets, and [batch] sequence lengths (empty: no
//! padding).
struct BatchInputs {
  Tensor<const std::int32_t> tokens, targets, lengths;
};

//! Checks `lengths` (host memory) against the batch: empty, or [batch] with each length in
//! [1, seq] and every target at or past its sequence's length ignored (< 0), so that padding
//! never reaches the loss.
inline void check_lengths(Tensor<const std::int32_t> targets, Tensor<const std::int32_t> lengths) {
  if (lengths.empty()) return;
  const std::int64_t rows = targets.extent(0), seq = targets.extent(1);
  LOOM_CHECK(lengths.shape() == Shape{rows}, "trainer step: lengths shape", lengths.shape(),
             "expected [batch] = [" + to_text(rows) + "] (or empty: no padding)");
  for (std::int64_t i = 0; i < rows; ++i) {
    const std::int32_t length = lengths.data()[i];
    LOOM_CHECK(length >= 1 && length <= seq, "trainer step: lengths[" + to_text(i) + "]", length,
               "must be in [1, seq = " + to_text(seq) + "]");
    for (std::int64_t t = length; t < seq; ++t)
      LOOM_CHECK(targets.data()[i * seq + t] < 0,
                 "trainer step: target of padded position [" + to_text(i) + ", " + to_text(t) + "]",
                 targets.data()[i * seq + t],
                 "must be < 0 (ignored): sequence " + to_text(i) + " is " + to_text(length) +
                     " tokens long");
  }
}

//! Targets >= 0 (those the loss counts).
inline std::int64_t count_targets(Tensor<const std::int32_t> targets) {
  std::int64_t n = 0;
  for (std::int32_t t : targets) n += t >= 0;
  return n;
}

//! Runs a step's (or an evaluation's) actions on this rank's stage of model M.
template <Model M>
class PipelineExecutor {
 public:
  using backend_type = typename M::backend_type;
  using T = typename M::scalar_type;
  using Stage = PipelineStage<M>;
  using Inputs = BatchInputs;

  //! What the executor takes of TrainerOptions, and whether the schedule splits each backward
  //! (splits_backward_schedule).
  struct Settings {
    std::int64_t micro_batch_size = 1;
    int recompute_layers = 0;
    std::uint64_t seed = 0;
    bool split_backward = false;
    //! Whether the layers add their fp32_gradient_parameters to the engine's fp32 sums themselves
    //! (the Trainer decides: a FusesFp32Gradients bf16 model under TrainerOptions::fp32_gradients
    //! with fp32_gradient_fusion; the engine drains the rest).
    bool fp32_gradient_fusion = false;
  };

  //! Runs `stage` on `backend` for the data-parallel rank of `data_parallel` and the pipeline
  //! stage of `pipeline`.
  PipelineExecutor(backend_type& backend, CommunicatorRef data_parallel, CommunicatorRef pipeline, Stage stage,
                   Settings settings)
      : backend_(&backend),
        group_(data_parallel),
        pipeline_(pipeline),
        stage_(std::move(stage)),
        settings_(settings),
        mailbox_pool_(backend, MemoryCategory::communication) {}

  const Stage& stage() const noexcept { return stage_; }

  //! The actions of one step, from the batch place_batch gave, with `engine`'s parameters and
  //! gradients: returns this rank's loss sum (scaled by `loss_scale`, the backward's factor).
  //! `step` is the steps done, which keys the dropout masks. Ends with the sends done, the tied
  //! gradients summed and the engine told of every layer's last backward.
  double run_step(const Inputs& batch, accumulate_t<T> loss_scale, std::int64_t step, EngineLayers<T>& engine) {
    engine_ = &engine;
    step_ = step;
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
    return loss_sum;
  }

  //! The forward passes of an evaluation (no dropout, no backward): this rank's loss sum.
  double run_evaluation(const Inputs& batch, EngineLayers<T>& engine) {
    engine_ = &engine;
    double loss_sum = 0;
    // Micro-batch by micro-batch through the chunks in order: every receive has its send ahead.
    for (std::size_t i = 0; i < evaluate_actions_.size(); ++i) {
      const Action& a = evaluate_actions_[i];
      issue(evaluate_plan_[i]);
      loss_sum += forward(a.micro_batch, a.chunk, micro(batch, a.micro_batch), {}, 0);
      release(find(a.micro_batch, a.chunk));
    }
    issue(evaluate_plan_.back());
    wait_for_sends();
    return loss_sum;
  }

  //! Of the last run_step, the time blocked on other stages.
  double wait_seconds() const noexcept { return wait_seconds_; }
  //! Micro-batch activation sets this rank holds at once (Trainer::activation_slots).
  std::int64_t activation_slots() const noexcept { return static_cast<std::int64_t>(slots_.size()); }
  //! Elements of one activation slot.
  std::int64_t activation_slot_elements() const noexcept { return slot_elements_; }
  //! Layers that recompute their activations in the backward, for the last step's shape.
  int recomputed_layers() const noexcept {
    int n = 0;
    for (const ChunkPlan& p : chunk_plans_)
      n += static_cast<int>(std::count(p.recomputed.begin(), p.recomputed.end(), true));
    return n;
  }
  //! Elements of the buffers the recomputed layers share.
  std::int64_t recompute_elements() const noexcept { return recompute_saved_.size() + recompute_output_.size(); }

  //! Checks the batch and (re)allocates activation storage for its shape, with `schedule`'s
  //! actions for it; returns the number of micro-batches.
  std::int64_t plan(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets,
                    Tensor<const std::int32_t> lengths, const ScheduleView& schedule) {
    LOOM_CHECK(tokens.shape().rank() == 2, "trainer step: tokens shape", tokens.shape(),
               "expected [batch, seq]");
    LOOM_CHECK(targets.shape() == tokens.shape(), "trainer step: targets shape", targets.shape(),
               "must equal the tokens' shape " + to_text(tokens.shape()));
    check_lengths(targets, lengths);
    const std::int64_t rows = tokens.extent(0), mbs = settings_.micro_batch_size;
    const std::int64_t ranks = group_.size();
    if (ranks == 1)
      LOOM_CHECK(rows % mbs == 0, "trainer step: global batch size", rows,
                 "must be a multiple of micro_batch_size (" + to_text(mbs) + ")");
    else
      LOOM_CHECK(rows % (mbs * ranks) == 0, "trainer step: global batch size", rows,
                 "must be a multiple of micro_batch_size (" + to_text(mbs) +
                     ") x data-parallel ranks (" + to_text(ranks) + ")");
    const std::int64_t micro_batches = rows / (mbs * ranks);
    first_row_ = group_.rank() * (rows / ranks);
    allocate({mbs, tokens.extent(1)}, micro_batches, schedule);
    return micro_batches;
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

  //! Only a step that threw leaves sends not issued (into its slots) or slots held.
  void forget_unfinished_step() {
    unissued_.clear();
    for (Slot& s : slots_) release(s);
  }

 private:
  //! Plans which sends and receives go out together, for run_step and for run_evaluation: the first
  //! grouping (MessageGrouping) under which every rank's groups complete when
  //! point-to-point runs in issue order (NCCL: no tags, one stream; in_order_deadlock).
  //! Every rank's actions follow from the schedule and the shape, so this rank models all of
  //! them, and all ranks choose alike. Over such a communicator a schedule that no grouping
  //! completes is refused here, before anything is sent; a communicator with tags runs any.
  void plan_messages(const ScheduleShape& mine, const ScheduleView& schedule) {
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
      throw Error("trainer: pipeline " + std::string(what) + " on " + to_text(mine) +
                      " over a communicator that runs point-to-point in issue order (NCCL)",
                  "would deadlock", why + "; use a communicator with tags (threads, MPI, or one staged through host memory)");
    };
    std::vector<std::vector<Action>> every_stage;
    for (int s = 0; s < mine.stages; ++s) {
      ScheduleShape theirs = mine;
      theirs.stage = s;
      every_stage.push_back(s == mine.stage ? actions_ : schedule.actions(theirs));
    }
    const GroupingChoice step = choose_grouping(every_stage, mine);
    if (!step.safe && in_order) refuse("schedule", step.why_not);
    plan_ = message_plan(actions_, mine, step.safe.value_or(MessageGrouping::per_action));
    const GroupingChoice evaluation = choose_grouping(
        std::vector<std::vector<Action>>(static_cast<std::size_t>(mine.stages), evaluate_actions_), mine);
    if (!evaluation.safe && in_order) refuse("evaluation", evaluation.why_not);
    evaluate_plan_ =
        message_plan(evaluate_actions_, mine, evaluation.safe.value_or(MessageGrouping::per_action));
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
  void allocate(MicroBatchShape shape, std::int64_t micro_batches, const ScheduleView& schedule) {
    const int chunks = stage_.chunks();
    const ScheduleShape schedule_shape{.stages = pipeline_.size(), .stage = pipeline_.rank(),
                                       .micro_batches = micro_batches, .virtual_stages = chunks};
    if (micro_batches != planned_micro_batches_) {
      actions_ = schedule.actions(schedule_shape);  // generated once per micro-batch count
      // Each chunk's last backward (or weight-gradient pass) completes its gradients.
      completes_chunk_.assign(actions_.size(), false);
      std::vector<bool> seen(static_cast<std::size_t>(chunks), false);
      for (std::size_t i = actions_.size(); i-- > 0;) {
        const Action& a = actions_[i];
        LOOM_CHECK(a.chunk >= 0 && a.chunk < chunks, "trainer: schedule action", a,
                   "names a chunk this rank does not have (" + to_text(chunks) + " chunks)");
        const bool finishing = a.kind == Action::Kind::backward || a.kind == Action::Kind::backward_weight;
        if (finishing && !seen[static_cast<std::size_t>(a.chunk)]) {
          completes_chunk_[i] = true;
          seen[static_cast<std::size_t>(a.chunk)] = true;
        }
      }
      plan_messages(schedule_shape, schedule);
      planned_micro_batches_ = micro_batches;
    }
    const std::int64_t slots = schedule.live_micro_batches(schedule_shape);
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
      int recompute_left = settings_.recompute_layers;
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
        p.stash_offset[j + 1] = p.stash_offset[j];
        if constexpr (SplitBackwardModel<M>)
          if (settings_.split_backward) p.stash_offset[j + 1] += stage_.stash_elements(p.first + j, shape);
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

  //! Micro-batch `mb` of this rank's slice of the global batch: rows [first_row + mb·size,
  //! first_row + (mb+1)·size).
  Inputs micro(const Inputs& global, std::int64_t mb) const {
    const std::int64_t rows = settings_.micro_batch_size, seq = global.tokens.extent(1);
    const std::int64_t first = first_row_ + mb * rows;
    const auto slice = [&](Tensor<const std::int32_t> t) {
      return Tensor<const std::int32_t>(t.data() + first * seq, Shape{rows, seq});
    };
    return {slice(global.tokens), slice(global.targets),
            global.lengths.empty() ? Tensor<const std::int32_t>{}
                                   : Tensor<const std::int32_t>(global.lengths.data() + first, Shape{rows})};
  }

  //! One micro-batch's activations of one chunk, from its forward to its (last) backward pass.
  struct Slot {
    Buffer<T, backend_type> saved, hidden, stash, input_grad;
    Request output_sent, input_grad_sent;  //!< sends reading `hidden`'s output and `input_grad`
    std::int64_t micro_batch = -1;
    int chunk = -1;
  };

  //! A free slot for the forward of (mb, chunk), once the send of its last output is done. A
  //! slot whose output a send not yet issued still reads (run_evaluation frees each slot at once) is
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
    throw Error("trainer: activation slots for forward F" + to_text(mb) + "." + to_text(chunk),
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
    throw Error("trainer: backward of micro-batch " + to_text(mb) + ", chunk " + to_text(chunk),
                "no forward", "a schedule must run a micro-batch's forward before its backward");
  }
  static void release(Slot& s) { s.micro_batch = -1; }

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
    return {.seed = settings_.seed, .step = step_, .first_sequence = first_row_ + mb * settings_.micro_batch_size};
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
      loss_sum += stage_.forward(*backend_, l, engine_->forward_params(l), a);
      engine_->after_forward(l);
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
      const ParameterView<const T> params = engine_->backward_params(l);
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
      const ParameterView<T> grads = engine_->backward_grads(l);
      a.fp32_grads = fused_grads(l);
      if (action.kind == Action::Kind::backward) {
        stage_.backward(*backend_, l, params, grads, a);
        notify(l, completes);
      } else {
        if constexpr (SplitBackwardModel<M>) {
          stage_.backward_input(*backend_, l, params, grads, a, range(slot.stash, p.stash_offset, j));
          // Parameter gradients the input pass makes go into the fp32 sums now, not after other
          // micro-batches' input passes have added theirs to them in bf16.
          engine_->drain(l);
        } else {
          throw Error("trainer: schedule action", to_text(action),
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

  //! The fp32 sums `layer`'s backward adds its fp32_gradient_parameters to (after
  //! backward_grads(layer), which opens them under ZeRO-2 and 3), or an empty view: the layer
  //! then writes every gradient in T.
  ParameterView<accumulate_t<T>> fused_grads(int layer) {
    if (settings_.fp32_gradient_fusion) return engine_->fp32_grads_view(layer);
    return {};
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
        const ParameterView<const T> params = engine_->backward_params(l);
        const ParameterView<T> grads = engine_->backward_grads(l);
        a.fp32_grads = fused_grads(l);
        stage_.backward_weight(*backend_, l, params, grads, a, range(slot.stash, p.stash_offset, j));
        notify(l, completes);
      }
      release(slot);
    } else {
      (void)inputs, (void)loss_scale, (void)completes;
      throw Error("trainer: schedule action", to_text(action),
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
    engine_->on_backward(layer, completes);
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
    if (deferred_notification_) engine_->on_backward(0, true);
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
    if constexpr (is_narrow_storage<T>) {  // float gradients are fp32 already
      if (engine_->fp32_gradients()) {
        engine_->drain(0);
        const ParameterView<accumulate_t<T>> sums = engine_->fp32_grads_view(0);
        return exchange_tied_gradients([&](std::int64_t offset, std::int64_t n) { return sums.at(offset, n); },
                                       wide_tied_buffer_, wide_tied_parts_);
      }
    }
    const auto at = [&](std::int64_t offset, std::int64_t n) { return engine_->backward_grads(0).at(offset, n); };
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
        // a send holds up the rank's later messages until it is received (NCCL's stream order;
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
  void issue(const PlannedGroup& group) {
    if (group.empty()) return;
    const auto start = std::chrono::steady_clock::now();
    // The receives' buffers first: taking a slot may send, alone, what still reads it (acquire).
    group_into_.clear();
    for (const PlannedMessage& m : group) {
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
    for (const PlannedMessage& m : group) {
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
  CommunicatorRef group_;     // data-parallel: which rows of the global batch this rank trains on
  CommunicatorRef pipeline_;
  Stage stage_;
  Settings settings_;
  EngineLayers<T>* engine_ = nullptr;  // the current run's
  std::int64_t step_ = 0;              // the current step's steps done (dropout keys)
  std::int64_t first_row_ = 0;         // this rank's first row of the global batch

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
  BufferPool<T, backend_type> mailbox_pool_;
  std::vector<std::pair<int, Buffer<T, backend_type>>> mailbox_;  // messages to this rank's own chunks
  //! Which sends and receives go out together before each action and after the last, for
  //! run_step and for run_evaluation (plan_messages). NCCL runs a rank's operations in issue order on
  //! one stream, so a send issued alone before a receive holds that receive up until the peer
  //! takes the send, while the peer may be waiting to send us what we receive (1F1B's steady
  //! state: one stage sends an activation as the next sends a gradient back). Issuing both as
  //! one group (as Megatron-LM batches isend/irecv) lets both proceed.
  std::vector<PlannedGroup> plan_, evaluate_plan_;
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

}  // namespace loom::detail
