#pragma once
// The runs test_cuda_adafactor steps and the CPU backend's Adafactor kernels it compares with,
// built by g++ in adafactor_reference.cpp (the CPU kernels and ParameterSpec, whose OpenMP
// pragmas nvcc's host compiler would warn about, stay out of the nvcc translation unit). Host
// vectors in, host vectors out; four CPU threads.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/bf16.hpp"
#include "loom/core/whole_index.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom::cuda_test::cpu_adafactor {

//! One run of a rank's slice of a parameter: elements [first, first + count) of the slice.
struct Run {
  std::string name;
  std::int64_t first = 0, count = 0;
  WholeIndex index;  //!< loom::whole_index(spec, first)
  MatrixView view;   //!< matrix_view(spec.whole_shape())
  std::size_t number = 0;  //!< its place in runs(), which global_indices rebuilds its slice from
};

//! The runs: of a whole matrix, of split_rows and split_cols slices (fused blocks: groups = 3,
//! two tensor-parallel ranks) and of a vector, each starting at a nonzero element of its slice
//! with an odd length.
std::vector<Run> runs();

//! ParameterSpec::global_index(run.first + i) for each element i of the run.
std::vector<std::int64_t> global_indices(const Run& run);

//! adafactor_square_sums: adds each g² to row_sums[row] and col_sums[col] (rows: row_sums.size()).
void square_sums(const std::vector<float>& grads, const WholeIndex& index, std::vector<double>& row_sums,
                 std::vector<double>& col_sums);
void square_sums(const std::vector<bf16>& grads, const WholeIndex& index, std::vector<double>& row_sums,
                 std::vector<double>& col_sums);

//! adafactor_update_square_sum<G, float>.
double update_square_sum(const std::vector<float>& grads, const WholeIndex& index, const std::vector<float>& row_scale,
                         const std::vector<float>& col_scale);
double update_square_sum(const std::vector<bf16>& grads, const WholeIndex& index, const std::vector<float>& row_scale,
                         const std::vector<float>& col_scale);

//! adafactor_update of float parameters.
void update(std::vector<float>& params, const std::vector<float>& grads, const WholeIndex& index,
            const std::vector<float>& row_scale, const std::vector<float>& col_scale, const AdafactorUpdate& h);
//! adafactor_update of bf16 parameters through their fp32 master weights, from bf16 or float gradients.
void update(std::vector<bf16>& params, const std::vector<bf16>& grads, std::vector<float>& master,
            const WholeIndex& index, const std::vector<float>& row_scale, const std::vector<float>& col_scale,
            const AdafactorUpdate& h);
void update(std::vector<bf16>& params, const std::vector<float>& grads, std::vector<float>& master,
            const WholeIndex& index, const std::vector<float>& row_scale, const std::vector<float>& col_scale,
            const AdafactorUpdate& h);

}  // namespace loom::cuda_test::cpu_adafactor
