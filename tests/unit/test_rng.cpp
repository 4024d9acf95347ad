#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "loom/core/parameters.hpp"
#include "loom/core/rng.hpp"

namespace test_rng {

using namespace loom;

TEST_CASE("Philox4x32-10 matches the published known-answer vectors (Random123)") {
  using P = Philox4x32;
  CHECK(P::generate({0, 0, 0, 0}, {0, 0}) == P::Counter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8});
  CHECK(P::generate({~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}) ==
        P::Counter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd});
  CHECK(P::generate({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}) ==
        P::Counter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1});
}

TEST_CASE("CounterRng: pure function of (key, index); names and seeds give other streams") {
  const CounterRng a(7, "h.0.attn.qkv.weight"), b(7, "h.0.attn.qkv.weight");
  CHECK(a.normal(12345) == b.normal(12345));
  CHECK(a.normal(3) != CounterRng(8, "h.0.attn.qkv.weight").normal(3));
  CHECK(a.normal(3) != CounterRng(7, "h.1.attn.qkv.weight").normal(3));
  // Drawing out of order gives the same values.
  std::vector<double> forward, backward(1000);
  for (int i = 0; i < 1000; ++i) forward.push_back(a.normal(i));
  for (int i = 999; i >= 0; --i) backward[i] = a.normal(i);
  CHECK(forward == backward);
}

TEST_CASE("CounterRng: normal and uniform moments") {
  const CounterRng r(1, "moments");
  const int n = 200000;
  double sum = 0, sum2 = 0, usum = 0;
  bool open_interval = true;
  for (int i = 0; i < n; ++i) {
    const double x = r.normal(i);
    sum += x;
    sum2 += x * x;
    const double u = r.uniform(i, 1);
    open_interval = open_interval && u > 0.0 && u < 1.0;
    usum += u;
  }
  CHECK(open_interval);
  CHECK(std::abs(sum / n) < 0.01);
  CHECK(std::abs(sum2 / n - 1.0) < 0.01);
  CHECK(std::abs(usum / n - 0.5) < 0.01);
  for (int i = 0; i < 1000; ++i) CHECK(r.below(7, i) < 7u);
}

TEST_CASE("initial values depend only on (seed, name, index)") {
  ParameterLayout one({{"a", {4, 3}, 0, true, Partition::replicated, Init::normal(0.02)},
                       {"b", {5}, 1, false, Partition::replicated, Init::ones()}});
  ParameterLayout two({{"c", {7}, 0, false, Partition::replicated, Init::zeros()},
                       {"a", {4, 3}, 1, true, Partition::replicated, Init::normal(0.02)}});
  std::vector<double> x(one.total()), y(two.total());
  one.initialize(x.data(), 42);
  two.initialize(y.data(), 42);
  for (int i = 0; i < 12; ++i) CHECK(x[one.find("a").offset + i] == y[two.find("a").offset + i]);
  CHECK(x[one.find("b").offset] == 1.0);
  // A slice computed alone (as a tensor-parallel shard would) equals the same elements of the whole.
  const auto& e = one.find("a");
  CHECK(initial_value(42, "a", e.spec.shape, e.spec.init, 7) == x[e.offset + 7]);
  // Padded rows of a partially drawn tensor start at zero.
  ParameterLayout padded({{"wte", {4, 2}, 0, true, Partition::split_rows, Init::normal(1.0, 3)}});
  std::vector<float> p(padded.total());
  padded.initialize(p.data(), 1);
  CHECK(p[6] == 0.0f);
  CHECK(p[7] == 0.0f);
  CHECK(p[5] != 0.0f);
}

TEST_CASE("ParameterLayout rejects duplicate names, out-of-order layers and unknown lookups") {
  CHECK_THROWS_AS(ParameterLayout({{"a", {1}, 0}, {"a", {1}, 0}}), Error);
  CHECK_THROWS_AS(ParameterLayout({{"a", {1}, 1}, {"b", {1}, 0}}), Error);
  ParameterLayout l({{"a", {2}, 0}});
  CHECK_THROWS_WITH_AS(l.find("zz"), doctest::Contains("zz"), Error);
}

}  // namespace test_rng
