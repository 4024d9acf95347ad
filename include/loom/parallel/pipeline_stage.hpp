#pragma once
//! \file PipelineStage: the layers one pipeline rank runs, as a Model of their own.
//!
//! A pipeline splits the model's layers into `stages × chunks` contiguous ranges (virtual
//! stages, balance_stages); rank s runs virtual stages s, s + stages, s + 2·stages, … (one per
//! chunk; one chunk unless the schedule interleaves). PipelineStage presents those layers as
//! layers 0..n−1 of a model whose layout holds only the parameters they read, so a data-parallel
//! strategy's engine (DDP, ZeRO-1) works on a stage exactly as on a whole model.
//!
//! **Tied parameters.** A parameter read on more than one pipeline rank (GPT-2's `wte`: the
//! embedding on the first stage, the unembedding on the last) is held by each of them. The copy
//! on a rank that does not own it is marked `tied_copy`; every holder lists it first in its
//! layout, owned by its local layer 0, whose backward is the last of a step on the rank, and the
//! Trainer sums the holders' gradients (tied_gradient_exchange) before the strategy reduces
//! them. Equal gradients and equal optimizer state keep the copies identical (Megatron-LM's
//! embedding group does the same).

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/models/concepts.hpp"
#include "loom/parallel/stage_partition.hpp"

namespace loom {

//! A parameter held by several pipeline ranks, as one rank sees it.
struct TiedParameter {
  std::string name;
  std::int64_t offset = 0;  //!< in the stage's layout
  std::int64_t numel = 0;
  std::vector<int> holders;  //!< pipeline ranks holding it, ascending (the owner among them)
};

//! The layers of model `M` that pipeline rank `stage` of `stages` runs (see the file comment).
template <Model M>
class PipelineStage {
 public:
  using loom_model = void;
  using backend_type = typename M::backend_type;
  using scalar_type = typename M::scalar_type;

  //! `virtual_stages[k]` are the layers of virtual stage k (stages·chunks contiguous ranges
  //! covering the model in order, e.g. from balance_stages); this rank runs k = c·stages + stage.
  PipelineStage(M model, std::vector<StageLayers> virtual_stages, int stages, int stage)
      : model_(std::move(model)), stages_(stages), stage_(stage) {
    check_partition(virtual_stages);
    const int chunks = static_cast<int>(virtual_stages.size()) / stages;
    for (int c = 0; c < chunks; ++c) {
      const StageLayers layers = virtual_stages[static_cast<std::size_t>(c * stages + stage)];
      chunks_.push_back({static_cast<int>(global_.size()), layers});
      for (int g = layers.first; g <= layers.last; ++g) global_.push_back(g);
    }
    build_layout(virtual_stages);
  }

  //! The whole stage on one rank: every layer in one chunk.
  explicit PipelineStage(M model) : PipelineStage(model, whole(model), 1, 0) {}

  //! The model whose layers these are.
  const M& model() const noexcept { return model_; }
  M& model() noexcept { return model_; }
  //! This rank's parameters (its layers', and copies of tied ones), layers renumbered 0..n−1.
  const ParameterLayout& layout() const noexcept { return layout_; }
  int num_layers() const noexcept { return static_cast<int>(global_.size()); }
  //! The model's layer that local layer `layer` is.
  int global_layer(int layer) const noexcept { return global_[static_cast<std::size_t>(layer)]; }
  int stages() const noexcept { return stages_; }
  int stage() const noexcept { return stage_; }
  //! Model chunks on this rank (virtual stages per rank).
  int chunks() const noexcept { return static_cast<int>(chunks_.size()); }
  //! Local layers [first, last] of chunk `c`.
  StageLayers chunk_layers(int c) const noexcept {
    const Chunk& k = chunks_[static_cast<std::size_t>(c)];
    return {k.first_local, k.first_local + k.layers.count() - 1};
  }
  //! The model's layers of chunk `c`.
  StageLayers chunk_model_layers(int c) const noexcept { return chunks_[static_cast<std::size_t>(c)].layers; }
  //! Parameters this rank shares with other pipeline ranks (empty with one stage).
  const std::vector<TiedParameter>& tied() const noexcept { return tied_; }

  double layer_cost(int layer) const { return model_.layer_cost(global_layer(layer)); }
  //! The stage-layout ranges local `layer` reads; local layer 0 also lists the tied parameters
  //! (it owns them here, see the file comment).
  std::vector<ElementRange> layer_parameters(int layer) const {
    std::vector<ElementRange> out;
    for (const Piece& p : pieces_[static_cast<std::size_t>(layer)]) out.push_back({p.begin, p.end});
    return out;
  }
  std::int64_t hidden_elements(MicroBatchShape s) const { return model_.hidden_elements(s); }
  std::int64_t activation_elements(int layer, MicroBatchShape s) const {
    return model_.activation_elements(global_layer(layer), s);
  }
  std::int64_t workspace_elements(int layer, MicroBatchShape s) const {
    return model_.workspace_elements(global_layer(layer), s);
  }
  double flops_per_token(std::int64_t seq) const { return model_.flops_per_token(seq); }

  double forward(backend_type& be, int layer, ParameterView<const scalar_type> params,
                 const ForwardArgs<scalar_type>& a) const {
    return model_.forward(be, global_layer(layer), to_model(layer, params), a);
  }
  void backward(backend_type& be, int layer, ParameterView<const scalar_type> params,
                ParameterView<scalar_type> grads, const BackwardArgs<scalar_type>& a) const {
    model_.backward(be, global_layer(layer), to_model(layer, params), to_model(layer, grads), to_model(layer, a));
  }
  //! The stage-layout ranges of the model's fp32_gradient_parameters of local `layer`.
  std::vector<ElementRange> fp32_gradient_parameters(int layer) const
    requires FusesFp32Gradients<M>
  {
    std::vector<ElementRange> out;
    for (const ElementRange& r : model_.fp32_gradient_parameters(global_layer(layer)))
      for (const Piece& p : pieces_[static_cast<std::size_t>(layer)]) {
        const std::int64_t lo = std::max(r.begin, p.model_begin), hi = std::min(r.end, p.model_begin + (p.end - p.begin));
        if (lo < hi) out.push_back({p.begin + (lo - p.model_begin), p.begin + (hi - p.model_begin)});
      }
    return out;
  }
  std::int64_t stash_elements(int layer, MicroBatchShape s) const
    requires SplitBackwardModel<M>
  {
    return model_.stash_elements(global_layer(layer), s);
  }
  void backward_input(backend_type& be, int layer, ParameterView<const scalar_type> params,
                      ParameterView<scalar_type> grads, const BackwardArgs<scalar_type>& a,
                      Tensor<scalar_type> stash) const
    requires SplitBackwardModel<M>
  {
    model_.backward_input(be, global_layer(layer), to_model(layer, params), to_model(layer, grads), to_model(layer, a),
                          stash);
  }
  void backward_weight(backend_type& be, int layer, ParameterView<const scalar_type> params,
                       ParameterView<scalar_type> grads, const BackwardArgs<scalar_type>& a,
                       Tensor<scalar_type> stash) const
    requires SplitBackwardModel<M>
  {
    model_.backward_weight(be, global_layer(layer), to_model(layer, params), to_model(layer, grads),
                           to_model(layer, a), stash);
  }

  //! Stage-layout elements [stage_offset, +numel) are model-layout [model_offset, +numel): one
  //! parameter, a copy of a parameter another pipeline rank owns when `tied_copy`.
  struct Segment {
    std::int64_t stage_offset = 0, model_offset = 0, numel = 0;
    bool tied_copy = false;
  };
  //! Where each of this rank's parameters is in the model's layout, in stage-layout order.
  const std::vector<Segment>& segments() const noexcept { return segments_; }

  //! Writes the parameters this rank owns from `stage` (stage layout) into `full` (the model's
  //! layout); tied copies and other ranks' parameters are left as they are.
  template <class T>
  void scatter_owned(const T* stage, T* full) const {
    for (const Segment& s : segments_)
      if (!s.tied_copy) std::copy(stage + s.stage_offset, stage + s.stage_offset + s.numel, full + s.model_offset);
  }
  //! Fills `stage` (stage layout) from `full` (the model's layout), tied copies included.
  template <class T>
  void gather_from(const T* full, T* stage) const {
    for (const Segment& s : segments_)
      std::copy(full + s.model_offset, full + s.model_offset + s.numel, stage + s.stage_offset);
  }

 private:
  struct Chunk {
    int first_local = 0;
    StageLayers layers;
  };
  //! A stage-layout range a layer reads and where it is in the model's layout.
  struct Piece {
    std::int64_t begin = 0, end = 0, model_begin = 0;
  };

  static std::vector<StageLayers> whole(const M& model) { return {StageLayers{0, model.num_layers() - 1}}; }

  void check_partition(const std::vector<StageLayers>& v) const {
    LOOM_CHECK(stages_ >= 1, "pipeline stage: stages", stages_, "must be >= 1");
    LOOM_CHECK(stage_ >= 0 && stage_ < stages_, "pipeline stage: stage", stage_,
               "must be in [0, stages = " + detail::to_text(stages_) + ")");
    LOOM_CHECK(!v.empty() && v.size() % static_cast<std::size_t>(stages_) == 0,
               "pipeline stage: virtual stages", v.size(),
               "must be a positive multiple of the stages (" + detail::to_text(stages_) + ")");
    int next = 0;
    for (const StageLayers& s : v) {
      LOOM_CHECK(s.first == next && s.last >= s.first, "pipeline stage: layers of a virtual stage",
                 detail::to_text(s), "virtual stages must be non-empty contiguous ranges in order from layer 0");
      next = s.last + 1;
    }
    LOOM_CHECK(next == model_.num_layers(), "pipeline stage: layers covered", next,
               "the virtual stages must cover the model's " + detail::to_text(model_.num_layers()) + " layers");
  }

  //! Which ranks hold each parameter (its owner's and its readers'), this rank's layout (tied
  //! parameters first, then each local layer's own), and the pieces each local layer reads.
  void build_layout(const std::vector<StageLayers>& virtual_stages) {
    const ParameterLayout& full = model_.layout();
    const auto entries = full.entries();
    std::vector<int> rank_of(static_cast<std::size_t>(model_.num_layers()));
    for (std::size_t k = 0; k < virtual_stages.size(); ++k)
      for (int g = virtual_stages[k].first; g <= virtual_stages[k].last; ++g)
        rank_of[static_cast<std::size_t>(g)] = static_cast<int>(k) % stages_;
    // holders[e]: ranks holding entry e.
    std::vector<std::vector<int>> holders(entries.size());
    const auto hold = [&](std::size_t e, int rank) {
      auto& h = holders[e];
      if (std::find(h.begin(), h.end(), rank) == h.end()) h.insert(std::upper_bound(h.begin(), h.end(), rank), rank);
    };
    std::vector<std::vector<ElementRange>> reads(static_cast<std::size_t>(model_.num_layers()));
    for (int g = 0; g < model_.num_layers(); ++g) reads[static_cast<std::size_t>(g)] = model_.layer_parameters(g);
    for (std::size_t e = 0; e < entries.size(); ++e) {
      hold(e, rank_of[static_cast<std::size_t>(entries[e].spec.layer)]);
      for (int g = 0; g < model_.num_layers(); ++g)
        for (const ElementRange& r : reads[static_cast<std::size_t>(g)])
          if (intersects(r, entries[e])) hold(e, rank_of[static_cast<std::size_t>(g)]);
    }
    const auto held_here = [&](std::size_t e) {
      return std::find(holders[e].begin(), holders[e].end(), stage_) != holders[e].end();
    };
    std::vector<int> local_of(static_cast<std::size_t>(model_.num_layers()), -1);
    for (int l = 0; l < num_layers(); ++l) local_of[static_cast<std::size_t>(global_layer(l))] = l;

    std::vector<ParameterSpec> specs;
    std::vector<std::size_t> order;  // model entry of each stage spec
    for (std::size_t e = 0; e < entries.size(); ++e)
      if (held_here(e) && holders[e].size() > 1) {
        ParameterSpec spec = entries[e].spec;
        spec.tied_copy = rank_of[static_cast<std::size_t>(spec.layer)] != stage_;
        spec.layer = 0;
        specs.push_back(std::move(spec));
        order.push_back(e);
      }
    for (int l = 0; l < num_layers(); ++l)
      for (std::size_t e = 0; e < entries.size(); ++e)
        if (entries[e].spec.layer == global_layer(l) && holders[e].size() == 1) {
          ParameterSpec spec = entries[e].spec;
          spec.layer = l;
          specs.push_back(std::move(spec));
          order.push_back(e);
        }
    layout_ = ParameterLayout(std::move(specs));

    for (std::size_t i = 0; i < order.size(); ++i) {
      const auto& mine = layout_.entries()[i];
      const auto& theirs = entries[order[i]];
      segments_.push_back({mine.offset, theirs.offset, mine.numel(), mine.spec.tied_copy});
      if (holders[order[i]].size() > 1)
        tied_.push_back({mine.spec.name, mine.offset, mine.numel(), holders[order[i]]});
    }
    // Each local layer's pieces: the entries it owns here (tied ones for layer 0) and the
    // entries its model layer reads.
    pieces_.assign(static_cast<std::size_t>(num_layers()), {});
    for (int l = 0; l < num_layers(); ++l) {
      std::vector<Piece> pieces;
      for (std::size_t i = 0; i < order.size(); ++i) {
        const auto& mine = layout_.entries()[i];
        bool reads_it = mine.spec.layer == l;
        for (const ElementRange& r : reads[static_cast<std::size_t>(global_layer(l))])
          reads_it = reads_it || intersects(r, entries[order[i]]);
        if (reads_it) pieces.push_back({mine.offset, mine.offset + mine.numel(), entries[order[i]].offset});
      }
      // Merge pieces contiguous in both layouts (fewer view windows).
      std::vector<Piece>& merged = pieces_[static_cast<std::size_t>(l)];
      for (const Piece& p : pieces)
        if (!merged.empty() && merged.back().end == p.begin &&
            merged.back().model_begin + (merged.back().end - merged.back().begin) == p.model_begin)
          merged.back().end = p.end;
        else
          merged.push_back(p);
    }
  }

  static bool intersects(const ElementRange& r, const ParameterLayout::Entry& e) {
    return r.begin < e.offset + e.numel() && e.offset < r.end && e.numel() > 0;
  }

  //! `view` (stage layout) as the model's layer sees its parameters (model layout).
  template <class T>
  ParameterView<T> to_model(int layer, const ParameterView<T>& view) const {
    ParameterView<T> out;
    view.for_each_window([&](std::int64_t begin, std::int64_t end, T* data) {
      for (const Piece& p : pieces_[static_cast<std::size_t>(layer)]) {
        const std::int64_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
        if (lo < hi) out.add(p.model_begin + (lo - p.begin), p.model_begin + (hi - p.begin), data + (lo - begin));
      }
    });
    return out;
  }

  //! `a` with its fp32 gradient sums (if any) as the model's layer sees them.
  BackwardArgs<scalar_type> to_model(int layer, const BackwardArgs<scalar_type>& a) const {
    BackwardArgs<scalar_type> out = a;
    out.fp32_grads = to_model(layer, a.fp32_grads);
    return out;
  }

  M model_;
  int stages_ = 1, stage_ = 0;
  std::vector<Chunk> chunks_;
  std::vector<int> global_;  // model layer of each local layer
  ParameterLayout layout_;
  std::vector<Segment> segments_;
  std::vector<TiedParameter> tied_;
  std::vector<std::vector<Piece>> pieces_;
};

}  // namespace loom
