// The CUDA vocabulary-parallel embedding and cross-entropy kernels: the vocabulary split into
// 1, 2 and 3 slices (with padding), each slice run on the device with the group's reductions
// done here in slice order, against plain host loops in double, and against host float loops in
// the CPU kernels' order where the result must be the same bits (embedding forward and backward,
// the per-slice max and target logits).
//
// Without a GPU the host cases run (the shared shape checks and their messages, which the
// kernels call before any CUDA call), then the program exits with 77 and ctest reports it
// skipped.
//
// Tolerances (|device - reference| <= tolerance * max(magnitude, 1)):
// - losses and dlogits: 1e-5 of |reference| (expf is within 2 ulp; the sums of exps are in
//   double, rescaled as each thread's running max rises);
// - embedding gradients: a sequential fp32 sum of k terms is within k * 2^-24 of the sum of
//   |terms|, so max(1e-5, k * 2^-24) of that sum, k being the longest run of one token plus one
//   (the exact bits are checked against the host float loop besides).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "device_check.hpp"
#include "host_block.hpp"
#include "loom/backend/cuda/vocab_parallel.cuh"
#include "loom/backend/detail/vocab_parallel_checks.hpp"
#include "loom/core/buffer.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

using DeviceIds = DeviceArray<std::int32_t>;
using DeviceDoubles = DeviceArray<double>;

constexpr std::int32_t int32_min = std::numeric_limits<std::int32_t>::min();
constexpr std::int32_t int32_max = std::numeric_limits<std::int32_t>::max();

//! Rows [first, first + count) of a row-major table with C columns.
std::vector<float> table_rows(const std::vector<float>& table, std::int64_t first, std::int64_t count,
                              std::int64_t C) {
  return {table.begin() + first * C, table.begin() + (first + count) * C};
}

//! Columns [first, first + count) of a row-major [rows, columns] matrix.
std::vector<float> matrix_columns(const std::vector<float>& full, std::int64_t rows, std::int64_t columns,
                                  std::int64_t first, std::int64_t count) {
  std::vector<float> out(static_cast<std::size_t>(rows * count));
  for (std::int64_t n = 0; n < rows; ++n)
    for (std::int64_t j = 0; j < count; ++j) out[n * count + j] = full[n * columns + first + j];
  return out;
}

//! How many of `got` differ in bits from `want` (NaN never equals); one CHECK per tensor.
void check_same_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(got[i] == want[i]) || std::signbit(got[i]) != std::signbit(want[i])) {
      if (bad == 0) first = i;
      ++bad;
    }
  std::ostringstream message;
  message << what << ": " << bad << " of " << got.size() << " elements differ in bits";
  if (bad > 0) message << "; first at " << first << ": got " << got[first] << ", expected " << want[first];
  INFO(message.str());
  CHECK(bad == 0);
}

// ------------------------------------------------------------------------------------------
// Embedding.

struct EmbeddingCase {
  std::int64_t B, T, C, vocab, padded, max_T;
};

//! Ids cycling through the vocabulary (repeats, every slice).
std::vector<std::int32_t> cycling_tokens(const EmbeddingCase& c) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(c.B * c.T));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int32_t>((7 * i + 2) % c.vocab);
  return t;
}

//! One id almost everywhere (a segment longer than a block), a few others between.
std::vector<std::int32_t> repeated_tokens(const EmbeddingCase& c, std::int32_t id) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(c.B * c.T), id);
  for (std::size_t i = 0; i < t.size(); i += 97) t[i] = static_cast<std::int32_t>(i % c.vocab);
  return t;
}

//! B * T distinct ids (a permutation: 37 is coprime to the vocabularies used), every segment one long.
std::vector<std::int32_t> distinct_tokens(const EmbeddingCase& c) {
  REQUIRE(c.vocab >= c.B * c.T);
  std::vector<std::int32_t> t(static_cast<std::size_t>(c.B * c.T));
  for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int32_t>((37 * i + 5) % c.vocab);
  return t;
}

//! The forward and backward on each of `slices` slices of a [padded, C] table, against host
//! float loops in the CPU kernels' order (the same bits) and against double references; the
//! backward twice from the same gradients (the same bits).
void check_embedding(loom::cuda& be, const EmbeddingCase& c, const std::vector<std::int32_t>& tokens,
                     std::int64_t slices, std::uint32_t seed) {
  CAPTURE(c.B);
  CAPTURE(c.T);
  CAPTURE(c.C);
  CAPTURE(c.vocab);
  CAPTURE(c.padded);
  CAPTURE(slices);
  REQUIRE(c.padded % slices == 0);
  const std::int64_t B = c.B, Tn = c.T, C = c.C, N = B * Tn, rows = c.padded / slices;
  const std::vector<float> wte = random_floats(c.padded * C, seed), wpe = random_floats(c.max_T * C, seed + 1),
                           dout = random_floats(N * C, seed + 2), dwte0 = random_floats(c.padded * C, seed + 3),
                           dwpe0 = random_floats(c.max_T * C, seed + 4);
  const DeviceIds ids(be, tokens, Shape{B, Tn});
  const DeviceTensor wpe_device(be, wpe, Shape{c.max_T, C}), dout_device(be, dout, Shape{B, Tn, C});

  // Forward: slice 0 adds the positions. Each slice's output is a copy or one float sum, so it
  // has exact expected bits; the sum over slices (the all-reduce) is checked against double.
  std::vector<float> summed(static_cast<std::size_t>(N * C), 0.0f);
  for (std::int64_t s = 0; s < slices; ++s) {
    CAPTURE(s);
    const std::int64_t begin = s * rows;
    const bool with_positions = s == 0;
    const DeviceTensor slice(be, table_rows(wte, begin, rows, C), Shape{rows, C});
    const DeviceTensor out(be, std::vector<float>(static_cast<std::size_t>(N * C), 99.0f), Shape{B, Tn, C});
    vocab_parallel_embedding_forward<float>(be, out.view(), ids.cview(), slice.cview(), begin,
                                            with_positions ? wpe_device.cview() : Tensor<const float>{});
    std::vector<float> want(static_cast<std::size_t>(N * C));
    for (std::int64_t bt = 0; bt < N; ++bt) {
      const std::int64_t local = static_cast<std::int64_t>(tokens[bt]) - begin;
      const bool in_slice = local >= 0 && local < rows;
      for (std::int64_t j = 0; j < C; ++j) {
        const float token = in_slice ? wte[(begin + local) * C + j] : 0.0f;
        const float position = wpe[(bt % Tn) * C + j];
        want[bt * C + j] = in_slice && with_positions ? token + position
                           : in_slice                 ? token
                           : with_positions           ? position
                                                      : 0.0f;
      }
    }
    const std::vector<float> got = out.to_host(be);
    check_same_bits(got, want, "out of one slice");
    for (std::size_t i = 0; i < got.size(); ++i) summed[i] += got[i];
  }
  std::vector<double> want_sum(static_cast<std::size_t>(N * C));
  for (std::int64_t bt = 0; bt < N; ++bt) {
    const bool known = tokens[bt] >= 0 && tokens[bt] < c.padded;
    for (std::int64_t j = 0; j < C; ++j)
      want_sum[bt * C + j] = (known ? static_cast<double>(wte[tokens[bt] * C + j]) : 0.0) + wpe[(bt % Tn) * C + j];
  }
  check_close(summed, want_sum, float_tolerance, "out summed over the slices");

  // Backward, onto non-zero gradients. The longest run of one id sets the double tolerance.
  std::map<std::int32_t, std::int64_t> repeats;
  for (const std::int32_t id : tokens) ++repeats[id];
  std::int64_t longest = B;  // dwpe sums B rows per element
  for (const auto& [id, count] : repeats) longest = std::max(longest, count);
  const double sum_tolerance = std::max(float_tolerance, static_cast<double>(longest + 1) * 0x1p-24);

  std::vector<float> dwte_all(static_cast<std::size_t>(c.padded * C));
  for (std::int64_t s = 0; s < slices; ++s) {
    CAPTURE(s);
    const std::int64_t begin = s * rows;
    std::vector<float> want_dwte = table_rows(dwte0, begin, rows, C), want_dwpe = dwpe0;
    for (std::int64_t bt = 0; bt < N; ++bt) {  // the CPU kernel's loop: (b, t) order, float
      const std::int64_t local = static_cast<std::int64_t>(tokens[bt]) - begin;
      for (std::int64_t j = 0; j < C; ++j) {
        if (local >= 0 && local < rows) want_dwte[local * C + j] += dout[bt * C + j];
        want_dwpe[(bt % Tn) * C + j] += dout[bt * C + j];
      }
    }
    std::vector<float> first_dwte, first_dwpe;
    for (int run = 0; run < 2; ++run) {
      CAPTURE(run);
      const DeviceTensor dwte(be, table_rows(dwte0, begin, rows, C), Shape{rows, C}),
          dwpe(be, dwpe0, Shape{c.max_T, C});
      const std::size_t workspace = be.memory().current(MemoryCategory::workspace);
      vocab_parallel_embedding_backward<float>(be, dwte.view(), begin, dwpe.view(), dout_device.cview(),
                                               ids.cview());
      CHECK(be.memory().current(MemoryCategory::workspace) == workspace);  // the sort's scratch was returned
      const std::vector<float> got_dwte = dwte.to_host(be), got_dwpe = dwpe.to_host(be);
      check_same_bits(got_dwte, want_dwte, "dwte slice against the host float loop in (b, t) order");
      check_same_bits(got_dwpe, want_dwpe, "dwpe against the host float loop in (b, t) order");
      if (run == 0) {
        first_dwte = got_dwte;
        first_dwpe = got_dwpe;
      } else {
        CHECK(got_dwte == first_dwte);  // exact bits over two runs
        CHECK(got_dwpe == first_dwpe);
      }
    }
    {
      // bf16 rows into fp32 sums (TrainerOptions::fp32_gradient_fusion): the host float loop over
      // the bf16 values, bit for bit (nothing rounded to bf16).
      const std::vector<bf16> dout16 = cast_to<bf16>(dout);
      std::vector<float> want_dwte32 = table_rows(dwte0, begin, rows, C), want_dwpe32 = dwpe0;
      for (std::int64_t bt = 0; bt < N; ++bt) {
        const std::int64_t local = static_cast<std::int64_t>(tokens[bt]) - begin;
        for (std::int64_t j = 0; j < C; ++j) {
          const float g = static_cast<float>(dout16[bt * C + j]);
          if (local >= 0 && local < rows) want_dwte32[local * C + j] += g;
          want_dwpe32[(bt % Tn) * C + j] += g;
        }
      }
      const DeviceArray<bf16> dout16_device(be, dout16, Shape{B, Tn, C});
      const DeviceTensor dwte(be, table_rows(dwte0, begin, rows, C), Shape{rows, C}), dwpe(be, dwpe0, Shape{c.max_T, C});
      vocab_parallel_embedding_backward<bf16>(be, dwte.view(), begin, dwpe.view(), dout16_device.cview(), ids.cview());
      check_same_bits(dwte.to_host(be), want_dwte32, "fp32 dwte slice from bf16 rows");
      check_same_bits(dwpe.to_host(be), want_dwpe32, "fp32 dwpe from bf16 rows");
    }
    std::copy(first_dwte.begin(), first_dwte.end(), dwte_all.begin() + begin * C);
    // The double reference of dwpe (every slice gets the whole position gradient).
    std::vector<double> want_dwpe_exact(dwpe0.begin(), dwpe0.end()), dwpe_magnitude = abs_of(want_dwpe_exact);
    for (std::int64_t bt = 0; bt < N; ++bt)
      for (std::int64_t j = 0; j < C; ++j) {
        want_dwpe_exact[(bt % Tn) * C + j] += dout[bt * C + j];
        dwpe_magnitude[(bt % Tn) * C + j] += std::abs(dout[bt * C + j]);
      }
    check_close(first_dwpe, want_dwpe_exact, dwpe_magnitude, sum_tolerance, "dwpe against double");
  }
  std::vector<double> want_dwte_exact(dwte0.begin(), dwte0.end()), dwte_magnitude = abs_of(want_dwte_exact);
  for (std::int64_t bt = 0; bt < N; ++bt) {
    if (tokens[bt] < 0 || tokens[bt] >= c.padded) continue;  // no slice's row
    for (std::int64_t j = 0; j < C; ++j) {
      want_dwte_exact[tokens[bt] * C + j] += dout[bt * C + j];
      dwte_magnitude[tokens[bt] * C + j] += std::abs(dout[bt * C + j]);
    }
  }
  check_close(dwte_all, want_dwte_exact, dwte_magnitude, sum_tolerance, "dwte (slices together) against double");
}

// ------------------------------------------------------------------------------------------
// Cross-entropy.

//! N rows over a padded vocabulary split into `slices` equal slices.
struct CrossEntropyCase {
  std::int64_t N, vocab, padded, slices;
  std::int64_t rows() const { return padded / slices; }
};

std::vector<std::int32_t> make_targets(const CrossEntropyCase& c) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(c.N));
  for (std::int64_t n = 0; n < c.N; ++n)
    t[n] = n == 1 ? -1 : static_cast<std::int32_t>((7919 * n + 3) % c.vocab);  // row 1 ignored; spread over slices
  return t;
}

//! Logits [N, padded] in [-4, 4) on real columns, huge on padding (which must never count).
std::vector<float> make_logits(const CrossEntropyCase& c, std::uint32_t seed) {
  std::vector<float> x = random_floats(c.N * c.padded, seed, -4.0f, 4.0f);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t i = c.vocab; i < c.padded; ++i) x[n * c.padded + i] = 1e4f;
  return x;
}

struct Sliced {
  std::vector<float> losses, dlogits;  // dlogits [N, padded], the slices put back together
};

//! Step 1 on every slice on the device (each keeping its own max), the group's max here in slice
//! order, step 2 (the rebase) on the device and the sum here in slice order, as the all-reduces of
//! a tensor-parallel group would (one slice: step 1 alone, as a group of one runs it); then the
//! losses and the backward from the logits on every slice. `in_place`: dlogits over the logits
//! (as the heads call it). Checks on the way the exact parts: each slice's max (and its copy) and
//! target logit, and that every slice gets the same losses.
Sliced run_sliced(loom::cuda& be, const CrossEntropyCase& c, const std::vector<float>& logits,
                  const std::vector<std::int32_t>& targets, float scale, bool in_place) {
  const std::int64_t N = c.N, R = c.rows();
  REQUIRE(c.padded % c.slices == 0);
  const DeviceIds target_device(be, targets, Shape{N});
  std::vector<DeviceTensor> slices;
  for (std::int64_t s = 0; s < c.slices; ++s)
    slices.emplace_back(be, matrix_columns(logits, N, c.padded, s * R, R), Shape{N, R});

  // Step 1: each slice's max (exact: the largest real logit as double, or the lowest double),
  // its sum below it, and the target's logit where the slice holds it.
  std::vector<double> global_max(static_cast<std::size_t>(N), std::numeric_limits<double>::lowest());
  std::vector<DeviceDoubles> own_max, own_partials;
  for (std::int64_t s = 0; s < c.slices; ++s) {
    const DeviceDoubles row_max(be, std::vector<double>(static_cast<std::size_t>(N), -9.0), Shape{N});
    own_max.emplace_back(be, std::vector<double>(static_cast<std::size_t>(N), -5.0), Shape{N});
    own_partials.emplace_back(be, std::vector<double>(static_cast<std::size_t>(2 * N), -9.0), Shape{2, N});
    vocab_parallel_cross_entropy_statistics<float>(be, row_max.view(), own_partials.back().view(), slices[s].cview(),
                                                   target_device.cview(), s * R, c.vocab, own_max.back().view());
    const std::vector<double> local = row_max.to_host(be), copy = own_max.back().to_host(be),
                              partials = own_partials.back().to_host(be);
    std::int64_t bad = 0;
    for (std::int64_t n = 0; n < N; ++n) {
      double want = std::numeric_limits<double>::lowest();
      for (std::int64_t j = 0; j < R && s * R + j < c.vocab; ++j)
        want = std::max(want, static_cast<double>(logits[n * c.padded + s * R + j]));
      const std::int64_t local_target = static_cast<std::int64_t>(targets[n]) - s * R;
      const bool owns = targets[n] >= 0 && targets[n] < c.vocab && local_target >= 0 && local_target < R;
      const double want_target = owns ? static_cast<double>(logits[n * c.padded + targets[n]]) : 0.0;
      bad += local[n] != want || copy[n] != want || partials[N + n] != want_target;
      bad += want == std::numeric_limits<double>::lowest() && partials[n] != 0.0;  // all padding: nothing summed
      global_max[n] = std::max(global_max[n], local[n]);
    }
    CAPTURE(s);
    CHECK(bad == 0);
  }

  // Step 2 and the sum (a group of one has nothing to rebase).
  const DeviceDoubles max_device(be, global_max, Shape{N});
  std::vector<double> partials(static_cast<std::size_t>(2 * N), 0.0);
  for (std::int64_t s = 0; s < c.slices; ++s) {
    if (c.slices > 1)
      vocab_parallel_cross_entropy_rebase(be, own_partials[s].view(), own_max[s].cview(), max_device.cview());
    const std::vector<double> local = own_partials[s].to_host(be);
    for (std::int64_t i = 0; i < 2 * N; ++i) partials[i] += local[i];
  }

  // The losses on every slice: every slice gets the same. Then the backward from the logits,
  // writing over garbage (or over the logits).
  const DeviceDoubles partials_device(be, partials, Shape{2, N});
  Sliced r{{}, std::vector<float>(static_cast<std::size_t>(N * c.padded))};
  for (std::int64_t s = 0; s < c.slices; ++s) {
    const DeviceTensor losses(be, std::vector<float>(static_cast<std::size_t>(N), -7.0f), Shape{N});
    vocab_parallel_cross_entropy_losses<float>(be, losses.view(), max_device.cview(), partials_device.cview(),
                                               target_device.cview());
    const std::vector<float> got = losses.to_host(be);
    if (s == 0) r.losses = got;
    CAPTURE(s);
    CHECK(got == r.losses);

    const DeviceTensor separate(be, std::vector<float>(static_cast<std::size_t>(N * R), 5.0f), Shape{N, R});
    const Tensor<float> dlogits = in_place ? slices[s].view() : separate.view();
    vocab_parallel_cross_entropy_backward<float>(be, dlogits, slices[s].cview(), max_device.cview(),
                                                 partials_device.cview(), target_device.cview(), s * R, c.vocab,
                                                 scale);
    std::vector<float> d(static_cast<std::size_t>(N * R));
    be.copy_to_host(d.data(), dlogits.data(), d.size() * sizeof(float));
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < R; ++j) r.dlogits[n * c.padded + s * R + j] = d[n * R + j];
  }
  return r;
}

//! The backward from probabilities on every slice on the device, put back together as
//! [N, padded]; `in_place`: over the probabilities.
std::vector<float> backward_from_probs(loom::cuda& be, const CrossEntropyCase& c, const std::vector<float>& probs,
                                       const std::vector<std::int32_t>& targets, float scale, bool in_place) {
  const std::int64_t N = c.N, R = c.rows();
  const DeviceIds target_device(be, targets, Shape{N});
  std::vector<float> out(static_cast<std::size_t>(N * c.padded));
  for (std::int64_t s = 0; s < c.slices; ++s) {
    const DeviceTensor p(be, matrix_columns(probs, N, c.padded, s * R, R), Shape{N, R});
    const DeviceTensor separate(be, std::vector<float>(static_cast<std::size_t>(N * R), 5.0f), Shape{N, R});
    const Tensor<float> dlogits = in_place ? p.view() : separate.view();
    vocab_parallel_cross_entropy_backward<float>(be, dlogits, p.cview(), target_device.cview(), s * R, c.vocab,
                                                 scale);
    std::vector<float> d(static_cast<std::size_t>(N * R));
    be.copy_to_host(d.data(), dlogits.data(), d.size() * sizeof(float));
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < R; ++j) out[n * c.padded + s * R + j] = d[n * R + j];
  }
  return out;
}

struct CrossEntropyReference {
  std::vector<double> losses, probs, dlogits;
};

//! Plain double reference over the whole vocabulary. A target outside [0, vocab) is no slice's:
//! a negative one ignores the row (loss 0, no gradient), a larger one (invalid: the caller's
//! check) has no slice's target logit, so the statistics carry 0 for it: its loss is the row's
//! log-sum-exp, as the CPU kernels compute it.
CrossEntropyReference reference(const CrossEntropyCase& c, const std::vector<float>& logits,
                                const std::vector<std::int32_t>& targets, double scale) {
  CrossEntropyReference r{std::vector<double>(static_cast<std::size_t>(c.N)),
                          std::vector<double>(static_cast<std::size_t>(c.N * c.padded), 0.0),
                          std::vector<double>(static_cast<std::size_t>(c.N * c.padded), 0.0)};
  for (std::int64_t n = 0; n < c.N; ++n) {
    const float* row = logits.data() + n * c.padded;
    double max = std::numeric_limits<double>::lowest();
    for (std::int64_t i = 0; i < c.vocab; ++i) max = std::max(max, static_cast<double>(row[i]));
    double sum = 0;
    for (std::int64_t i = 0; i < c.vocab; ++i) sum += std::exp(row[i] - max);
    for (std::int64_t i = 0; i < c.vocab; ++i) r.probs[n * c.padded + i] = std::exp(row[i] - max) / sum;
    const bool valid = targets[n] >= 0 && targets[n] < c.vocab;
    r.losses[n] = targets[n] >= 0 ? std::log(sum) - ((valid ? row[targets[n]] : 0.0) - max) : 0.0;
    if (targets[n] < 0) continue;
    for (std::int64_t i = 0; i < c.vocab; ++i) r.dlogits[n * c.padded + i] = scale * r.probs[n * c.padded + i];
    if (valid) r.dlogits[n * c.padded + targets[n]] -= scale;
  }
  return r;
}

//! The sliced run against the double reference; padding exactly 0.
void check_cross_entropy(const Sliced& got, const CrossEntropyReference& want, const CrossEntropyCase& c) {
  check_close(got.losses, want.losses, float_tolerance, "losses");
  check_close(got.dlogits, want.dlogits, float_tolerance, "dlogits");
  std::int64_t nonzero_padding = 0;
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t i = c.vocab; i < c.padded; ++i) nonzero_padding += got.dlogits[n * c.padded + i] != 0.0f;
  CHECK(nonzero_padding == 0);
}

// ------------------------------------------------------------------------------------------
// Host cases: the shape checks every kernel runs before any CUDA call (shared with the CPU
// kernels; they never read ids, which live on the device).

TEST_CASE("the shared embedding shape checks name the kernel and the argument, and never read ids") {
  namespace d = detail::vocab_parallel;
  float storage[64] = {};
  const std::vector<std::int32_t> ids{-1, -5, int32_max, int32_min, 3, 7};  // values are not checked here
  const Tensor<const std::int32_t> tokens(ids.data(), Shape{2, 3});
  const Tensor<const float> slice(storage, Shape{4, 5}), wpe(storage, Shape{3, 5});
  constexpr const char* forward = "vocab_parallel_embedding_forward";
  const d::EmbeddingDims dims = d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}), tokens, slice, 8,
                                                          wpe, forward, "out", "wte_slice", "wpe");
  CHECK(dims.batch == 2);
  CHECK(dims.seq == 3);
  CHECK(dims.channels == 5);
  CHECK_NOTHROW(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}), tokens, slice, 0,
                                          Tensor<const float>{}, forward, "out", "wte_slice", "wpe"));
  CHECK_THROWS_WITH_AS(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 4}), tokens, slice, 0, wpe,
                                                 forward, "out", "wte_slice", "wpe"),
                       "loom: vocab_parallel_embedding_forward: argument out shape: got [2, 3, 4]; expected [2, 3, 5]",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}),
                                                 Tensor<const std::int32_t>(ids.data(), Shape{6}), slice, 0, wpe,
                                                 forward, "out", "wte_slice", "wpe"),
                       "loom: vocab_parallel_embedding_forward: argument tokens shape: got [6]; expected [B, T] "
                       "(rank 2)",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}), tokens,
                                                 Tensor<const float>(storage, Shape{20}), 0, wpe, forward, "out",
                                                 "wte_slice", "wpe"),
                       doctest::Contains("argument wte_slice shape: got [20]; expected a [rows, C] slice"), Error);
  CHECK_THROWS_WITH_AS(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}), tokens, slice, -1, wpe,
                                                 forward, "out", "wte_slice", "wpe"),
                       "loom: vocab_parallel_embedding_forward: argument vocab_begin: got -1; must be >= 0", Error);
  CHECK_THROWS_WITH_AS(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}), tokens, slice, 0,
                                                 Tensor<const float>(storage, Shape{2, 5}), forward, "out",
                                                 "wte_slice", "wpe"),
                       "loom: vocab_parallel_embedding_forward: argument tokens sequence length T: got 3; must be <= "
                       "the rows of wpe (2)",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_embedding_shapes(Tensor<float>(storage, Shape{2, 3, 5}), tokens, slice, 0,
                                                 Tensor<const float>(storage, Shape{3, 4}), forward, "out",
                                                 "wte_slice", "wpe"),
                       "loom: vocab_parallel_embedding_forward: argument wpe shape: got [3, 4]; expected [3, 5]",
                       Error);
}

TEST_CASE("the shared cross-entropy shape checks name the kernel and the argument, and never read targets") {
  namespace d = detail::vocab_parallel;
  float storage[64] = {};
  double statistics[16] = {};
  const std::vector<std::int32_t> ids{int32_max, -3, int32_min};  // values are not checked here
  const Tensor<const std::int32_t> targets(ids.data(), Shape{3});
  const Tensor<const float> logits(storage, Shape{3, 4});
  const Tensor<float> exps(storage, Shape{3, 4});
  const Tensor<double> row_max(statistics, Shape{3}), partials(statistics, Shape{2, 3});

  constexpr const char* statistics_kernel = "vocab_parallel_cross_entropy_statistics";
  const d::CrossEntropyDims dims =
      d::check_statistics(row_max, partials, logits, targets, 6, 8, Tensor<double>{}, statistics_kernel);
  CHECK(dims.rows == 3);
  CHECK(dims.slice_columns == 4);
  CHECK(dims.real_columns == 2);  // columns 6, 7 of vocab 8; 8, 9 are padding
  CHECK(d::check_slice(logits, 12, 8, "k", "logits").real_columns == 0);  // all padding
  CHECK(d::check_slice(logits, 0, 100, "k", "logits").real_columns == 4);
  CHECK_NOTHROW(d::check_statistics(row_max, partials, logits, targets, 0, 8, Tensor<double>(statistics + 8, Shape{3}),
                                    statistics_kernel));
  CHECK_THROWS_WITH_AS(d::check_statistics(Tensor<double>(statistics, Shape{2}), partials, logits, targets, 0, 8,
                                           Tensor<double>{}, statistics_kernel),
                       "loom: vocab_parallel_cross_entropy_statistics: argument row_max element count: got 2; "
                       "expected 3",
                       Error);
  CHECK_THROWS_WITH_AS(
      d::check_statistics(row_max, partials, logits, targets, 0, 0, Tensor<double>{}, statistics_kernel),
      "loom: vocab_parallel_cross_entropy_statistics: argument vocab: got 0; must be >= 1", Error);
  CHECK_THROWS_WITH_AS(d::check_statistics(row_max, partials, Tensor<const float>(storage, Shape{}), targets, 0, 8,
                                           Tensor<double>{}, statistics_kernel),
                       "loom: vocab_parallel_cross_entropy_statistics: argument logits shape: got []; expected [N, Vs] "
                       "(rank >= 1)",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_statistics(row_max, Tensor<double>(statistics, Shape{3}), logits, targets, 0, 8,
                                           Tensor<double>{}, statistics_kernel),
                       doctest::Contains("argument partials element count: got 3; expected 6"), Error);
  CHECK_THROWS_WITH_AS(d::check_statistics(row_max, partials, logits,
                                           Tensor<const std::int32_t>(ids.data(), Shape{2}), 0, 8, Tensor<double>{},
                                           statistics_kernel),
                       "loom: vocab_parallel_cross_entropy_statistics: argument targets element count: got 2; "
                       "expected 3",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_statistics(row_max, partials, logits, targets, 0, 8,
                                           Tensor<double>(statistics + 8, Shape{4}), statistics_kernel),
                       doctest::Contains("argument slice_max element count: got 4; expected 3"), Error);

  constexpr const char* rebase = "vocab_parallel_cross_entropy_rebase";
  CHECK(d::check_rebase(partials, Tensor<const double>(row_max), Tensor<const double>(row_max), rebase) == 3);
  CHECK_THROWS_WITH_AS(d::check_rebase(partials, Tensor<const double>(statistics, Shape{2}),
                                       Tensor<const double>(row_max), rebase),
                       "loom: vocab_parallel_cross_entropy_rebase: argument slice_max element count: got 2; expected 3",
                       Error);

  constexpr const char* losses_kernel = "vocab_parallel_cross_entropy_losses";
  const Tensor<float> losses(storage + 32, Shape{3});
  CHECK(d::check_losses(losses, Tensor<const double>(row_max), Tensor<const double>(partials), targets,
                        losses_kernel) == 3);
  CHECK_THROWS_WITH_AS(d::check_losses(Tensor<float>(storage + 32, Shape{4}), Tensor<const double>(row_max),
                                       Tensor<const double>(partials), targets, losses_kernel),
                       "loom: vocab_parallel_cross_entropy_losses: argument losses element count: got 4; expected 3",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_losses(losses, Tensor<const double>(statistics, Shape{2}),
                                       Tensor<const double>(partials), targets, losses_kernel),
                       doctest::Contains("argument row_max element count: got 2; expected 3"), Error);

  constexpr const char* backward = "vocab_parallel_cross_entropy_backward";
  CHECK_NOTHROW(d::check_backward(exps, logits, targets, 0, 8, backward));
  CHECK_THROWS_WITH_AS(d::check_backward(Tensor<float>(storage, Shape{2, 6}), logits, targets, 0, 8, backward),
                       "loom: vocab_parallel_cross_entropy_backward: argument dlogits shape: got [2, 6]; expected "
                       "[3, 4]",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_backward(exps, logits, targets, -2, 8, backward),
                       "loom: vocab_parallel_cross_entropy_backward: argument vocab_begin: got -2; must be >= 0",
                       Error);
  CHECK_THROWS_WITH_AS(d::check_backward(Tensor<float>(nullptr, Shape{3, 4}), logits, targets, 0, 8, backward),
                       doctest::Contains("argument dlogits: got a tensor without data"), Error);
  CHECK_NOTHROW(d::check_backward_from_logits(exps, logits, Tensor<const double>(row_max),
                                              Tensor<const double>(partials), targets, 0, 8, backward));
  CHECK_THROWS_WITH_AS(d::check_backward_from_logits(exps, logits, Tensor<const double>(row_max),
                                                     Tensor<const double>(statistics, Shape{5}), targets, 0, 8,
                                                     backward),
                       doctest::Contains("argument partials element count: got 5; expected 6"), Error);
}

TEST_CASE("launch sizes of the vocab-parallel kernels and the sort's key for other slices' ids") {
  namespace v = detail::cuda_vocab_parallel;
  CHECK(v::blocks_for_rows(1) == 1);
  CHECK(v::blocks_for_rows(7) == 7);
  CHECK(v::blocks_for_rows(std::int64_t{1} << 40) == v::max_row_blocks);
  CHECK(v::row_threads % 32 == 0);
  CHECK(v::row_threads <= 1024);
  CHECK(v::not_in_slice_key(25152) == 25152u);  // GPT-2's padded 50304 over two ranks: 15 bits sorted
  CHECK(v::not_in_slice_key(std::int64_t{1} << 40) == 0x80000000u);  // above every int32 local id
}

// ------------------------------------------------------------------------------------------
// Device cases: return at once without a GPU.

TEST_CASE("vocab_parallel_embedding over 1, 2, 3 slices: the CPU kernels' bits, +=, two runs alike") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  std::uint32_t seed = 10;
  for (const std::int64_t C : {1, 7, 65, 300}) {
    const EmbeddingCase c{3, 5, C, 50, 54, 7};  // 54 rows: 4 of padding; 54 = 2 x 27 = 3 x 18
    const EmbeddingCase prime{3, 5, C, 53, 54, 7};  // 15 distinct ids of 53
    for (const std::int64_t slices : {1, 2, 3}) {
      check_embedding(be, c, cycling_tokens(c), slices, seed += 10);
      check_embedding(be, prime, distinct_tokens(prime), slices, seed += 10);
    }
  }
}

TEST_CASE("vocab_parallel_embedding_backward: one token repeated over more rows than a block") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  std::uint32_t seed = 500;
  for (const std::int64_t C : {1, 65}) {
    const EmbeddingCase c{3, 701, C, 50, 54, 701};
    for (const std::int64_t slices : {1, 2, 3}) {
      check_embedding(be, c, repeated_tokens(c, 20), slices, seed += 10);  // id 20: slice 0, 0 or 1 of 1, 2, 3
      check_embedding(be, c, repeated_tokens(c, 0), slices, seed += 10);   // the first row
      check_embedding(be, c, repeated_tokens(c, 49), slices, seed += 10);  // the last real row
    }
  }
  // Every token the same: one segment of all B * T rows.
  const EmbeddingCase all_one{5, 333, 7, 50, 54, 333};
  check_embedding(be, all_one, std::vector<std::int32_t>(5 * 333, 30), 2, 900);
}

TEST_CASE("vocab_parallel_embedding: ids outside the table are no slice's rows (never read or written)") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const EmbeddingCase c{3, 5, 9, 50, 54, 6};
  // Invalid on purpose (the caller's host check rejects them): the device must stay in bounds.
  std::vector<std::int32_t> tokens = cycling_tokens(c);
  tokens[0] = -1;
  tokens[3] = int32_min;
  tokens[7] = int32_max;
  tokens[8] = 54;  // one past the padded table
  tokens[14] = -54;
  for (const std::int64_t slices : {1, 2, 3}) check_embedding(be, c, tokens, slices, 1000 + slices);
}

TEST_CASE("vocab_parallel_embedding: empty batches and slices of no rows do nothing") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const DeviceTensor dwte(be, random_floats(4 * 3, 1), Shape{4, 3}), dwpe(be, random_floats(2 * 3, 2), Shape{2, 3});
  const std::vector<float> dwte0 = dwte.to_host(be), dwpe0 = dwpe.to_host(be);
  const DeviceIds none(be, {}, Shape{0, 2});
  vocab_parallel_embedding_forward<float>(be, Tensor<float>(nullptr, Shape{0, 2, 3}), none.cview(), dwte.cview(), 0,
                                          dwpe.cview());
  vocab_parallel_embedding_backward<float>(be, dwte.view(), 0, dwpe.view(),
                                           Tensor<const float>(nullptr, Shape{0, 2, 3}), none.cview());
  CHECK(dwte.to_host(be) == dwte0);
  CHECK(dwpe.to_host(be) == dwpe0);
  // A slice of no rows: only the position gradient.
  const DeviceIds ids(be, {0, 1, 2, 3}, Shape{2, 2});
  const std::vector<float> dout = random_floats(2 * 2 * 3, 3);
  const DeviceTensor dout_device(be, dout, Shape{2, 2, 3});
  vocab_parallel_embedding_backward<float>(be, Tensor<float>(nullptr, Shape{0, 3}), 4, dwpe.view(),
                                           dout_device.cview(), ids.cview());
  std::vector<float> want = dwpe0;
  for (std::int64_t bt = 0; bt < 4; ++bt)
    for (std::int64_t j = 0; j < 3; ++j) want[(bt % 2) * 3 + j] += dout[bt * 3 + j];
  CHECK(dwpe.to_host(be) == want);
  be.synchronize();
}

TEST_CASE("select_target_rows: the kept rows in order and their count, across 1024-row tiles, within its room") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const std::int64_t N : {0, 1, 5, 1023, 1024, 1025, 2049, 5000}) {
    CAPTURE(N);
    for (const int pattern : {0, 1, 2}) {  // none kept, all kept, about 15% kept
      CAPTURE(pattern);
      std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
      std::uint32_t state = 12345u + static_cast<std::uint32_t>(N);
      for (auto& t : targets) {
        state = state * 1664525u + 1013904223u;
        const bool kept = pattern == 1 || (pattern == 2 && (state >> 8) % 100 < 15);
        t = kept ? static_cast<std::int32_t>((state >> 12) % 30522) : -1;
      }
      // The CPU kernel's contract: the kept rows in order, then the initial values untouched.
      std::vector<std::int32_t> want_rows(static_cast<std::size_t>(N), -7), want_targets = want_rows;
      std::int64_t want = 0;
      for (std::int64_t n = 0; n < N; ++n)
        if (targets[n] >= 0) {
          want_rows[want] = static_cast<std::int32_t>(n);
          want_targets[want++] = targets[n];
        }
      const DeviceIds device_targets(be, targets, Shape{N}), rows(be, std::vector<std::int32_t>(N, -7), Shape{N}),
          row_targets(be, std::vector<std::int32_t>(N, -7), Shape{N});
      const std::int64_t M = select_target_rows(be, rows.view(), row_targets.view(), device_targets.cview());
      CHECK(M == want);
      CHECK(rows.to_host(be) == want_rows);  // and past M untouched, as on the CPU
      CHECK(row_targets.to_host(be) == want_targets);
      // Room for half the rows: the first half written, the whole count returned.
      const std::int64_t room = N / 2;
      const DeviceIds few_rows(be, std::vector<std::int32_t>(room, -7), Shape{room}),
          few_targets(be, std::vector<std::int32_t>(room, -7), Shape{room});
      CHECK(select_target_rows(be, few_rows.view(), few_targets.view(), device_targets.cview()) == want);
      CHECK(few_rows.to_host(be) == std::vector<std::int32_t>(want_rows.begin(), want_rows.begin() + room));
      CHECK(few_targets.to_host(be) == std::vector<std::int32_t>(want_targets.begin(), want_targets.begin() + room));
    }
  }
}

//! The backward's row body on the host (host_block.hpp), W columns a pack, over one slice holding
//! the whole vocabulary: from the logits with their statistics in double, or from the
//! probabilities, into a copy of `in` (in place) or into a tensor of 5s.
template <int W, bool FromLogits>
std::vector<float> backward_on_host(const CrossEntropyCase& c, const std::vector<float>& in,
                                    const std::vector<std::int32_t>& targets, float scale, bool in_place) {
  namespace cvp = detail::cuda_vocab_parallel;
  REQUIRE(c.slices == 1);
  std::vector<double> row_max(static_cast<std::size_t>(c.N)), partials(static_cast<std::size_t>(2 * c.N));
  for (std::int64_t n = 0; n < c.N; ++n) {
    const float* row = in.data() + n * c.padded;
    row_max[n] = *std::max_element(row, row + c.vocab);
    for (std::int64_t i = 0; i < c.vocab; ++i) partials[n] += std::exp(row[i] - row_max[n]);
  }
  std::vector<float> source = in, separate(in.size(), 5.0f);
  float* out = in_place ? source.data() : separate.data();
  run_grid(
      c.N, 1, 0,
      [&](HostThread& th) {
        cvp::backward_row<float, W, FromLogits>(th, out, source.data(), row_max.data(), partials.data(),
                                                targets.data(), th.block_x(), c.padded, c.vocab, 0, scale);
      },
      cvp::row_threads);
  return in_place ? source : separate;
}

TEST_CASE("the cross-entropy backward's row body matches the double reference, in place or not (host emulation)") {
  // Rows of one pack, of more packs than the block's threads (the two-pack loop and a single
  // last one), GPT-2's vocabulary; an odd width (W = 1 only) with targets outside [0, vocab).
  for (const CrossEntropyCase c : {CrossEntropyCase{5, 7, 8, 1}, CrossEntropyCase{4, 1000, 1200, 1},
                                   CrossEntropyCase{3, 50257, 50304, 1}, CrossEntropyCase{7, 10, 21, 1}}) {
    CAPTURE(c.N);
    CAPTURE(c.padded);
    const std::vector<float> logits = make_logits(c, 13);
    std::vector<std::int32_t> targets = make_targets(c);
    if (c.padded == 21) targets = {3, -1, 10, 25, int32_max, int32_min, 9};
    const CrossEntropyReference want = reference(c, logits, targets, 0.25);
    const std::vector<float> probs(want.probs.begin(), want.probs.end());
    for (const bool in_place : {false, true}) {
      CAPTURE(in_place);
      const auto check = [&](const std::vector<float>& got, const char* what) {
        check_close(got, want.dlogits, float_tolerance, what);
        std::int64_t nonzero_padding = 0;
        for (std::int64_t n = 0; n < c.N; ++n)
          for (std::int64_t i = c.vocab; i < c.padded; ++i) nonzero_padding += got[n * c.padded + i] != 0.0f;
        CHECK(nonzero_padding == 0);
      };
      check(backward_on_host<1, true>(c, logits, targets, 0.25f, in_place), "dlogits, W = 1");
      check(backward_on_host<1, false>(c, probs, targets, 0.25f, in_place), "dlogits from probabilities, W = 1");
      if (c.padded % 4 != 0) continue;
      check(backward_on_host<4, true>(c, logits, targets, 0.25f, in_place), "dlogits, W = 4");
      check(backward_on_host<4, false>(c, probs, targets, 0.25f, in_place), "dlogits from probabilities, W = 4");
    }
  }
}

//! What the fused row body and the three it replaces write, as floats.
struct FusedRows {
  std::vector<float> losses, dlogits;
  std::vector<double> row_max, partials;
};

//! The statistics kernel's rows (row_statistics and thread 0's writes), the losses (loss_of) and
//! the backward's rows from the logits in place, each as a grid on the host: the three kernels a
//! group of one ran before the fused one. T = float or bf16, W values a pack.
template <class T, int W>
FusedRows three_bodies_on_host(const CrossEntropyCase& c, const std::vector<T>& logits,
                               const std::vector<std::int32_t>& targets, float scale) {
  namespace cvp = detail::cuda_vocab_parallel;
  using P = detail::cuda_kernels::Pack<T, W>;
  const std::int64_t N = c.N, used = (c.vocab + W - 1) / W;
  std::vector<double> row_max(static_cast<std::size_t>(N), -3.0), partials(static_cast<std::size_t>(2 * N), -5.0);
  run_grid(
      N, 1, cvp::reduction_bytes,
      [&](HostThread& th) {
        const std::int64_t n = th.block_x();
        const T* row = logits.data() + n * c.padded;
        const cvp::RowStatistics r = cvp::row_statistics<T, W>(th, reinterpret_cast<const P*>(row), used, c.vocab,
                                                               reinterpret_cast<double*>(th.shared()));
        if (th.thread() == 0) {
          row_max[n] = r.top;
          partials[n] = r.sum;
          partials[N + n] = cvp::target_logit(row, targets[n], c.vocab, 0);
        }
      },
      cvp::row_threads);
  FusedRows out{std::vector<float>(static_cast<std::size_t>(N)), {}, row_max, partials};
  for (std::int64_t n = 0; n < N; ++n) out.losses[n] = cvp::loss_of(row_max[n], partials[n], partials[N + n], targets[n]);
  std::vector<T> d = logits;
  run_grid(
      N, 1, 0,
      [&](HostThread& th) {
        cvp::backward_row<T, W, true>(th, d.data(), d.data(), row_max.data(), partials.data(), targets.data(),
                                      th.block_x(), c.padded, c.vocab, 0, scale);
      },
      cvp::row_threads);
  out.dlogits = floats_of(d);
  return out;
}

//! The fused row body on the host, the row staged in the block's shared memory or not.
template <class T, int W, bool Staged>
FusedRows fused_on_host(const CrossEntropyCase& c, const std::vector<T>& logits,
                        const std::vector<std::int32_t>& targets, float scale) {
  namespace cvp = detail::cuda_vocab_parallel;
  const std::int64_t N = c.N;
  std::vector<float> losses(static_cast<std::size_t>(N), -7.0f);
  std::vector<double> row_max(static_cast<std::size_t>(N), -3.0), partials(static_cast<std::size_t>(2 * N), -5.0);
  std::vector<T> d = logits;
  const std::size_t bytes = Staged ? cvp::staged_bytes<T, W>(c.vocab) : cvp::reduction_bytes;
  run_grid(
      N, 1, bytes,
      [&](HostThread& th) {
        cvp::forward_backward_row<T, W, Staged>(th, d.data(), losses.data(), row_max.data(), partials.data(),
                                                targets.data(), th.block_x(), N, c.padded, c.vocab, scale);
      },
      cvp::row_threads);
  return {losses, floats_of(d), row_max, partials};
}

template <class T, int W>
void check_fused_on_host(const CrossEntropyCase& c, const std::vector<T>& logits,
                         const std::vector<std::int32_t>& targets, float scale) {
  const FusedRows want = three_bodies_on_host<T, W>(c, logits, targets, scale);
  for (const FusedRows& got : {fused_on_host<T, W, true>(c, logits, targets, scale),
                               fused_on_host<T, W, false>(c, logits, targets, scale)}) {
    check_same_bits(got.losses, want.losses, "losses");
    check_same_bits(got.dlogits, want.dlogits, "dlogits");
    CHECK(got.row_max == want.row_max);
    CHECK(got.partials == want.partials);
  }
  // And right: the double reference of the logits as they are (rounded to T).
  if constexpr (std::is_same_v<T, float>) {
    const CrossEntropyReference ref = reference(c, logits, targets, scale);
    check_close(want.losses, ref.losses, float_tolerance, "losses against the double reference");
    check_close(want.dlogits, ref.dlogits, float_tolerance, "dlogits against the double reference");
  }
}

TEST_CASE("the fused cross-entropy row body gives the statistics, losses and backward bodies' bits (host emulation)") {
  // A row of one pack; rows wider than the block's threads and than eight packs a thread (the
  // staging's batches and its tail); GPT-2's vocabulary; an odd width (W = 1 only) with targets
  // outside [0, vocab).
  for (const CrossEntropyCase c : {CrossEntropyCase{5, 7, 8, 1}, CrossEntropyCase{4, 1000, 1200, 1},
                                   CrossEntropyCase{3, 20000, 20000, 1}, CrossEntropyCase{2, 50257, 50304, 1},
                                   CrossEntropyCase{7, 10, 21, 1}}) {
    CAPTURE(c.N);
    CAPTURE(c.vocab);
    CAPTURE(c.padded);
    const std::vector<float> logits = make_logits(c, 19);
    std::vector<std::int32_t> targets = make_targets(c);
    if (c.padded == 21) targets = {3, -1, 10, 25, int32_max, int32_min, 9};
    check_fused_on_host<float, 1>(c, logits, targets, 0.25f);
    if (c.padded % 8 != 0) continue;
    check_fused_on_host<float, 4>(c, logits, targets, 0.25f);
    check_fused_on_host<bf16, 1>(c, cast_to<bf16>(logits), targets, 1.0f / 3.0f);
    check_fused_on_host<bf16, 8>(c, cast_to<bf16>(logits), targets, 1.0f / 3.0f);
  }
}

TEST_CASE("cross_entropy_forward_backward on the GPU: the three kernels' bits, staged or not, and the gradient kept") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // Rows staged in shared memory (bf16 and float at 1,200 columns, bf16 at GPT-2's vocabulary) and
  // read twice (float at GPT-2's vocabulary: 201 KB a row, more than two blocks an SM hold); one
  // unaligned width.
  for (const CrossEntropyCase c : {CrossEntropyCase{6, 1000, 1200, 1}, CrossEntropyCase{4, 50257, 50304, 1},
                                   CrossEntropyCase{7, 10, 21, 1}}) {
    CAPTURE(c.N);
    CAPTURE(c.padded);
    const std::int64_t N = c.N;
    const std::vector<float> logits = make_logits(c, 29);
    const std::vector<std::int32_t> targets = make_targets(c);
    const DeviceIds target_device(be, targets, Shape{N});
    const auto both = [&]<class T>(const std::vector<T>& x, float scale) {
      // The three kernels, as vocab_parallel_loss runs them for evaluation...
      const DeviceArray<T> unfused(be, x, Shape{N, c.padded}), fused(be, x, Shape{N, c.padded});
      const DeviceDoubles row_max(be, std::vector<double>(N, -3.0), Shape{N}),
          partials(be, std::vector<double>(2 * N, -5.0), Shape{2, N}),
          fused_max(be, std::vector<double>(N, -3.0), Shape{N}),
          fused_partials(be, std::vector<double>(2 * N, -5.0), Shape{2, N}),
          flag(be, std::vector<double>{-1.0}, Shape{1});
      const DeviceTensor losses(be, std::vector<float>(N, -7.0f), Shape{N}),
          fused_losses(be, std::vector<float>(N, -7.0f), Shape{N});
      vocab_parallel_cross_entropy_statistics<T>(be, row_max.view(), partials.view(), unfused.cview(),
                                                 target_device.cview(), 0, c.vocab);
      vocab_parallel_cross_entropy_losses<T>(be, losses.view(), row_max.cview(), partials.cview(),
                                             target_device.cview());
      vocab_parallel_cross_entropy_backward<T>(be, unfused.view(), unfused.cview(), row_max.cview(), partials.cview(),
                                               target_device.cview(), 0, c.vocab, scale);
      // ... and fused.
      cross_entropy_forward_backward<T>(be, fused_losses.view(), fused_max.view(), fused_partials.view(), fused.view(),
                                        target_device.cview(), c.vocab, scale, flag.view());
      check_same_bits(fused_losses.to_host(be), losses.to_host(be), "losses");
      check_same_bits(floats_of(fused.to_host(be)), floats_of(unfused.to_host(be)), "dlogits");
      CHECK(fused_max.to_host(be) == row_max.to_host(be));
      CHECK(fused_partials.to_host(be) == partials.to_host(be));
      CHECK(flag.to_host(be) == std::vector<double>{static_cast<double>(scale)});
      // The backward told that the gradient is there keeps it; at twice the scale, doubles it.
      vocab_parallel_cross_entropy_backward<T>(be, fused.view(), fused.cview(), fused_max.cview(),
                                               fused_partials.cview(), target_device.cview(), 0, c.vocab, scale,
                                               flag.cview());
      check_same_bits(floats_of(fused.to_host(be)), floats_of(unfused.to_host(be)), "dlogits kept");
      vocab_parallel_cross_entropy_backward<T>(be, fused.view(), fused.cview(), fused_max.cview(),
                                               fused_partials.cview(), target_device.cview(), 0, c.vocab,
                                               2.0f * scale, flag.cview());
      std::vector<float> doubled = floats_of(unfused.to_host(be));
      for (float& v : doubled) v = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(v)) * 2.0f));
      check_same_bits(floats_of(fused.to_host(be)), doubled, "dlogits rescaled");
    };
    both(logits, 0.25f);
    both(cast_to<bf16>(logits), 1.0f / 3.0f);
  }
}

TEST_CASE("vocab_parallel_cross_entropy over 1, 2, 3 slices matches the double reference, in place or not") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // One slice; padding in the last slice; a slice that is all padding (10 of 21 over 3; 1 of
  // 3 over 3); rows wider than a block (600 columns); GPT-2's vocabulary, whole and over 2
  // slices. Slices of a multiple of 4 columns run the 16-byte kernels, the others element by
  // element.
  for (const CrossEntropyCase c :
       {CrossEntropyCase{5, 7, 8, 1}, CrossEntropyCase{5, 50, 52, 2}, CrossEntropyCase{7, 10, 21, 3},
        CrossEntropyCase{4, 1, 3, 3}, CrossEntropyCase{6, 1000, 1200, 2}, CrossEntropyCase{3, 1000, 1002, 3},
        CrossEntropyCase{3, 50257, 50304, 1}, CrossEntropyCase{2, 50257, 50304, 2}}) {
    CAPTURE(c.N);
    CAPTURE(c.vocab);
    CAPTURE(c.padded);
    CAPTURE(c.slices);
    const std::vector<float> logits = make_logits(c, 11);
    const std::vector<std::int32_t> targets = make_targets(c);
    const CrossEntropyReference want = reference(c, logits, targets, 0.25);
    Sliced first;
    for (const bool in_place : {false, true}) {
      CAPTURE(in_place);
      const Sliced got = run_sliced(be, c, logits, targets, 0.25f, in_place);
      check_cross_entropy(got, want, c);
      if (!in_place) {
        first = got;
        continue;
      }
      // In place or not, the same bits; and the same bits again on a second run.
      CHECK(got.losses == first.losses);
      CHECK(got.dlogits == first.dlogits);
      const Sliced again = run_sliced(be, c, logits, targets, 0.25f, in_place);
      CHECK(again.losses == got.losses);
      CHECK(again.dlogits == got.dlogits);
    }
    // The backward from probabilities (the reference's), in place or not.
    const std::vector<float> probs(want.probs.begin(), want.probs.end());
    for (const bool in_place : {false, true}) {
      CAPTURE(in_place);
      check_close(backward_from_probs(be, c, probs, targets, 0.25f, in_place), want.dlogits, float_tolerance,
                  "dlogits from the probabilities");
    }
  }
}

TEST_CASE("vocab_parallel_cross_entropy: targets outside [0, vocab) are no slice's (never read)") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const CrossEntropyCase c{7, 10, 21, 3};
  const std::vector<float> logits = make_logits(c, 12);
  // -1 and int32_min ignore their rows; 10 (a padding column), 25 and int32_max are invalid (the
  // caller's host check rejects them) and must stay in bounds: no slice holds them.
  const std::vector<std::int32_t> targets{3, -1, 10, 25, int32_max, int32_min, 9};
  for (const bool in_place : {false, true}) {
    CAPTURE(in_place);
    check_cross_entropy(run_sliced(be, c, logits, targets, 0.5f, in_place), reference(c, logits, targets, 0.5), c);
  }
}

TEST_CASE("vocab_parallel kernels reject wrong shapes before any CUDA call, naming the argument") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  Buffer<float, loom::cuda> buffer(be, 64, MemoryCategory::workspace);
  Buffer<double, loom::cuda> statistics(be, 16, MemoryCategory::workspace);
  const DeviceIds ids(be, {0, 1, 2, 3, 4, 5}, Shape{2, 3});
  const Tensor<const std::int32_t> targets(ids.buffer.data(), Shape{6});
  const Tensor<float> x(buffer.data(), Shape{6, 4});
  CHECK_THROWS_WITH_AS(vocab_parallel_embedding_forward<float>(
                           be, Tensor<float>(buffer.data(), Shape{2, 3, 5}), ids.cview(),
                           Tensor<const float>(buffer.data(), Shape{4, 4}), 0, Tensor<const float>{}),
                       "loom: vocab_parallel_embedding_forward: argument out shape: got [2, 3, 5]; expected [2, 3, 4]",
                       Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_embedding_backward<float>(be, Tensor<float>(buffer.data(), Shape{4, 4}), 0,
                                                                Tensor<float>(buffer.data(), Shape{2, 4}),
                                                                Tensor<const float>(buffer.data(), Shape{2, 3, 4}),
                                                                ids.cview()),
                       doctest::Contains("argument tokens sequence length T: got 3; must be <= the rows of dwpe (2)"),
                       Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_cross_entropy_statistics<float>(
                           be, Tensor<double>(statistics.data(), Shape{5}),
                           Tensor<double>(statistics.data(), Shape{2, 6}), x, targets, 0, 4),
                       doctest::Contains("vocab_parallel_cross_entropy_statistics: argument row_max element count"),
                       Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_cross_entropy_statistics<float>(
                           be, Tensor<double>(statistics.data(), Shape{6}),
                           Tensor<double>(statistics.data(), Shape{2, 6}), x,
                           Tensor<const std::int32_t>(ids.buffer.data(), Shape{5}), 0, 4),
                       doctest::Contains("vocab_parallel_cross_entropy_statistics: argument targets element count"),
                       Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_cross_entropy_rebase(be, Tensor<double>(statistics.data(), Shape{2, 6}),
                                                           Tensor<const double>(statistics.data(), Shape{5}),
                                                           Tensor<const double>(statistics.data(), Shape{6})),
                       doctest::Contains("vocab_parallel_cross_entropy_rebase: argument slice_max element count"),
                       Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_cross_entropy_losses<float>(be, Tensor<float>(buffer.data(), Shape{5}),
                                                                  Tensor<const double>(statistics.data(), Shape{6}),
                                                                  Tensor<const double>(statistics.data(), Shape{2, 6}),
                                                                  targets),
                       doctest::Contains("vocab_parallel_cross_entropy_losses: argument losses element count"), Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_cross_entropy_backward<float>(
                           be, x, x, Tensor<const double>(statistics.data(), Shape{6}),
                           Tensor<const double>(statistics.data(), Shape{7}), targets, 0, 4, 1.0f),
                       doctest::Contains("vocab_parallel_cross_entropy_backward: argument partials element count"),
                       Error);
  CHECK_THROWS_WITH_AS(vocab_parallel_cross_entropy_backward<float>(be, Tensor<float>(buffer.data(), Shape{4, 6}), x,
                                                                    targets, 0, 4, 1.0f),
                       doctest::Contains("vocab_parallel_cross_entropy_backward: argument dlogits shape"), Error);
  be.synchronize();  // nothing was launched, nothing failed
}

}  // namespace

int main(int argc, char** argv) { return loom::cuda_test::run_tests(argc, argv); }
