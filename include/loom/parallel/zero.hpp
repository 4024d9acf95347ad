#pragma once
//! \file Zero<1>, Zero<2>, Zero<3>: sharded data parallelism (ZeRO; FSDP's SHARD_GRAD_OP and
//! FULL_SHARD). The flat buffers are split over the data-parallel ranks by a ShardPlan:
//!
//!   stage  parameters                          gradients                        optimizer state
//!   1      full on every rank                  full; reduce-scattered at the end  own shard
//!   2      full on every rank                  own shard (per-unit buffers while  own shard
//!                                              backward fills them)
//!   3      own shard; gathered per layer just  own shard (as stage 2)             own shard
//!          in time (with prefetch), freed after
//!
//! A stage is a pair of holding policies (FullParameters or ShardedParameters, FullGradients or
//! ShardedGradients) under one engine: the stage number picks the pair in one place.
//!
//! With `replicas` R > 1 (hybrid sharding: FSDP's HYBRID_SHARD, torchtitan's replicate × shard
//! degrees, DeepSpeed's MiCS) the D data-parallel ranks form R groups of D/R adjacent ranks. Each
//! group shards the model as above among its own ranks; in the last micro-batch's backward the
//! ranks holding the same shard in the R groups all-reduce its gradient, unit by unit. Gathers
//! and reduce-scatters stay inside a group (a node, say) and only 1/(D/R) of the gradient
//! crosses between groups.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/comm/any.hpp"
#include "loom/comm/ref.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/parallel/concepts.hpp"
#include "loom/parallel/data_parallel.hpp"
#include "loom/parallel/detail/buffer_pool.hpp"
#include "loom/parallel/detail/flat_update.hpp"
#include "loom/parallel/shard_plan.hpp"

namespace loom {

namespace detail {

//! The data-parallel group of a Zero engine split for hybrid sharding: `replicas` groups of
//! adjacent ranks that each hold one sharded copy of the model (shard()), and across them the
//! ranks that hold the same shard (replica()). With one replica nothing is split: shard() is the
//! whole group and replica() the group of one rank.
class ShardGroups {
 public:
  ShardGroups(CommunicatorRef data_parallel, int replicas, const char* who)
      : all_(data_parallel), replicas_(checked(data_parallel.size(), replicas, who)) {
    if (replicas_ == 1) return;
    const int shard_size = all_.size() / replicas_, rank = all_.rank();
    // Collective over the group; every rank checked the same sizes above, so all get here.
    shard_ = all_.split(rank / shard_size, rank);
    replica_ = all_.split(rank % shard_size, rank);
  }
  ShardGroups(const ShardGroups&) = delete;
  ShardGroups& operator=(const ShardGroups&) = delete;

  //! Every data-parallel rank (the loss is summed over them).
  CommunicatorRef all() const noexcept { return all_; }
  //! The ranks that share one copy of the model, each holding a shard of it.
  CommunicatorRef shard() noexcept { return replicas_ == 1 ? all_ : CommunicatorRef(shard_); }
  //! The ranks, one in each copy, that hold the same shard.
  CommunicatorRef replica() noexcept { return replicas_ == 1 ? CommunicatorRef{} : CommunicatorRef(replica_); }
  int replicas() const noexcept { return replicas_; }

 private:
  static int checked(int ranks, int replicas, const char* who) {
    LOOM_CHECK(replicas >= 1 && ranks % replicas == 0, std::string(who) + ": replicas", replicas,
               "must divide the data-parallel ranks (" + std::to_string(ranks) +
                   "): each replica shards the model over ranks / replicas of them");
    return replicas;
  }
  CommunicatorRef all_;
  int replicas_;
  AnyCommunicator shard_, replica_;  // split only with more than one replica
};

//! What the holding policies share: the plan, the group, the backend, which units each layer
//! reads, and the layer count.
template <class B>
struct ShardContext {
  B* backend;
  CommunicatorRef group;
  const ShardPlan* plan;
  std::vector<std::vector<int>> layer_units;  //!< units each layer reads (ShardPlan::units_of)
  //! Layout ranges each layer's drain covers (EngineContext::drained(): what it reads, less what
  //! it adds to fp32 sums itself).
  std::vector<std::vector<ElementRange>> layer_ranges;
  //! Whether the layers write gradients of the parameters' type (EngineContext::
  //! layers_write_gradients): else the gradient holders keep only fp32 sums.
  bool narrow_grads = true;
  //! Per unit, whether it holds part of a tied parameter (EngineContext::tied), whose gradient
  //! the pipeline sums across stages only after the step's last backward.
  std::vector<bool> tied_units;
  //! Per unit, the layers whose backward writes its gradient (those whose layer_units hold it).
  std::vector<std::vector<int>> unit_layers;

  int layers() const noexcept { return static_cast<int>(layer_units.size()); }
  const ShardUnit& unit(int u) const noexcept { return plan->units()[static_cast<std::size_t>(u)]; }
  //! A view of the units a layer reads, each stored from `storage(u)`.
  template <class T, class Storage>
  ParameterView<T> view(int layer, Storage&& storage) const {
    ParameterView<T> v;
    for (int u : layer_units[static_cast<std::size_t>(layer)]) v.add(unit(u).begin, unit(u).begin + unit(u).size, storage(u));
    return v;
  }
  //! Drains the bf16 gradients of the elements layer_ranges lists for `layer`, as `part` stores
  //! them, into the fp32 sums `sum` stores (TrainerOptions::fp32_gradients).
  template <class T>
  void drain(int layer, const ParameterView<T>& part, const ParameterView<accumulate_t<T>>& sum) const {
    drain_ranges(*backend, layer_ranges[static_cast<std::size_t>(layer)], part, sum);
  }
};

//! Stages 1 and 2: every rank holds all parameters, in a padded full buffer (unit u at
//! padded_offset); after the update each rank's pieces are all-gathered in place.
template <class B, class T>
class FullParameters {
 public:
  static constexpr bool sharded = false;
  FullParameters(ShardContext<B>& c, const ParameterLayout& layout, std::uint64_t seed)
      : c_(&c), full_(*c.backend, c.plan->padded_total(), MemoryCategory::parameters) {
    full_.zero();
    std::vector<T> host(static_cast<std::size_t>(layout.total()));
    layout.initialize(host.data(), seed);
    load(host.data());
  }
  ParameterView<const T> forward(int layer) { return view(layer); }
  void after_forward(int) {}
  ParameterView<const T> backward(int layer) { return view(layer); }
  void after_backward(int) {}
  //! This rank's piece of unit `u` (what the optimizer updates).
  T* owned(const ShardUnit& u) { return full_.data() + u.padded_offset + c_->plan->rank() * u.piece; }
  //! Shares every rank's updated pieces.
  void after_update() {
    std::vector<Request>& pending = pending_;
    pending.clear();
    for (const ShardUnit& u : c_->plan->units())
      pending.push_back(c_->group.all_gather_async(std::span<const T>(owned(u), static_cast<std::size_t>(u.piece)),
                                                   std::span<T>(full_.data() + u.padded_offset,
                                                                static_cast<std::size_t>(u.piece * c_->plan->ranks()))));
    for (auto& r : pending) r.wait();
  }
  void invalidate() {}
  void copy_to(T* out) const {
    for (const ShardUnit& u : c_->plan->units())
      c_->backend->copy_to_host(out + u.begin, full_.data() + u.padded_offset, sizeof(T) * static_cast<std::size_t>(u.size));
  }
  void load(const T* in) {
    for (const ShardUnit& u : c_->plan->units())
      c_->backend->copy_from_host(full_.data() + u.padded_offset, in + u.begin, sizeof(T) * static_cast<std::size_t>(u.size));
  }

 private:
  ParameterView<const T> view(int layer) const {
    return c_->template view<const T>(layer, [&](int u) { return full_.data() + c_->unit(u).padded_offset; });
  }
  ShardContext<B>* c_;
  Buffer<T, B> full_;
  std::vector<Request> pending_;
};

//! Stage 3: only this rank's pieces persist. A layer's units are all-gathered into pooled
//! buffers before its forward and backward (the next `prefetch` layers' gathers start early)
//! and given back after, unless a layer about to run needs them.
template <class B, class T>
class ShardedParameters {
 public:
  static constexpr bool sharded = true;
  ShardedParameters(ShardContext<B>& c, const ParameterLayout& layout, std::uint64_t seed, int prefetch)
      : c_(&c),
        shard_(*c.backend, c.plan->shard_size(), MemoryCategory::parameters),
        pool_(*c.backend, MemoryCategory::communication),
        gathered_(c.plan->units().size()),
        prefetch_(prefetch) {
    // Each rank computes its own pieces only (DESIGN.md invariant 1).
    std::vector<T> host(static_cast<std::size_t>(c.plan->shard_size()), T(0));
    for (const ShardUnit& u : c.plan->units()) {
      const std::int64_t begin = c.plan->owned_begin(u);
      layout.initialize(host.data() + u.shard_offset, begin, begin + c.plan->owned_count(u), seed);
    }
    c.backend->copy_from_host(shard_.data(), host.data(), shard_.bytes());
  }

  ParameterView<const T> forward(int layer) {
    gather(layer);
    for (int k = 1; k <= prefetch_ && layer + k < c_->layers(); ++k) start_gather(layer + k);
    return view(layer);
  }
  //! Keeps what the next forward layers need; the last layer's units stay for its backward.
  void after_forward(int layer) {
    if (layer + 1 == c_->layers()) return;
    release_unless_needed(layer, layer + 1, std::min(c_->layers() - 1, layer + prefetch_));
  }
  ParameterView<const T> backward(int layer) {
    gather(layer);
    for (int k = 1; k <= prefetch_ && layer - k >= 0; ++k) start_gather(layer - k);
    return view(layer);
  }
  void after_backward(int layer) {
    if (layer == 0) return release_all();
    release_unless_needed(layer, std::max(0, layer - prefetch_), layer - 1);
  }
  T* owned(const ShardUnit& u) { return shard_.data() + u.shard_offset; }
  //! The shard changed: gathered copies are stale.
  void after_update() { release_all(); }
  void invalidate() { release_all(); }
  void copy_to(T* out) {
    release_all();
    for (int u = 0; u < static_cast<int>(gathered_.size()); ++u) {
      start_unit(u);
      finish_unit(u);
      c_->backend->copy_to_host(out + c_->unit(u).begin, gathered_[u].buffer.data(),
                                sizeof(T) * static_cast<std::size_t>(c_->unit(u).size));
      release_unit(u);
    }
  }
  void load(const T* in) {
    release_all();
    for (const ShardUnit& u : c_->plan->units())
      c_->backend->copy_from_host(owned(u), in + c_->plan->owned_begin(u),
                                  sizeof(T) * static_cast<std::size_t>(c_->plan->owned_count(u)));
  }

 private:
  struct Gathered {
    Buffer<T, B> buffer;
    Request request;
    bool present = false;
  };

  void start_unit(int u) {
    Gathered& g = gathered_[static_cast<std::size_t>(u)];
    if (g.present) return;
    const ShardUnit& unit = c_->unit(u);
    g.buffer = pool_.acquire(unit.piece * c_->plan->ranks());
    g.request = c_->group.all_gather_async(std::span<const T>(owned(unit), static_cast<std::size_t>(unit.piece)),
                                           std::span<T>(g.buffer.data(), static_cast<std::size_t>(unit.piece * c_->plan->ranks())));
    g.present = true;
  }
  void finish_unit(int u) { gathered_[static_cast<std::size_t>(u)].request.wait(); }
  void release_unit(int u) {
    Gathered& g = gathered_[static_cast<std::size_t>(u)];
    if (!g.present) return;
    g.request.wait();
    pool_.release(std::move(g.buffer));
    g.present = false;
  }
  void start_gather(int layer) {
    for (int u : c_->layer_units[static_cast<std::size_t>(layer)]) start_unit(u);
  }
  void gather(int layer) {
    start_gather(layer);
    for (int u : c_->layer_units[static_cast<std::size_t>(layer)]) finish_unit(u);
  }
  //! Gives back `layer`'s units that no layer in [first, last] reads.
  void release_unless_needed(int layer, int first, int last) {
    for (int u : c_->layer_units[static_cast<std::size_t>(layer)]) {
      bool needed = false;
      for (int l = first; l <= last && !needed; ++l)
        for (int v : c_->layer_units[static_cast<std::size_t>(l)]) needed = needed || v == u;
      if (!needed) release_unit(u);
    }
  }
  void release_all() {
    for (int u = 0; u < static_cast<int>(gathered_.size()); ++u) release_unit(u);
  }
  ParameterView<const T> view(int layer) const {
    return c_->template view<const T>(layer, [&](int u) { return gathered_[static_cast<std::size_t>(u)].buffer.data(); });
  }

  ShardContext<B>* c_;
  Buffer<T, B> shard_;
  BufferPool<T, B> pool_;
  std::vector<Gathered> gathered_;
  int prefetch_;
};

//! Stage 1: full gradients accumulate over the micro-batches with no communication; in the last
//! one each unit is reduce-scattered in place as soon as its layers are done. With fp32
//! gradients a full fp32 buffer is what is reduce-scattered: fusing layers add to it
//! themselves, what the others write in the bf16 buffer is drained into it after each layer's
//! backward, and where nothing is drained there is no bf16 buffer (ShardContext::narrow_grads).
template <class B, class T>
class FullGradients {
 public:
  using wide_type = accumulate_t<T>;
  FullGradients(ShardContext<B>& c, bool overlap, bool fp32)
      : c_(&c), full_(*c.backend, !fp32 || c.narrow_grads ? c.plan->padded_total() : 0, MemoryCategory::gradients),
        wide_(*c.backend, fp32 ? c.plan->padded_total() : 0, MemoryCategory::gradients),
        in_flight_(c.plan->units().size()), overlap_(overlap) {
    full_.zero();
    wide_.zero();
  }
  void begin_step() {
    full_.zero();
    wide_.zero();
    next_ = handed_ = static_cast<int>(c_->plan->units().size()) - 1;
  }
  bool fp32() const noexcept { return wide_.size() > 0; }
  //! The bf16 (or float) gradients of the units `layer` reads; empty where there are none.
  ParameterView<T> backward(int layer) { return narrow() ? view(layer, full_.data()) : ParameterView<T>{}; }
  //! The fp32 sums of the units `layer` reads (fp32 gradients only).
  ParameterView<wide_type> fp32_view(int layer) { return view(layer, wide_.data()); }
  void drain(int layer) {
    if (fp32() && narrow()) c_->drain(layer, backward(layer), fp32_view(layer));
  }
  void after_backward(int layer, bool last_micro_batch) {
    drain(layer);
    if (!last_micro_batch) return;
    for (auto& r : in_flight_) r.test();
    if (overlap_) start_done(layer);
  }
  void finish() {
    start_done(0);
    for (auto& r : in_flight_) r.wait();
  }
  //! Calls `f(u)` for each unit whose reduce-scatter has started since the last call, in start
  //! order, once it is complete: this rank's piece of it then holds the step's sum over the group.
  template <class F>
  void hand_over_started(F&& f) {
    for (; handed_ > next_; --handed_) {
      in_flight_[static_cast<std::size_t>(handed_)].wait();
      f(handed_);
    }
  }
  T* owned(const ShardUnit& u) { return narrow() ? piece_of(full_.data(), u) : nullptr; }
  //! This rank's piece of the fp32 sums of unit `u`; null without fp32 gradients.
  wide_type* owned_fp32(const ShardUnit& u) { return fp32() ? piece_of(wide_.data(), u) : nullptr; }

 private:
  bool narrow() const noexcept { return full_.size() > 0; }
  template <class U>
  ParameterView<U> view(int layer, U* full) {
    return c_->template view<U>(layer, [&](int u) { return full + c_->unit(u).padded_offset; });
  }
  template <class U>
  U* piece_of(U* full, const ShardUnit& u) const { return full + u.padded_offset + c_->plan->rank() * u.piece; }
  //! Starts the units (from the last) whose first layer is >= `layer`: their gradients are done.
  void start_done(int layer) {
    for (; next_ >= 0 && c_->unit(next_).first_layer >= layer; --next_) {
      const ShardUnit& u = c_->unit(next_);
      in_flight_[static_cast<std::size_t>(next_)] =
          fp32() ? reduce_scatter(wide_.data(), u) : reduce_scatter(full_.data(), u);
    }
  }
  template <class U>
  Request reduce_scatter(U* full, const ShardUnit& u) {
    return c_->group.reduce_scatter_async(
        std::span<const U>(full + u.padded_offset, static_cast<std::size_t>(u.piece * c_->plan->ranks())),
        std::span<U>(piece_of(full, u), static_cast<std::size_t>(u.piece)), ReduceOp::sum);
  }
  ShardContext<B>* c_;
  Buffer<T, B> full_;
  Buffer<wide_type, B> wide_;  // empty unless fp32 gradients
  std::vector<Request> in_flight_;
  bool overlap_;
  int next_ = -1;     // the next unit to reduce-scatter (they start from the last)
  int handed_ = -1;   // the next unit hand_over_started passes on
};

//! Stages 2 and 3: only the shard persists. While backward fills a unit's gradient it lives in a
//! pooled buffer; once the unit's layers are done it is reduce-scattered in place and this rank's
//! piece is added to the shard — in every micro-batch, so full gradients never outlive their
//! unit (DeepSpeed ZeRO-2's and FSDP's behaviour under accumulation). At most
//! `max_reducing` units are being reduced at once (DeepSpeed keeps two reduce buckets): the
//! working set is the units backward is filling plus those. With fp32 gradients an open unit
//! has an fp32 buffer, which fusing layers add to themselves, beside the bf16 one the others
//! write (none where nothing is drained: ShardContext::narrow_grads); each layer's bf16 part is
//! drained into it after the layer's backward, the fp32 buffer is reduce-scattered, and the
//! shard is fp32.
//!
//! Under a pipeline schedule two things differ. A unit holding a tied parameter (GPT-2's wte on
//! the first and last stages) stays open across the micro-batches and is reduce-scattered once,
//! after the Trainer has summed the tied gradient across the stages, as Zero<1> does with every
//! unit: those stages hold that unit's gradient whole through the step (Megatron-LM's embedding
//! group does the same). And the layers of a rank's chunks (interleaved schedules) finish their
//! micro-batches' backwards in any order, so a unit may be reopened while an earlier
//! micro-batch's reduction of it is still on the way; its backward then waits for that first.
template <class B, class T>
class ShardedGradients {
 public:
  using wide_type = accumulate_t<T>;
  static constexpr std::size_t max_reducing = 2;

  ShardedGradients(ShardContext<B>& c, bool overlap, bool fp32)
      : c_(&c), fp32_(fp32), shard_(*c.backend, fp32 ? 0 : c.plan->shard_size(), MemoryCategory::gradients),
        wide_shard_(*c.backend, fp32 ? c.plan->shard_size() : 0, MemoryCategory::gradients),
        pool_(*c.backend, MemoryCategory::communication), wide_pool_(*c.backend, MemoryCategory::communication),
        units_(c.plan->units().size()), overlap_(overlap), last_done_(static_cast<std::size_t>(c.layers()), false) {
    shard_.zero();
    wide_shard_.zero();
  }
  void begin_step() {
    shard_.zero();
    wide_shard_.zero();
    backward_over_ = false;
    last_done_.assign(static_cast<std::size_t>(c_->layers()), false);
    started_last_.clear();
    handed_ = 0;
  }
  bool fp32() const noexcept { return fp32_; }
  ParameterView<T> backward(int layer) {
    for (int u : c_->layer_units[static_cast<std::size_t>(layer)]) {
      Unit& s = units_[static_cast<std::size_t>(u)];
      // An earlier micro-batch's sum still on the way (another chunk's layers ran since).
      while (s.state == State::reducing) accumulate_oldest();
      if (s.state != State::idle) continue;
      while (reducing_.size() >= max_reducing) accumulate_oldest();
      const std::int64_t length = c_->unit(u).piece * c_->plan->ranks();
      if (narrow()) s.buffer = acquire_zeroed(pool_, length);
      if (fp32_) s.wide = acquire_zeroed(wide_pool_, length);
      s.state = State::open;
    }
    if (!narrow()) return {};
    return c_->template view<T>(layer, [&](int u) { return units_[static_cast<std::size_t>(u)].buffer.data(); });
  }
  //! The fp32 sums of the units `layer` reads (fp32 gradients only), open since backward(layer).
  ParameterView<wide_type> fp32_view(int layer) {
    return c_->template view<wide_type>(layer, [&](int u) { return units_[static_cast<std::size_t>(u)].wide.data(); });
  }
  //! Drains what `layer` wrote: its units are open (a layer reads no unit of a later layer).
  void drain(int layer) {
    if (!fp32_ || !narrow()) return;
    c_->drain(layer, c_->template view<T>(layer, [&](int u) { return units_[static_cast<std::size_t>(u)].buffer.data(); }),
              fp32_view(layer));
  }
  void after_backward(int layer, bool last_micro_batch) {
    if (last_micro_batch) last_done_[static_cast<std::size_t>(layer)] = true;
    // Local layer 0's last backward is reported last, after the tied gradients' exchange.
    backward_over_ = backward_over_ || (layer == 0 && last_micro_batch);
    drain(layer);
    while (!reducing_.empty() && units_[static_cast<std::size_t>(reducing_.front())].request.test()) accumulate_oldest();
    if (overlap_ || layer == 0) start_done(layer);
    if (layer == 0) drain_reductions();  // the micro-batch's backward is over
  }
  void finish() {
    backward_over_ = true;
    drain_reductions();
  }
  //! Calls `f(u)` for each unit whose last reduce-scatter of the step has started since
  //! the last call, in start order, once this rank's piece is added to the shard: the shard's
  //! piece of the unit then holds the step's sum over the group.
  template <class F>
  void hand_over_started(F&& f) {
    for (; handed_ < started_last_.size(); ++handed_) {
      const int u = started_last_[handed_];
      while (units_[static_cast<std::size_t>(u)].state == State::reducing) accumulate_oldest();
      f(u);
    }
  }
  T* owned(const ShardUnit& u) { return fp32_ ? nullptr : shard_.data() + u.shard_offset; }
  //! This rank's piece of the fp32 gradient shard of unit `u`; null without fp32 gradients.
  wide_type* owned_fp32(const ShardUnit& u) { return fp32_ ? wide_shard_.data() + u.shard_offset : nullptr; }

 private:
  //! Whether the layers write gradients of T (else fp32 gradients with no bf16 buffers).
  bool narrow() const noexcept { return !fp32_ || c_->narrow_grads; }
  enum class State { idle, open, reducing };
  struct Unit {
    Buffer<T, B> buffer;
    Buffer<wide_type, B> wide;  // fp32 gradients only
    Request request;
    State state = State::idle;
  };
  template <class U>
  Buffer<U, B> acquire_zeroed(BufferPool<U, B>& pool, std::int64_t length) {
    Buffer<U, B> b = pool.acquire(length);
    c_->backend->fill_zero(b.data(), sizeof(U) * static_cast<std::size_t>(length));
    return b;
  }
  //! Starts the open units (from the last) whose layers are all done, except those holding a
  //! tied parameter until the step's backward is over. With fp32 gradients the bf16 buffer
  //! holds nothing more (drained) and goes back to the pool at once.
  void start_done(int layer) {
    for (int u = static_cast<int>(units_.size()) - 1; u >= 0; --u) {
      Unit& s = units_[static_cast<std::size_t>(u)];
      if (s.state != State::open || c_->unit(u).first_layer < layer) continue;
      if (!backward_over_ && c_->tied_units[static_cast<std::size_t>(u)]) continue;
      const ShardUnit& unit = c_->unit(u);
      if (fp32_) {
        if (narrow()) pool_.release(std::move(s.buffer));
        s.request = reduce_scatter(s.wide.data(), unit);
      } else {
        s.request = reduce_scatter(s.buffer.data(), unit);
      }
      s.state = State::reducing;
      reducing_.push_back(u);
      if (takes_last_sum(u)) started_last_.push_back(u);
    }
  }
  //! Whether every layer that reads unit `u` has had its last backward of the step: then this
  //! reduction of it is the step's last.
  bool takes_last_sum(int u) const {
    const std::vector<int>& layers = c_->unit_layers[static_cast<std::size_t>(u)];
    return std::all_of(layers.begin(), layers.end(), [&](int l) { return last_done_[static_cast<std::size_t>(l)]; });
  }
  template <class U>
  Request reduce_scatter(U* full, const ShardUnit& unit) {
    return c_->group.reduce_scatter_async(
        std::span<const U>(full, static_cast<std::size_t>(unit.piece * c_->plan->ranks())),
        std::span<U>(full + c_->plan->rank() * unit.piece, static_cast<std::size_t>(unit.piece)), ReduceOp::sum);
  }
  //! Waits for the oldest reduction, adds this rank's piece to the shard, frees the buffer.
  void accumulate_oldest() {
    const int u = reducing_.front();
    reducing_.erase(reducing_.begin());
    Unit& s = units_[static_cast<std::size_t>(u)];
    s.request.wait();
    const ShardUnit& unit = c_->unit(u);
    const std::int64_t mine = c_->plan->rank() * unit.piece;
    if (fp32_) {
      add_to<wide_type>(*c_->backend, Tensor<wide_type>(owned_fp32(unit), Shape{unit.piece}),
                        Tensor<const wide_type>(s.wide.data() + mine, Shape{unit.piece}));
      wide_pool_.release(std::move(s.wide));
    } else {
      add_to<T>(*c_->backend, Tensor<T>(owned(unit), Shape{unit.piece}),
                Tensor<const T>(s.buffer.data() + mine, Shape{unit.piece}));
      pool_.release(std::move(s.buffer));
    }
    s.state = State::idle;
  }
  void drain_reductions() {
    start_done(0);
    while (!reducing_.empty()) accumulate_oldest();
  }
  ShardContext<B>* c_;
  bool fp32_;
  Buffer<T, B> shard_;                  // empty with fp32 gradients
  Buffer<wide_type, B> wide_shard_;     // fp32 gradients only
  BufferPool<T, B> pool_;
  BufferPool<wide_type, B> wide_pool_;  // fp32 gradients only
  std::vector<Unit> units_;
  std::vector<int> reducing_;  // units being reduced, oldest first
  bool overlap_;
  bool backward_over_ = false;  // the step's last backward of local layer 0 reported: tied units may go
  std::vector<bool> last_done_;   // per layer: its last backward of the step reported
  std::vector<int> started_last_;  // units whose last reduction of the step has started, in order
  std::size_t handed_ = 0;         // how many of them hand_over_started has passed on
};

//! The engine every stage shares: the plan, the optimizer state shard, the update of this
//! rank's pieces, and the sums over the group. `P` holds the parameters, `G` the gradients.
template <class B, class T, class P, class G>
class ZeroEngine {
 public:
  template <class... ParameterArgs>
  ZeroEngine(EngineContext<B> context, std::vector<GradientBucket> units, bool overlap, int replicas, const char* who,
             ParameterArgs... args)
      : groups_(context.data_parallel, replicas, who),
        plan_(context.layout, units, groups_.shard().size(), groups_.shard().rank()),
        context_(make_context(context)),
        layout_(&context.layout),
        state_(context.backend, plan_.shard_size() * context.state_slots, MemoryCategory::optimizer_state),
        master_(context.backend, plan_.shard_size()),
        params_(context_, context.layout, context.seed, args...),
        grads_(context_, overlap, is_narrow_storage<T> && context.fp32_gradients),
        state_slots_(context.state_slots) {
    state_.zero();
    for (const ShardUnit& u : plan_.units()) {
      const std::int64_t begin = plan_.owned_begin(u);
      master_.initialize(context.layout, u.shard_offset, begin, begin + plan_.owned_count(u), context.seed);
    }
  }
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  //! How the layout is split over the group.
  const ShardPlan& plan() const noexcept { return plan_; }

  ParameterView<const T> forward_params(int layer) { return params_.forward(layer); }
  void after_forward(int layer) { params_.after_forward(layer); }
  ParameterView<const T> backward_params(int layer) { return params_.backward(layer); }
  ParameterView<T> backward_grads(int layer) { return grads_.backward(layer); }

  void begin_step() { grads_.begin_step(); }
  //! Whether the gradients are kept in fp32 (bf16 parameters, TrainerOptions::fp32_gradients).
  bool fp32_gradients() const noexcept { return grads_.fp32(); }
  //! With fp32 gradients: drains what `layer` wrote into the fp32 sums (done after each of its
  //! backwards; the Trainer calls it after an input-gradient pass too).
  void drain(int layer) { grads_.drain(layer); }
  //! The fp32 sums of the units `layer` reads (fp32 gradients only): what the layers add their
  //! fused gradients to, and under stage 1 what the tied exchange sums.
  ParameterView<accumulate_t<T>> fp32_grads_view(int layer) { return grads_.fp32_view(layer); }
  //! After `layer`'s backward. With replicas, in the last micro-batch, first starts the
  //! all-reduces over the replicas of the units whose reduce-scatters began at earlier layers
  //! (waiting for those), then the reduce-scatters of the units now done: every rank issues the
  //! two groups' collectives in the same order, which NCCL's in-order streams need.
  void on_backward(int layer, bool last_micro_batch) {
    if (last_micro_batch && groups_.replicas() > 1) reduce_over_replicas();
    grads_.after_backward(layer, last_micro_batch);
    params_.after_backward(layer);
  }
  //! Completes the reductions; with replicas, sums each shard over the ranks that hold it.
  void finish_gradients() {
    grads_.finish();
    if (groups_.replicas() == 1) return;
    reduce_over_replicas();
    for (Request& r : replica_pending_) r.wait();
  }
  //! Sums over every data-parallel rank (the loss: every rank trains on its own slice).
  double global_sum(double local) {
    groups_.all().all_reduce(std::span<double>(&local, 1), ReduceOp::sum);
    return local;
  }
  //! Each element is in exactly one rank's pieces within a replica (padding excluded): sum them,
  //! then over the replica's ranks; parameters replicated over tensor parallelism only when
  //! `count_replicated`.
  double grad_sum_of_squares(bool count_replicated = true) {
    double local = 0;
    for (const ShardUnit& u : plan_.units()) {
      const std::int64_t begin = plan_.owned_begin(u);
      local += detail::gradient_sum_of_squares(
          *context_.backend, *layout_,
          detail::FlatRange<T>{.begin = begin,
                               .end = begin + plan_.owned_count(u),
                               .grads = grads_.owned(u),
                               .fp32_grads = grads_.owned_fp32(u)},
          count_replicated);
    }
    reduce_updated(std::span<double>(&local, 1));
    return local;
  }

  //! Scales this rank's gradient pieces by `grad_scale`, calls `apply` with them and its
  //! parameter pieces and optimizer state (std::span<const detail::FlatRange<T>>, a range per
  //! unit it owns part of), and lets the parameter holding share the updated pieces.
  template <class F>
  void update(double grad_scale, F&& apply) {
    std::vector<detail::FlatRange<T>> ranges;
    for (const ShardUnit& u : plan_.units()) {
      const std::int64_t n = plan_.owned_count(u);
      if (n == 0) continue;
      if (grad_scale != 1.0 && fp32_gradients())
        scale<accumulate_t<T>>(*context_.backend, Tensor<accumulate_t<T>>(grads_.owned_fp32(u), Shape{n}), grad_scale);
      else if (grad_scale != 1.0)
        scale<T>(*context_.backend, Tensor<T>(grads_.owned(u), Shape{n}), grad_scale);
      const std::int64_t begin = plan_.owned_begin(u);
      ranges.push_back(detail::FlatRange<T>{.begin = begin,
                                            .end = begin + n,
                                            .params = params_.owned(u),
                                            .grads = grads_.owned(u),
                                            .fp32_grads = grads_.owned_fp32(u),
                                            .state = state_.data() + u.shard_offset,
                                            .state_stride = plan_.shard_size(),
                                            .master = master_.data() ? master_.data() + u.shard_offset : nullptr});
    }
    apply(std::span<const detail::FlatRange<T>>(ranges));
    params_.after_update();
  }
  //! Sums `values` computed over the elements this rank updates (its pieces) into the values
  //! over all elements: over the replica's ranks, whose pieces are disjoint.
  void reduce_updated(std::span<double> values) {
    if (context_.group.size() > 1) context_.group.all_reduce(values, ReduceOp::sum);
  }

  //! The layout ranges of the training state this rank owns: its piece of every unit, in unit
  //! order, on the first replica (the others hold the same values and report none). The ranks of
  //! the group own disjoint ranges that cover the layout.
  std::vector<ElementRange> owned_state_ranges() const {
    if (!reports_state_) return {};
    return shard_ranges();
  }
  //! The layout ranges load_state(array, ...) takes: this rank's pieces (on every replica),
  //! except that the parameters of stages 1 and 2 are held whole and so taken whole.
  std::vector<ElementRange> needed_state_ranges(int array) const {
    check_state_array(array, state_slots_);
    if (array == 0 && !P::sharded) return {ElementRange{0, layout_->total()}};
    return shard_ranges();
  }
  //! Writes the elements of training-state array `array` this rank owns to host `out`
  //! (owned_state_ranges() one after another): array 0 is the parameters at the optimizer's
  //! precision (the fp32 master weights of bf16 parameters), array k >= 1 the optimizer's state
  //! slot k - 1.
  void copy_owned_state_to(int array, accumulate_t<T>* out) {
    check_state_array(array, state_slots_);
    if (!reports_state_) return;
    for (const ShardUnit& u : plan_.units()) {
      const std::int64_t n = plan_.owned_count(u);
      if (n == 0) continue;
      const std::size_t bytes = sizeof(accumulate_t<T>) * static_cast<std::size_t>(n);
      accumulate_t<T>* to = out;
      out += n;
      if (array > 0)
        context_.backend->copy_to_host(to, state_.data() + (array - 1) * plan_.shard_size() + u.shard_offset, bytes);
      else if constexpr (MasterWeights<B, T>::held)
        context_.backend->copy_to_host(to, master_.data() + u.shard_offset, bytes);
      else
        context_.backend->copy_to_host(to, params_.owned(u), bytes);
    }
  }
  //! Replaces this rank's part of training-state array `array` (as in copy_owned_state_to) with
  //! host `in`, which holds needed_state_ranges(array) one after another.
  void load_state(int array, const accumulate_t<T>* in) {
    check_state_array(array, state_slots_);
    if (array == 0 && !P::sharded) return load_parameters(in);
    if (array == 0) params_.invalidate();
    for (const ShardUnit& u : plan_.units()) {
      const std::int64_t n = plan_.owned_count(u);
      if (n == 0) continue;
      const std::size_t bytes = sizeof(accumulate_t<T>) * static_cast<std::size_t>(n);
      if (array > 0) {
        context_.backend->copy_from_host(state_.data() + (array - 1) * plan_.shard_size() + u.shard_offset, in, bytes);
      } else {
        if constexpr (std::is_same_v<accumulate_t<T>, T>)
          context_.backend->copy_from_host(params_.owned(u), in, bytes);
        else
          context_.backend->copy_from_host(params_.owned(u), stored_as<T>(in, n).data(),
                                           sizeof(T) * static_cast<std::size_t>(n));
        master_.load(u.shard_offset, in, n);
      }
      in += n;
    }
  }

  //! Every parameter in layout order (collective when parameters are sharded).
  void copy_parameters_to(T* out) { params_.copy_to(out); }
  //! This rank keeps its part of `in` (every parameter, layout order, of T or, for bf16
  //! parameters, fp32: its master pieces take that exactly and the parameters rounded).
  template <class U>
  void load_parameters(const U* in) {
    if constexpr (std::is_same_v<U, T>)
      params_.load(in);
    else
      params_.load(stored_as<T>(in, layout_->total()).data());
    for (const ShardUnit& u : plan_.units())
      master_.load(u.shard_offset, in + plan_.owned_begin(u), plan_.owned_count(u));
  }

 private:
  ShardContext<B> make_context(const EngineContext<B>& c) {
    ShardContext<B> s{&c.backend, groups_.shard(), &plan_, {}, c.drained(), c.template layers_write_gradients<T>(), {}, {}};
    for (const auto& ranges : c.layer_parameters) s.layer_units.push_back(plan_.units_of(ranges));
    s.tied_units.assign(plan_.units().size(), false);
    for (int u : plan_.units_of(c.tied)) s.tied_units[static_cast<std::size_t>(u)] = true;
    s.unit_layers.resize(plan_.units().size());
    for (int l = 0; l < s.layers(); ++l)
      for (int u : s.layer_units[static_cast<std::size_t>(l)]) s.unit_layers[static_cast<std::size_t>(u)].push_back(l);
    return s;
  }
  //! This rank's piece of every unit it owns part of, in unit order.
  std::vector<ElementRange> shard_ranges() const {
    std::vector<ElementRange> ranges;
    for (const ShardUnit& u : plan_.units())
      if (const std::int64_t n = plan_.owned_count(u); n > 0)
        ranges.push_back({plan_.owned_begin(u), plan_.owned_begin(u) + n});
    return ranges;
  }
  //! Starts summing over the replicas this rank's piece (padding included: zeros) of each unit
  //! whose step sum over the replica is complete and not yet passed on.
  void reduce_over_replicas() {
    replica_pending_.resize(plan_.units().size());
    grads_.hand_over_started([&](int unit) {
      const ShardUnit& u = plan_.units()[static_cast<std::size_t>(unit)];
      const auto n = static_cast<std::size_t>(u.piece);
      Request& r = replica_pending_[static_cast<std::size_t>(unit)];
      if (auto* wide = grads_.owned_fp32(u))
        r = groups_.replica().all_reduce_async(std::span(wide, n), ReduceOp::sum);
      else
        r = groups_.replica().all_reduce_async(std::span(grads_.owned(u), n), ReduceOp::sum);
    });
  }

  ShardGroups groups_;

  ShardPlan plan_;
  ShardContext<B> context_;
  const ParameterLayout* layout_;
  Buffer<accumulate_t<T>, B> state_;
  MasterWeights<B, T> master_;
  P params_;
  G grads_;
  int state_slots_;
  bool reports_state_ = groups_.replica().rank() == 0;
  std::vector<Request> replica_pending_;
};

}  // namespace detail

template <int Stage>
struct Zero;

namespace detail {
//! Zero<Stage>::Engine<B, T>. A class template of the stage outside Zero (specialized below)
//! rather than explicit specializations of a constrained member template, on which Clang 14
//! crashes.
template <int Stage, class B, class T>
class ZeroStageEngine;
}  // namespace detail

//! ZeRO stage `Stage` (1, 2 or 3) on the data-parallel group. Units of whole layers of at least
//! `bucket_bytes` (stages 1 and 2; stage 3 gathers one layer per unit, as FSDP wraps each block)
//! are reduce-scattered during backward when `overlap` (else after it); stage 3 gathers the
//! `prefetch` next layers' parameters ahead of their use.
template <int Stage>
struct Zero {
  static_assert(Stage >= 1 && Stage <= 3, "loom: Zero<Stage> is ZeRO stage 1, 2 or 3");
  using loom_strategy = void;
  std::size_t bucket_bytes = std::size_t{25} << 20;
  bool overlap = true;
  int prefetch = 1;  //!< stage 3: layers gathered ahead (0 = each just in time)
  //! Hybrid sharding: copies of the model over the data-parallel group, each sharded over
  //! ranks / replicas adjacent ranks; the copies all-reduce their shards' gradients during the
  //! last micro-batch's backward (with `overlap`; else after it). 1 shards over the whole group.
  int replicas = 1;

  friend bool operator==(const Zero&, const Zero&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Zero& z) {
    out << "Zero<" << Stage << ">{bucket_bytes=" << z.bucket_bytes << ", overlap=" << z.overlap;
    if (Stage == 3) out << ", prefetch=" << z.prefetch;
    if (z.replicas != 1) out << ", replicas=" << z.replicas;
    return out << "}";
  }

  //! The rank's shards and the stage's holding of parameters and gradients.
  template <Backend B, class T>
  using Engine = detail::ZeroStageEngine<Stage, B, T>;
};

namespace detail {

//! Stage 1: full parameters and gradients, sharded optimizer state.
template <class B, class T>
class ZeroStageEngine<1, B, T> : public ZeroEngine<B, T, FullParameters<B, T>, FullGradients<B, T>> {
 public:
  ZeroStageEngine(const Zero<1>& z, EngineContext<B> c)
      : ZeroEngine<B, T, FullParameters<B, T>, FullGradients<B, T>>(
            c, gradient_buckets(c.layout, sizeof(T), z.bucket_bytes), z.overlap, z.replicas, "Zero<1>") {}
};

//! Stage 2: full parameters, sharded gradients and optimizer state.
template <class B, class T>
class ZeroStageEngine<2, B, T> : public ZeroEngine<B, T, FullParameters<B, T>, ShardedGradients<B, T>> {
 public:
  ZeroStageEngine(const Zero<2>& z, EngineContext<B> c)
      : ZeroEngine<B, T, FullParameters<B, T>, ShardedGradients<B, T>>(
            c, gradient_buckets(c.layout, sizeof(T), z.bucket_bytes), z.overlap, z.replicas, "Zero<2>") {}
};

//! Stage 3: everything sharded; parameters gathered per layer.
template <class B, class T>
class ZeroStageEngine<3, B, T> : public ZeroEngine<B, T, ShardedParameters<B, T>, ShardedGradients<B, T>> {
 public:
  ZeroStageEngine(const Zero<3>& z, EngineContext<B> c)
      : ZeroEngine<B, T, ShardedParameters<B, T>, ShardedGradients<B, T>>(
            c, gradient_buckets(c.layout, sizeof(T), 1), z.overlap, z.replicas, "Zero<3>", check_prefetch(z.prefetch)) {}

 private:
  static int check_prefetch(int prefetch) {
    LOOM_CHECK(prefetch >= 0, "Zero<3>: prefetch", prefetch, "must be >= 0 (layers gathered ahead)");
    return prefetch;
  }
};

}  // namespace detail

static_assert(Strategy<Zero<1>> && Strategy<Zero<2>> && Strategy<Zero<3>>);

}  // namespace loom
