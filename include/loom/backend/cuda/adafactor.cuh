#pragma once
//! \file Adafactor's kernels on the CUDA backend, with the CPU kernels' contracts
//! (backend/cpu/adafactor.hpp, the reference): the squared gradients summed per row and per
//! column of the whole tensor, the squared norm of the unclipped update, and the update itself,
//! each over one run of a rank's slice that a WholeIndex places in the whole tensor.
//!
//! The sums are deterministic: every launch shape and every order of additions is a function of
//! the element count and the matrix view only, never of the GPU, and no floating-point atomics.
//!
//! - Rows: the whole tensor's flat index grows with the run's element index (for whole tensors
//!   and for both splits), so the elements of one row are a contiguous range of the run, found
//!   by binary search; one warp sums each row in a fixed order and adds it to its output.
//! - Columns: block k takes chunk k of the run (consecutive elements) and sums it per column
//!   into its own row of workspace, thread t owning the columns j with j % threads == t (so no
//!   two threads add into one partial); a second launch adds the chunks' partials in chunk order.
//! - A vector is an [n, 1] matrix: each row is one element, its one column a block sum per chunk.
//!
//! The chunked kernels walk their chunk a stretch at a time (elements at consecutive columns of
//! one row), so that rows and columns are divided out once per stretch, not per element; a
//! matrix of few columns therefore keeps few threads of a block busy (GPT-2's have 768 or more).

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/cuda/reduction.cuh"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/tensor.hpp"
#include "loom/core/whole_index.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom::detail::cuda_adafactor {

//! Gradient (and parameter) element types these kernels take.
template <class T>
inline constexpr bool supported = cuda_kernels::supported<T> || std::is_same_v<T, double>;

//! Threads per block of the chunked kernels (one chunk of the run per block).
inline constexpr int threads = 256;
//! A chunk holds at least this many elements, and a launch has at most max_chunks of them.
inline constexpr std::int64_t min_chunk_elements = 8192;
inline constexpr std::int64_t max_chunks = 1024;
//! The column partials take at most this many doubles of workspace (32 MiB): wide matrices get
//! fewer, longer chunks.
inline constexpr std::int64_t max_column_partials = std::int64_t{1} << 22;

//! Chunks (blocks) of a run of n > 0 elements: a function of n only.
inline std::int64_t chunks_for(std::int64_t n) noexcept {
  return std::clamp<std::int64_t>((n + min_chunk_elements - 1) / min_chunk_elements, 1, max_chunks);
}

//! Chunks of the column sums of n > 0 elements over `cols` columns: a function of both only.
inline std::int64_t column_chunks_for(std::int64_t n, std::int64_t cols) noexcept {
  return std::min(chunks_for(n), std::max<std::int64_t>(1, max_column_partials / cols));
}

//! The first element of chunk k of `chunks` over n elements (chunk_begin(n, chunks, chunks) = n).
LOOM_HD inline std::int64_t chunk_begin(std::int64_t n, std::int64_t chunks, std::int64_t k) noexcept {
  return n * k / chunks;
}

//! Warps per block of the row sums, and at most this many blocks (grid-stride over rows).
inline constexpr int row_warps = cuda_kernels::warps_per_block;
inline constexpr std::int64_t max_row_blocks = cuda_kernels::max_elementwise_blocks;

//! Run elements [first, first + count) at consecutive positions of one line of the whole matrix:
//! along a row, or down the one column of a vector ([n, 1]: consecutive elements are rows).
struct Stretch {
  std::int64_t first, count, row, col;
  bool down;
  __device__ std::int64_t row_of(std::int64_t o) const { return down ? row + o : row; }
  __device__ std::int64_t col_of(std::int64_t o) const { return down ? col : col + o; }
};

//! Calls f(stretch) for the stretches that make up run elements [begin, end), in order. Every
//! thread of a block walks the same stretches.
template <class F>
__device__ void for_each_stretch(const WholeIndex& w, std::int64_t begin, std::int64_t end, F&& f) {
  const bool down = w.cols == 1;
  std::int64_t i = begin;
  while (i < end) {
    const std::int64_t flat = w.flat(i);
    const std::int64_t row = flat / w.cols, col = flat % w.cols;
    std::int64_t count = min(end - i, w.consecutive(i));
    if (!down) count = min(count, w.cols - col);
    f(Stretch{i, count, row, col, down});
    i += count;
  }
}

//! The first run element in [0, n] whose row is at least `row` (rows grow with the element).
__device__ inline std::int64_t first_of_row(const WholeIndex& w, std::int64_t n, std::int64_t row) {
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (w.row(mid) < row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

//! g² in double, as the CPU kernel forms it.
template <class G>
__device__ inline double square(G g) {
  const double x = static_cast<double>(to_accumulate(g));
  return x * x;
}

//! row_sums[row] += the sum of g² over the run's elements in `row`, for rows first_row + r,
//! r < row_count: one warp per row, lanes striding along it, then the warp's butterfly sum.
template <class G>
__global__ void row_sums_kernel(double* row_sums, const G* g, WholeIndex w, std::int64_t n, std::int64_t first_row,
                                std::int64_t row_count) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t r = cuda_kernels::grid_first() / 32; r < row_count; r += warps) {
    const std::int64_t row = first_row + r;
    const std::int64_t begin = first_of_row(w, n, row), end = first_of_row(w, n, row + 1);
    if (begin == end) continue;  // a row of another rank's piece (the same for the whole warp)
    double sum = 0;
    for (std::int64_t i = begin + lane; i < end; i += 32) sum += square(g[i]);
    sum = cuda_kernels::warp_sum(sum);
    if (lane == 0) row_sums[row] += sum;
  }
}

//! The row sums of a vector ([n, 1]): each row holds one element, so each thread adds its own.
template <class G>
__global__ void vector_row_sums_kernel(double* row_sums, const G* g, WholeIndex w, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride())
    row_sums[w.flat(i)] += square(g[i]);
}

//! partials[chunk][j] = the sum of g² over the chunk's elements in column j (0 where it has
//! none); thread t sums the columns j with j % blockDim.x == t, in element order. A vector's one
//! column is a block sum instead.
template <class G>
__global__ void column_partials_kernel(double* partials, const G* g, WholeIndex w, std::int64_t n) {
  const std::int64_t chunks = gridDim.x, chunk = blockIdx.x, cols = w.cols;
  const std::int64_t t = threadIdx.x, stride = blockDim.x;
  const std::int64_t begin = chunk_begin(n, chunks, chunk), end = chunk_begin(n, chunks, chunk + 1);
  double* mine = partials + chunk * cols;
  if (cols == 1) {
    __shared__ double scratch[32];
    double sum = 0;
    for (std::int64_t i = begin + t; i < end; i += stride) sum += square(g[i]);
    sum = cuda_kernels::block_sum(sum, scratch);
    if (t == 0) mine[0] = sum;
    return;
  }
  for (std::int64_t j = t; j < cols; j += stride) mine[j] = 0;
  for_each_stretch(w, begin, end, [&](const Stretch& s) {
    // The first o with (s.col + o) % stride == t.
    for (std::int64_t o = ((t - s.col) % stride + stride) % stride; o < s.count; o += stride)
      mine[s.col + o] += square(g[s.first + o]);
  });
}

//! col_sums[j] += the chunks' partials of column j, added in chunk order.
template <class A>
__global__ void column_totals_kernel(A* col_sums, const A* partials, std::int64_t chunks, std::int64_t cols) {
  const std::int64_t j = cuda_kernels::grid_first();
  if (j >= cols) return;
  A total = 0;
  for (std::int64_t k = 0; k < chunks; ++k) total += partials[k * cols + j];
  col_sums[j] += total;
}

//! partial[chunk] = the sum over the chunk of (g · row_scale[row] · col_scale[col])², the
//! product formed in A as on the CPU, squared and summed in double.
template <class G, class A>
__global__ void update_partials_kernel(double* partial, const G* g, WholeIndex w, std::int64_t n,
                                       const A* row_scale, const A* col_scale) {
  __shared__ double scratch[32];
  const std::int64_t chunks = gridDim.x, chunk = blockIdx.x;
  double sum = 0;
  for_each_stretch(w, chunk_begin(n, chunks, chunk), chunk_begin(n, chunks, chunk + 1), [&](const Stretch& s) {
    for (std::int64_t o = threadIdx.x; o < s.count; o += blockDim.x) {
      const A u = to_accumulate(g[s.first + o]) * row_scale[s.row_of(o)] * col_scale[s.col_of(o)];
      sum += static_cast<double>(u) * static_cast<double>(u);
    }
  });
  sum = cuda_kernels::block_sum(sum, scratch);
  if (threadIdx.x == 0) partial[chunk] = sum;
}

//! Products and differences rounded one by one, as the CPU computes them: nvcc would otherwise
//! fuse p · decay − step · u into an FMA, whose single rounding gives other bits.
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ inline double sub_rn(double a, double b) { return __dsub_rn(a, b); }

//! p = p · decay − step · (g · row_scale[row] · col_scale[col]) in A; where R is not A (bf16
//! parameters beside their fp32 master `p`), each updated element is rounded into `rounded`.
template <class A, class G, class R>
__global__ void update_kernel(A* p, const G* g, R* rounded, std::int64_t n, WholeIndex w, const A* row_scale,
                              const A* col_scale, A decay, A step) {
  const std::int64_t chunks = gridDim.x, chunk = blockIdx.x;
  for_each_stretch(w, chunk_begin(n, chunks, chunk), chunk_begin(n, chunks, chunk + 1), [&](const Stretch& s) {
    for (std::int64_t o = threadIdx.x; o < s.count; o += blockDim.x) {
      const std::int64_t i = s.first + o;
      const A u = mul_rn(mul_rn(to_accumulate(g[i]), row_scale[s.row_of(o)]), col_scale[s.col_of(o)]);
      const A value = sub_rn(mul_rn(p[i], decay), mul_rn(step, u));
      p[i] = value;
      if constexpr (!std::is_same_v<R, A>) rounded[i] = static_cast<R>(value);
    }
  });
}

//! Enqueues the update of n > 0 elements (see update_kernel).
template <class A, class G, class R>
void enqueue_update(const cuda& be, A* p, const G* g, R* rounded, std::int64_t n, const WholeIndex& index,
                    const A* row_scale, const A* col_scale, const AdafactorUpdate& h) {
  cuda_kernels::activate(be);
  update_kernel<<<static_cast<unsigned>(chunks_for(n)), threads, 0, be.stream()>>>(
      p, g, rounded, n, index, row_scale, col_scale, static_cast<A>(h.decay), static_cast<A>(h.step));
  cuda_check_launch("adafactor_update");
}

//! Checks the matrix view and that the run's rows lie in [0, rows); `kernel` names the kernel.
inline void check_view(const WholeIndex& index, std::int64_t n, std::int64_t rows, const char* kernel) {
  LOOM_CHECK(rows >= 0 && index.cols >= 1, std::string(kernel) + ": matrix view",
             detail::to_text(rows) + " x " + detail::to_text(index.cols), "needs rows >= 0 and cols >= 1");
  if (n == 0) return;
  const std::int64_t first = index.row(0), last = index.row(n - 1);
  LOOM_CHECK(first >= 0 && last < rows, std::string(kernel) + ": rows of the run",
             detail::to_text(first) + " to " + detail::to_text(last),
             "must lie in the whole tensor's " + detail::to_text(rows) + " rows");
}

}  // namespace loom::detail::cuda_adafactor

namespace loom::inline kernels {

//! Adds, for each element g of `grads` (a run of a slice of one parameter whose elements
//! `index` places in the whole tensor seen as [rows, index.cols]), g² in double to
//! row_sums[row] and to col_sums[col] (device memory). Deterministic: the same bits on every run
//! and GPU (the order of additions depends on the element count and the view only). Takes
//! `cuda&` because the column partials come from the backend's allocator (workspace).
template <class G>
void adafactor_square_sums(cuda& be, Tensor<const G> grads, const WholeIndex& index, std::int64_t rows,
                           double* row_sums, double* col_sums) {
  namespace af = detail::cuda_adafactor;
  namespace k = detail::cuda_kernels;
  static_assert(af::supported<G>, "loom: adafactor's cuda kernels take float, double or bf16 gradients");
  constexpr const char* kernel = "adafactor_square_sums";
  if (grads.empty()) {
    af::check_view(index, 0, rows, kernel);
    return;
  }
  const std::int64_t n = grads.numel(), cols = index.cols;
  af::check_view(index, n, rows, kernel);
  k::activate(be);

  if (cols == 1) {
    af::vector_row_sums_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
        row_sums, grads.data(), index, n);
  } else {
    const std::int64_t first_row = index.row(0), row_count = index.row(n - 1) - first_row + 1;
    const std::int64_t row_blocks = std::min<std::int64_t>(k::row_blocks(row_count), af::max_row_blocks);
    af::row_sums_kernel<<<static_cast<unsigned>(row_blocks), 32 * af::row_warps, 0, be.stream()>>>(
        row_sums, grads.data(), index, n, first_row, row_count);
  }
  detail::cuda_check_launch("adafactor_square_sums (rows)");

  const std::int64_t chunks = af::column_chunks_for(n, cols);
  // Returned to the cache while the stream may still use it: safe, as in add_column_sums.
  const Buffer<double, cuda> partials(be, chunks * cols, MemoryCategory::workspace);
  af::column_partials_kernel<<<static_cast<unsigned>(chunks), af::threads, 0, be.stream()>>>(
      partials.data(), grads.data(), index, n);
  detail::cuda_check_launch("adafactor_square_sums (column partials)");
  const auto total_threads = static_cast<unsigned>(k::elementwise_threads);
  af::column_totals_kernel<<<static_cast<unsigned>((cols + total_threads - 1) / total_threads), total_threads, 0,
                             be.stream()>>>(col_sums, partials.data(), chunks, cols);
  detail::cuda_check_launch("adafactor_square_sums (column totals)");
}

//! The sum, in double, of (g · row_scale[row] · col_scale[col])² over `grads`: the squared norm
//! of this run's part of Adafactor's update before clipping (row_scale and col_scale in device
//! memory). Returns to the host, so it waits for the stream; deterministic as
//! adafactor_square_sums. Takes `cuda&` for its scratch (workspace).
template <class G, class A>
double adafactor_update_square_sum(cuda& be, Tensor<const G> grads, const WholeIndex& index, const A* row_scale,
                                   const A* col_scale) {
  namespace af = detail::cuda_adafactor;
  static_assert(af::supported<G>, "loom: adafactor's cuda kernels take float, double or bf16 gradients");
  if (grads.empty()) return 0.0;
  const std::int64_t n = grads.numel(), chunks = af::chunks_for(n);
  LOOM_CHECK(index.cols >= 1, "adafactor_update_square_sum: matrix view", index.cols, "needs cols >= 1");
  detail::cuda_kernels::activate(be);
  Buffer<double, cuda> scratch(be, chunks + 1, MemoryCategory::workspace);  // [partials | total]
  af::update_partials_kernel<<<static_cast<unsigned>(chunks), af::threads, 0, be.stream()>>>(
      scratch.data(), grads.data(), index, n, row_scale, col_scale);
  detail::cuda_check_launch("adafactor_update_square_sum");
  detail::cuda_reduction::total_kernel<<<1, detail::cuda_reduction::threads, 0, be.stream()>>>(
      scratch.data() + chunks, scratch.data(), chunks);
  detail::cuda_check_launch("adafactor_update_square_sum total_kernel");
  double total = 0;
  be.copy_to_host(&total, scratch.data() + chunks, sizeof(double));
  return total;
}

//! One Adafactor update of a run of float or double parameters: p = p · h.decay − h.step · g ·
//! row_scale[row] · col_scale[col] (scales in device memory), computed as the CPU kernel does
//! (each product rounded, no FMA), so it gives the CPU's bits where the CPU build does not
//! contract them into FMAs either.
template <class T>
void adafactor_update(const cuda& be, Tensor<T> params, Tensor<const T> grads, const WholeIndex& index,
                      const T* row_scale, const T* col_scale, const AdafactorUpdate& h) {
  static_assert(!is_narrow_storage<T>,
                "loom: adafactor_update on bf16 parameters steps their fp32 master weights: call the "
                "overload that takes `master`");
  static_assert(detail::cuda_adafactor::supported<T>, "loom: adafactor's cuda kernels take float or double parameters");
  check_numel(grads, params.numel(), "adafactor_update", "grads");
  if (params.empty()) return;
  check_data(grads, "adafactor_update", "grads");
  detail::cuda_adafactor::enqueue_update<T, T, T>(be, params.data(), grads.data(), nullptr, params.numel(), index,
                                                  row_scale, col_scale, h);
}

//! One Adafactor update of a run of bf16 parameters through their fp32 master weights, from
//! gradients of storage type G (the parameters' type, or fp32: TrainerOptions::fp32_gradients);
//! params = master rounded once.
template <class T, class G>
  requires is_narrow_storage<T>
void adafactor_update(const cuda& be, Tensor<T> params, Tensor<const G> grads, Tensor<accumulate_t<T>> master,
                      const WholeIndex& index, const accumulate_t<T>* row_scale, const accumulate_t<T>* col_scale,
                      const AdafactorUpdate& h) {
  static_assert(detail::cuda_adafactor::supported<G>, "loom: adafactor's cuda kernels take float or bf16 gradients");
  check_numel(grads, params.numel(), "adafactor_update", "grads");
  check_numel(master, params.numel(), "adafactor_update", "master");
  if (params.empty()) return;
  check_data(grads, "adafactor_update", "grads");
  check_data(master, "adafactor_update", "master");
  detail::cuda_adafactor::enqueue_update<accumulate_t<T>, G, T>(be, master.data(), grads.data(), params.data(),
                                                                params.numel(), index, row_scale, col_scale, h);
}

}  // namespace loom::inline kernels
