#pragma once
//! \file DataParallel (DDP): every rank holds the whole model and trains on its slice of the
//! global batch; gradients are summed over the data-parallel group in buckets, each bucket's
//! all-reduce started during the last micro-batch's backward as soon as its layers are done.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/parallel/concepts.hpp"
#include "loom/parallel/single_rank.hpp"

namespace loom {

//! A contiguous range of the flat gradient buffer reduced as one message: whole layers
//! [first_layer, last_layer], elements [begin, end).
struct GradientBucket {
  int first_layer = 0, last_layer = 0;
  std::int64_t begin = 0, end = 0;
  friend bool operator==(const GradientBucket&, const GradientBucket&) = default;
  friend std::ostream& operator<<(std::ostream& out, const GradientBucket& b) {
    return out << "{layers " << b.first_layer << ".." << b.last_layer << ", elements [" << b.begin
               << ", " << b.end << ")}";
  }
};

//! Buckets of at least `bucket_bytes` (whole layers; a layer larger than that is a bucket of
//! its own) in reverse layer order: the order backward completes them. A parameter's gradient
//! is complete once the backward of its owning layer (ParameterSpec::layer) has run, because
//! layers that also use it (a tied unembedding) come later in the forward order.
inline std::vector<GradientBucket> gradient_buckets(const ParameterLayout& layout,
                                                    std::size_t bytes_per_element,
                                                    std::size_t bucket_bytes) {
  LOOM_CHECK(bucket_bytes > 0, "gradient buckets: bucket_bytes", bucket_bytes, "must be > 0");
  // Each layer's elements [begin, end); the layout keeps layers contiguous and in order.
  struct Span {
    int layer;
    std::int64_t begin, end;
  };
  std::vector<Span> layers;
  for (const auto& e : layout.entries()) {
    if (e.numel() == 0) continue;
    if (!layers.empty() && layers.back().layer == e.spec.layer)
      layers.back().end = e.offset + e.numel();
    else
      layers.push_back({e.spec.layer, e.offset, e.offset + e.numel()});
  }
  std::vector<GradientBucket> buckets;
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
    const bool open = !buckets.empty() &&
                      static_cast<std::size_t>(buckets.back().end - buckets.back().begin) *
                              bytes_per_element < bucket_bytes;
    if (open) {
      buckets.back().first_layer = it->layer;
      buckets.back().begin = it->begin;
    } else {
      buckets.push_back({it->layer, it->layer, it->begin, it->end});
    }
  }
  return buckets;
}

//! Data parallelism (PyTorch DDP's algorithm): replicated parameters and optimizer state,
//! gradients summed over the group in buckets of `bucket_bytes` (of fp32 gradients where the
//! engine keeps them: TrainerOptions::fp32_gradients, as Megatron-LM's
//! accumulate_allreduce_grads_in_fp32). With `overlap`, a bucket's
//! all-reduce starts during the last micro-batch's backward as soon as its layers are done and
//! the optimizer waits only for what is still in flight; without it, all buckets are reduced
//! after backward (the baseline the overlap benchmark compares with). Earlier micro-batches of
//! an accumulation communicate nothing (no_sync).
struct DataParallel {
  using loom_strategy = void;

  std::size_t bucket_bytes = std::size_t{25} << 20;  //!< PyTorch DDP's default, 25 MiB
  bool overlap = true;

  friend bool operator==(const DataParallel&, const DataParallel&) = default;
  friend std::ostream& operator<<(std::ostream& out, const DataParallel& d) {
    return out << "DataParallel{bucket_bytes=" << d.bucket_bytes << ", overlap=" << d.overlap << "}";
  }

  template <Backend B, class T>
  class Engine : public detail::ReplicatedEngine<B, T> {
   public:
    Engine(const DataParallel& settings, EngineContext<B> context)
        : detail::ReplicatedEngine<B, T>(context),
          group_(context.data_parallel),
          overlap_(settings.overlap),
          buckets_(gradient_buckets(context.layout,
                                    detail::ReplicatedEngine<B, T>::fp32_gradients_held(context)
                                        ? sizeof(typename detail::ReplicatedEngine<B, T>::wide_type)
                                        : sizeof(T),
                                    settings.bucket_bytes)),
          in_flight_(buckets_.size()) {}

    //! The buckets, in the order their all-reduces start.
    const std::vector<GradientBucket>& buckets() const noexcept { return buckets_; }

    void begin_step() {
      detail::ReplicatedEngine<B, T>::begin_step();
      next_bucket_ = 0;
    }

    //! After `layer`'s backward: on the last micro-batch, start every bucket whose layers are
    //! now all done, and let in-flight ones progress (MPI moves data only inside its calls).
    void on_backward(int layer, bool last_micro_batch) {
      this->drain(layer);
      if (!last_micro_batch || group_.size() == 1) return;
      for (std::size_t b = 0; b < next_bucket_; ++b) in_flight_[b].test();
      if (!overlap_) return;
      while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].first_layer >= layer)
        start(next_bucket_++);
    }

    //! Starts what has not started and waits for every bucket.
    void finish_gradients() {
      if (group_.size() == 1) return;
      while (next_bucket_ < buckets_.size()) start(next_bucket_++);
      for (auto& request : in_flight_) request.wait();
    }

    double global_sum(double local) {
      group_.all_reduce(std::span<double>(&local, 1), ReduceOp::sum);
      return local;
    }

   private:
    void start(std::size_t b) {
      const GradientBucket& bucket = buckets_[b];
      const auto count = static_cast<std::size_t>(bucket.end - bucket.begin);
      if (auto* wide = this->fp32_grads())
        in_flight_[b] = group_.all_reduce_async(std::span(wide + bucket.begin, count), ReduceOp::sum);
      else
        in_flight_[b] = group_.all_reduce_async(std::span<T>(this->grads() + bucket.begin, count), ReduceOp::sum);
    }

    CommunicatorRef group_;
    bool overlap_;
    std::vector<GradientBucket> buckets_;
    std::vector<Request> in_flight_;
    std::size_t next_bucket_ = 0;
  };
};

static_assert(Strategy<DataParallel>);

}  // namespace loom
