// attention_decode (attention against a key/value cache): fed a sequence's positions in chunks of
// any size, each row equals attention_forward's row of the whole sequence (double, float, bf16),
// the cache holds each position's key and value, the bits do not depend on the thread count, and
// bad arguments are refused by name.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "loom/backend/cpu/attention.hpp"
#include "loom/backend/cpu/attention_decode.hpp"
#include "loom/core/bf16.hpp"
#include "support/error_of.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_attention_decode {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t T_len = 37, C = 15;
constexpr int heads = 3;

//! qkv [T, 3C] of one sequence, uniform in [-2, 2).
template <class T>
std::vector<T> random_qkv(std::uint64_t seed) {
  const std::vector<float> values = random_vector<float>(static_cast<std::size_t>(T_len * 3 * C), seed, -2, 2);
  std::vector<T> out;
  for (float v : values) out.push_back(static_cast<T>(v));
  return out;
}

//! attention_forward's out [T, C] for the whole sequence.
template <class T>
std::vector<T> whole_sequence(const std::vector<T>& qkv) {
  cpu be(2);
  std::vector<T> out(static_cast<std::size_t>(T_len * C)), att(static_cast<std::size_t>(heads * T_len * T_len));
  attention_forward<T>(be, Tensor<T>{out.data(), Shape{1, T_len, C}}, Tensor<T>{att.data(), Shape{1, heads, T_len, T_len}},
                       Tensor<const T>{qkv.data(), Shape{1, T_len, 3 * C}}, heads);
  return out;
}

//! The sequence through attention_decode in chunks of `chunks` rows (summing to T), into a cache
//! of `capacity` positions: out [T, C], and the cache's keys and values.
template <class T>
struct Decoded {
  std::vector<T> out, keys, values;
};
template <class T>
Decoded<T> decode_in_chunks(const std::vector<T>& qkv, const std::vector<std::int64_t>& chunks, int threads,
                            std::int64_t capacity = T_len) {
  cpu be(threads);
  Decoded<T> d{std::vector<T>(static_cast<std::size_t>(T_len * C)), std::vector<T>(static_cast<std::size_t>(capacity * C)),
               std::vector<T>(static_cast<std::size_t>(capacity * C))};
  std::int64_t past = 0;
  for (std::int64_t rows : chunks) {
    attention_decode<T>(be, Tensor<T>{d.out.data() + past * C, Shape{rows, C}},
                        Tensor<const T>{qkv.data() + past * 3 * C, Shape{rows, 3 * C}},
                        Tensor<T>{d.keys.data(), Shape{capacity, C}}, Tensor<T>{d.values.data(), Shape{capacity, C}},
                        past, heads);
    past += rows;
  }
  REQUIRE(past == T_len);
  return d;
}

template <class T>
double as_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
double as_double(double x) {
  return x;
}

//! The largest |a - b| over the elements.
template <class T>
double max_difference(const std::vector<T>& a, const std::vector<T>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(as_double(a[i]) - as_double(b[i])));
  return worst;
}

}  // namespace

TEST_CASE_TEMPLATE("attention_decode: each row is attention_forward's row of the whole sequence", T, double, float, bf16) {
  const std::vector<T> qkv = random_qkv<T>(5);
  const std::vector<T> whole = whole_sequence(qkv);
  // double agrees to rounding; float to its rounding over 37 keys; bf16 to one rounding of out
  // (|out| < 2, so half an ulp is 2^-8) after float arithmetic on both sides.
  const double tolerance = std::is_same_v<T, double> ? 1e-13 : std::is_same_v<T, float> ? 2e-6 : 1.6e-2;
  const std::vector<std::vector<std::int64_t>> splits{
      std::vector<std::int64_t>(T_len, 1), {T_len}, {1, 4, 1, 13, 18}, {36, 1}};
  for (const auto& chunks : splits) {
    CAPTURE(chunks.size());
    const Decoded<T> d = decode_in_chunks(qkv, chunks, 2, T_len + 8);
    CHECK(max_difference(d.out, whole) < tolerance);
    // The cache holds each position's key and value as qkv gave them.
    bool cached = true;
    for (std::int64_t t = 0; t < T_len; ++t)
      for (std::int64_t i = 0; i < C; ++i) {
        cached = cached && as_double(d.keys[t * C + i]) == as_double(qkv[t * 3 * C + C + i]);
        cached = cached && as_double(d.values[t * C + i]) == as_double(qkv[t * 3 * C + 2 * C + i]);
      }
    CHECK(cached);
  }
}

TEST_CASE("attention_decode: the bits depend neither on the thread count nor on how later positions are chunked") {
  const std::vector<float> qkv = random_qkv<float>(9);
  const Decoded<float> one = decode_in_chunks(qkv, std::vector<std::int64_t>(T_len, 1), 1);
  CHECK(decode_in_chunks(qkv, std::vector<std::int64_t>(T_len, 1), 3).out == one.out);
  CHECK(decode_in_chunks(qkv, {1, 36}, 4).out == one.out);
  CHECK(decode_in_chunks(qkv, {1, 6, 30}, 2).out == one.out);
  // A prompt into an empty cache is attention_forward_lse's, bit for bit, on any thread count.
  cpu be(2);
  std::vector<float> out(static_cast<std::size_t>(T_len * C)), lse(static_cast<std::size_t>(heads * T_len));
  attention_forward_lse<float>(be, Tensor<float>{out.data(), Shape{1, T_len, C}}, Tensor<float>{lse.data(), Shape{1, heads, T_len}},
                               Tensor<const float>{qkv.data(), Shape{1, T_len, 3 * C}}, heads);
  CHECK(decode_in_chunks(qkv, {T_len}, 1).out == out);
  CHECK(decode_in_chunks(qkv, {T_len}, 3).out == out);
  // A prompt, then more rows: the same bits on 1 and 3 threads.
  CHECK(decode_in_chunks(qkv, {7, 30}, 3).out == decode_in_chunks(qkv, {7, 30}, 1).out);
}

TEST_CASE("attention_decode: a bad argument is refused by name") {
  cpu be(1);
  std::vector<float> qkv(3 * 3 * C), out(3 * C), keys(4 * C), values(4 * C), odd(4 * (C + 1));
  const Tensor<const float> q3{qkv.data(), Shape{3, 3 * C}};
  const Tensor<float> o3{out.data(), Shape{3, C}}, k4{keys.data(), Shape{4, C}}, v4{values.data(), Shape{4, C}};
  CHECK(contains(error_of([&] { attention_decode<float>(be, o3, q3, k4, v4, 2, heads); }),
                 "attention_decode: argument past: got 2; must be >= 0 and leave room for the 3 new rows in the "
                 "cache's 4 positions"));
  CHECK(contains(error_of([&] { attention_decode<float>(be, o3, q3, k4, v4, -1, heads); }), "argument past: got -1"));
  CHECK(contains(error_of([&] { attention_decode<float>(be, o3, q3, k4, v4, 0, 4); }),
                 "argument num_heads: got 4; must be >= 1 and divide the channels C = 15"));
  CHECK(contains(error_of([&] { attention_decode<float>(be, Tensor<float>{out.data(), Shape{2, C}}, q3, k4, v4, 0, heads); }),
                 "attention_decode: argument out"));
  CHECK(contains(error_of([&] {
                   attention_decode<float>(be, o3, Tensor<const float>{qkv.data(), Shape{3, 3 * C - 1}}, k4, v4, 0, heads);
                 }),
                 "argument qkv shape"));
  CHECK(contains(error_of([&] {
                   attention_decode<float>(be, o3, q3, Tensor<float>{odd.data(), Shape{4, C + 1}}, v4, 0, heads);
                 }),
                 "argument keys shape"));
  CHECK(contains(error_of([&] { attention_decode<float>(be, o3, q3, k4, Tensor<float>{values.data(), Shape{3, C}}, 0, heads); }),
                 "attention_decode: argument values"));
  // The last position that fits is fine.
  CHECK(error_of([&] { attention_decode<float>(be, o3, q3, k4, v4, 1, heads); }).empty());
}

}  // namespace test_kernel_attention_decode
