#pragma once
//! \file Causal attention of new positions against a key/value cache, on the CPU backend: the
//! attention of incremental decoding (text generation), where each new token's query meets the
//! keys and values of every earlier position, kept from the calls that computed them, instead of
//! a forward pass over the whole context. Inference only: there is no backward.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "loom/backend/cpu/attention.hpp"
#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom {
namespace detail::attention_decode {

//! Work (multiply-adds) below which one thread does it all: a single new token against a short
//! cache costs less than waking a team.
inline constexpr std::int64_t parallel_min_work = 1 << 16;

//! Checks every argument; returns the new rows.
template <class T>
std::int64_t check(const Tensor<T>& out, const Tensor<const T>& qkv, const Tensor<T>& keys, const Tensor<T>& values,
                   std::int64_t past, int num_heads) {
  constexpr const char* kernel = "attention_decode";
  if (qkv.shape().rank() != 2 || qkv.extent(1) % 3 != 0)
    throw Error(std::string(kernel) + ": argument qkv shape", qkv.shape(), "expected [rows, 3C]");
  const std::int64_t rows = qkv.extent(0), C = qkv.extent(1) / 3;
  if (num_heads < 1 || C % num_heads != 0)
    throw Error(std::string(kernel) + ": argument num_heads", num_heads,
                "must be >= 1 and divide the channels C = " + detail::to_text(C));
  check_shape(out, Shape{rows, C}, kernel, "out");
  if (keys.shape().rank() != 2 || keys.extent(1) != C)
    throw Error(std::string(kernel) + ": argument keys shape", keys.shape(),
                "expected [capacity, C = " + detail::to_text(C) + "]");
  check_shape(values, keys.shape(), kernel, "values");
  if (past < 0 || past + rows > keys.extent(0))
    throw Error(std::string(kernel) + ": argument past", past,
                "must be >= 0 and leave room for the " + detail::to_text(rows) + " new rows in the cache's " +
                    detail::to_text(keys.extent(0)) + " positions");
  return rows;
}

//! q · k over `n` elements in `lanes` independent partial sums, added pairwise at the end, which
//! the compiler can keep in vector registers (a single running sum is a chain of dependent adds
//! it may not reorder): the kernel took 0.217 ms in place of 0.259 for one token against 512
//! positions of GPT-2 small's 12 heads (one thread, float).
template <class A, class T>
A dot(const A* q, const T* k, std::int64_t n) noexcept {
  constexpr std::int64_t lanes = 16;
  A partial[lanes] = {};
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (std::int64_t l = 0; l < lanes; ++l) partial[l] += q[i + l] * to_accumulate(k[i + l]);
  for (; i < n; ++i) partial[i % lanes] += q[i] * to_accumulate(k[i]);
  for (std::int64_t width = lanes / 2; width > 0; width /= 2)
    for (std::int64_t l = 0; l < width; ++l) partial[l] += partial[l + width];
  return partial[0];
}

}  // namespace detail::attention_decode

//! Attention of `rows` new positions [past, past + rows) of one sequence against a key/value
//! cache (incremental decoding). `qkv` [rows, 3C] holds the new positions' queries, keys and
//! values (the layout attention_forward reads, one sequence); their keys and values are first
//! written into rows [past, past + rows) of `keys` and `values` [capacity, C], whose rows
//! [0, past) hold the earlier positions'. Then, per head of size hs = C / num_heads, out[t] =
//! softmax(q_t · K^T / sqrt(hs)) V over the cache rows [0, past + t] (the causal mask), as
//! attention_forward computes row past + t of the whole sequence: scores in the accumulate type,
//! the exponentials shifted by the row's largest score, their sum in double, out rounded once to
//! T. Rows into an empty cache (past 0, more than one: a prompt) take attention_forward_lse's
//! blocked GEMMs and give its bits; the others go one (row, head) at a time. No dropout and no
//! padding: generation runs neither.
template <class T>
void attention_decode(const cpu& be, Tensor<T> out, Tensor<const T> qkv, Tensor<T> keys, Tensor<T> values,
                      std::int64_t past, int num_heads) {
  using A = accumulate_t<T>;
  const std::int64_t rows = detail::attention_decode::check(out, qkv, keys, values, past, num_heads);
  if (rows == 0) return;
  const std::int64_t C = qkv.extent(1) / 3, NH = num_heads, hs = C / NH, seen_max = past + rows;
  const T* q_all = qkv.data();
  T* k_all = keys.data();
  T* v_all = values.data();
  for (std::int64_t t = 0; t < rows; ++t) {
    std::copy(q_all + t * 3 * C + C, q_all + t * 3 * C + 2 * C, k_all + (past + t) * C);
    std::copy(q_all + t * 3 * C + 2 * C, q_all + t * 3 * C + 3 * C, v_all + (past + t) * C);
  }
  if (past == 0 && rows > 1) {
    // A prompt into an empty cache: attention_forward_lse's blocked GEMMs, which at 512 rows of
    // GPT-2 small took a whole pass over the prompt from 0.95 s to about the full-context
    // forward's 0.53 s (row by row, each row's scores are a GEMV).
    std::vector<A> lse(static_cast<std::size_t>(NH * rows));
    attention_forward_lse<T>(be, out.reshape({1, rows, C}), Tensor<A>{lse.data(), Shape{1, NH, rows}},
                             qkv.reshape({1, rows, 3 * C}), num_heads);
    return;
  }
  const A scale = detail::attention::softmax_scale<A>(hs);
  const int threads = std::max(1, be.threads());
  // Per thread: one row's scores over every key it may see, and its query and output in A.
  const std::int64_t per_thread = seen_max + 2 * hs;
  std::vector<A> scratch(static_cast<std::size_t>(threads * per_thread));
  const std::int64_t work = rows * seen_max * C;
  T* o_all = out.data();
#pragma omp parallel num_threads(threads) if (work >= detail::attention_decode::parallel_min_work)
  {
    A* scores = scratch.data() + detail::thread_index() * per_thread;
    A* q = scores + seen_max;
    A* o = q + hs;
#pragma omp for schedule(static)
    for (std::int64_t th = 0; th < rows * NH; ++th) {
      const std::int64_t t = th / NH, h = th % NH, seen = past + t + 1;
      for (std::int64_t i = 0; i < hs; ++i) q[i] = to_accumulate(q_all[t * 3 * C + h * hs + i]);
      A max = -std::numeric_limits<A>::infinity();
      for (std::int64_t s = 0; s < seen; ++s) {
        const A dot = detail::attention_decode::dot(q, k_all + s * C + h * hs, hs);
        scores[s] = dot;
        max = std::max(max, dot);
      }
      double sum = 0;
      for (std::int64_t s = 0; s < seen; ++s) {
        scores[s] = std::exp((scores[s] - max) * scale);
        sum += static_cast<double>(scores[s]);
      }
      const A inverse = static_cast<A>(1.0 / sum);
      std::fill(o, o + hs, A(0));
      for (std::int64_t s = 0; s < seen; ++s) {
        const A p = scores[s] * inverse;
        const T* v = v_all + s * C + h * hs;
        for (std::int64_t i = 0; i < hs; ++i) o[i] += p * to_accumulate(v[i]);
      }
      for (std::int64_t i = 0; i < hs; ++i) o_all[t * C + h * hs + i] = static_cast<T>(o[i]);
    }
  }
}

}  // namespace loom
