// The runs and the CPU backend's Adafactor kernels on host vectors (see adafactor_reference.hpp),
// built by g++ with OpenMP.

#include "adafactor_reference.hpp"

#include <utility>

#include "loom/backend/cpu/adafactor.hpp"
#include "loom/core/parameters.hpp"

namespace loom::cuda_test::cpu_adafactor {

namespace {

const cpu& backend() {
  static const cpu be(4);
  return be;
}

//! Rank `rank`'s slice of a whole tensor of shape `whole` cut `partition`-wise into `groups`
//! blocks of `ranks` pieces.
ParameterSpec slice_of(Shape whole, Partition partition, std::int64_t groups, std::int64_t ranks, std::int64_t rank) {
  ParameterSpec spec;
  spec.name = "adafactor.case";
  spec.shape = whole;
  spec.partition = partition;
  spec.shard.groups = groups;
  return tensor_parallel_slice(spec, ranks, rank);
}

struct Case {
  std::string name;
  ParameterSpec spec;  //!< the rank's slice, its global shape filled in
  std::int64_t first = 0, tail = 0;
};

std::vector<Case> cases() {
  const Partition whole = Partition::replicated, rows = Partition::split_rows, cols = Partition::split_cols;
  return {
      {"whole [522, 390]", slice_of({522, 390}, whole, 1, 1, 0), 1237, 45},
      {"whole [96, 3006]", slice_of({96, 3006}, whole, 1, 1, 0), 4001, 17},
      {"split_rows groups=3 ranks=2 rank=0 of [522, 390]", slice_of({522, 390}, rows, 3, 2, 0), 391, 800},
      {"split_rows groups=3 ranks=2 rank=1 of [522, 390]", slice_of({522, 390}, rows, 3, 2, 1), 999, 3},
      {"split_cols ranks=2 rank=1 of [522, 390]", slice_of({522, 390}, cols, 1, 2, 1), 777, 101},
      {"split_cols groups=3 ranks=2 rank=0 of [96, 3006]", slice_of({96, 3006}, cols, 3, 2, 0), 2500, 9},
      {"split_cols groups=3 ranks=2 rank=1 of [96, 3006]", slice_of({96, 3006}, cols, 3, 2, 1), 1, 1},
      {"whole vector [40001]", slice_of({40001}, whole, 1, 1, 0), 3, 2},
      {"split_rows groups=3 ranks=2 rank=1 of vector [40002]", slice_of({40002}, rows, 3, 2, 1), 5, 2},
  };
}

template <class G>
void square_sums_of(const std::vector<G>& grads, const WholeIndex& index, std::vector<double>& row_sums,
                    std::vector<double>& col_sums) {
  LOOM_CHECK(static_cast<std::int64_t>(col_sums.size()) == index.cols, "cpu_adafactor::square_sums: col_sums",
             col_sums.size(), "must hold index.cols values");
  adafactor_square_sums<G>(backend(), Tensor<const G>(grads.data(), Shape{static_cast<std::int64_t>(grads.size())}),
                           index, static_cast<std::int64_t>(row_sums.size()), row_sums.data(), col_sums.data());
}

template <class G>
double update_square_sum_of(const std::vector<G>& grads, const WholeIndex& index, const std::vector<float>& row_scale,
                            const std::vector<float>& col_scale) {
  return adafactor_update_square_sum<G, float>(
      backend(), Tensor<const G>(grads.data(), Shape{static_cast<std::int64_t>(grads.size())}), index,
      row_scale.data(), col_scale.data());
}

template <class G>
void bf16_update(std::vector<bf16>& params, const std::vector<G>& grads, std::vector<float>& master,
                 const WholeIndex& index, const std::vector<float>& row_scale, const std::vector<float>& col_scale,
                 const AdafactorUpdate& h) {
  const Shape shape{static_cast<std::int64_t>(params.size())};
  adafactor_update<bf16, G>(backend(), Tensor<bf16>(params.data(), shape),
                            Tensor<const G>(grads.data(), Shape{static_cast<std::int64_t>(grads.size())}),
                            Tensor<float>(master.data(), Shape{static_cast<std::int64_t>(master.size())}), index,
                            row_scale.data(), col_scale.data(), h);
}

}  // namespace

std::vector<Run> runs() {
  std::vector<Run> out;
  for (const Case& c : cases()) {
    // From element `first` to about `tail` elements before the slice's end, one shorter where
    // that makes the length odd.
    std::int64_t count = c.spec.shape.numel() - c.first - c.tail;
    if (count % 2 == 0) --count;
    out.push_back({c.name, c.first, count, whole_index(c.spec, c.first), matrix_view(c.spec.whole_shape()),
                   out.size()});
  }
  return out;
}

std::vector<std::int64_t> global_indices(const Run& run) {
  const std::vector<Case> all = cases();
  LOOM_CHECK(run.number < all.size(), "cpu_adafactor::global_indices: run.number", run.number,
             "must be a place in runs()");
  const ParameterSpec& spec = all[run.number].spec;
  std::vector<std::int64_t> out(static_cast<std::size_t>(run.count));
  for (std::int64_t i = 0; i < run.count; ++i) out[static_cast<std::size_t>(i)] = spec.global_index(run.first + i);
  return out;
}

void square_sums(const std::vector<float>& grads, const WholeIndex& index, std::vector<double>& row_sums,
                 std::vector<double>& col_sums) {
  square_sums_of(grads, index, row_sums, col_sums);
}

void square_sums(const std::vector<bf16>& grads, const WholeIndex& index, std::vector<double>& row_sums,
                 std::vector<double>& col_sums) {
  square_sums_of(grads, index, row_sums, col_sums);
}

double update_square_sum(const std::vector<float>& grads, const WholeIndex& index, const std::vector<float>& row_scale,
                         const std::vector<float>& col_scale) {
  return update_square_sum_of(grads, index, row_scale, col_scale);
}

double update_square_sum(const std::vector<bf16>& grads, const WholeIndex& index, const std::vector<float>& row_scale,
                         const std::vector<float>& col_scale) {
  return update_square_sum_of(grads, index, row_scale, col_scale);
}

void update(std::vector<float>& params, const std::vector<float>& grads, const WholeIndex& index,
            const std::vector<float>& row_scale, const std::vector<float>& col_scale, const AdafactorUpdate& h) {
  adafactor_update<float>(backend(), Tensor<float>(params.data(), Shape{static_cast<std::int64_t>(params.size())}),
                          Tensor<const float>(grads.data(), Shape{static_cast<std::int64_t>(grads.size())}), index,
                          row_scale.data(), col_scale.data(), h);
}

void update(std::vector<bf16>& params, const std::vector<bf16>& grads, std::vector<float>& master,
            const WholeIndex& index, const std::vector<float>& row_scale, const std::vector<float>& col_scale,
            const AdafactorUpdate& h) {
  bf16_update(params, grads, master, index, row_scale, col_scale, h);
}

void update(std::vector<bf16>& params, const std::vector<float>& grads, std::vector<float>& master,
            const WholeIndex& index, const std::vector<float>& row_scale, const std::vector<float>& col_scale,
            const AdafactorUpdate& h) {
  bf16_update(params, grads, master, index, row_scale, col_scale, h);
}

}  // namespace loom::cuda_test::cpu_adafactor
